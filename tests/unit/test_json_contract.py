"""The machine-output contract of every `--json` command (skupin/cli/output.py): on success one JSON object with
"ok": true, "error": null, the command's result (an object's fields at the top level, a list under its named key)
and "warnings"; on failure the same three keys with the error. Each command that runs here without Docker or the
network is run; every `--json` command's handler is held to writing through `emit` (or, for `check` and `gate`,
the contract's fields built beside their own)."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import textwrap
from pathlib import Path

import pytest

from skupin.cli import build_parser, main
from skupin.cli.output import contract, reset_warnings, warn
from skupin.common.errors import PublishError
from tests.paths import REPO

INDEX = REPO / "tests" / "data" / "index"
# handlers that put the contract's fields beside their own result without emit(): check (each manifest's warnings
# at the top too) and gate (the verdict, whose exit code is the verdict's)
OWN_CONTRACT = {"cmd_check", "cmd_gate"}


def _json_commands() -> dict[str, object]:
    """'keys list' -> its handler, for every leaf command that takes --json."""
    found: dict[str, object] = {}

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, (*prefix, name))
        if "--json" in parser._option_string_actions:
            found[" ".join(prefix)] = parser.get_default("func")

    walk(build_parser(), ())
    return found


def _stdout_json_calls(func: object) -> list[str]:
    """Calls in `func`'s source that write `json.dumps(...)` to stdout (out, _out, print) instead of emit()."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))  # type: ignore[arg-type]
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("out", "_out", "print"):
            inner = node.args[0] if node.args else None
            if isinstance(inner, ast.Call) and ast.unparse(inner.func) == "json.dumps":
                bad.append(ast.unparse(node)[:100])
    return bad


def test_every_json_command_writes_through_the_contract():
    commands = _json_commands()
    assert {"keys list", "keys generate", "verify", "build", "lock", "watch", "compat refresh", "ab", "init"} <= set(commands)
    for name, func in commands.items():
        handler = getattr(func, "__name__", "")
        source = inspect.getsource(func)  # type: ignore[arg-type]
        if handler in OWN_CONTRACT:
            assert '"ok": True, "error": None, "warnings": warnings()' in source and "failure(" in source, name
        else:
            assert _stdout_json_calls(func) == [], f"`skupin {name} --json` writes JSON around the contract (use emit)"
            assert "emit(" in source or "cmd_verify_keyless(" in source, f"`skupin {name} --json` does not emit()"


def test_the_success_object():
    reset_warnings()
    warn("something to know")
    obj = contract({"sku": "s", "ok": "its own", "warnings": ["dropped"]})
    assert obj == {"ok": True, "error": None, "sku": "s", "warnings": ["something to know"]}
    assert list(obj)[:2] == ["ok", "error"] and list(obj)[-1] == "warnings"
    failed = contract({"keys": []}, PublishError("no trusted keys", fix="skupin keys generate"))
    assert failed["ok"] is False and failed["keys"] == [] and failed["error"]["code"] == 8
    assert failed["error"]["fix"] == "skupin keys generate" and failed["warnings"] == ["something to know"]
    reset_warnings()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    reset_warnings()
    code = main(argv)
    text = capsys.readouterr().out.strip()
    try:
        return code, json.loads(text)
    except ValueError:  # a line per item first (lock, with several SKUs): the last line is the object
        return code, json.loads(text.splitlines()[-1])


def _ok(obj: dict) -> dict:
    assert obj["ok"] is True and obj["error"] is None and isinstance(obj["warnings"], list), obj
    return obj


def test_keys_generate_and_list(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path / "state"))
    code, made = _run(["keys", "generate", "--out", str(tmp_path / "keys"), "--json"], capsys)
    assert code == 0 and _ok(made)["keyid"]
    code, listed = _run(["keys", "list", "--key", made["public"], "--json"], capsys)
    assert code == 0 and _ok(listed)["keys"] == [{"keyid": made["keyid"], "source": made["public"]}]
    (tmp_path / "catalog" / "skus").mkdir(parents=True)  # a catalog with no keys/trusted/
    monkeypatch.chdir(tmp_path / "catalog")
    monkeypatch.setenv("SKUPIN_ROOT", str(tmp_path / "catalog"))
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path / "empty-state"))
    code, none = _run(["keys", "list", "--json"], capsys)
    assert code == 8 and none["ok"] is False, none
    assert none["ok"] is False and none["keys"] == [] and none["error"]["kind"] == "publish"
    assert "skupin keys generate" in none["error"]["fix"]


def test_init_check_and_the_catalog_commands(tmp_path: Path, capsys, monkeypatch):
    code, made = _run(["init", str(tmp_path / "cat"), "--json"], capsys)
    assert code == 0 and _ok(made)["written"]
    monkeypatch.chdir(tmp_path / "cat")
    code, checked = _run(["check", "--no-lock", "--json"], capsys)
    assert code == 0 and _ok(checked)["manifests"]
    code, pruned = _run(["wheels", "prune", "--dry-run", "--store", str(tmp_path / "store"), "--json"], capsys)
    assert code == 0 and _ok(pruned)["removed"] == []


def test_reference_verify_and_fixture_check(capsys):
    code, verified = _run(["reference", "verify", "gates/references/tiny-llama/h200-bfloat16", "--json"], capsys)
    assert code == 0 and _ok(verified)["meta"]["dtype"] == "bfloat16"
    code, fixture = _run(["fixture", "generate", "--name", "tiny-llama", "--check", "--json"], capsys)
    assert code == 0 and _ok(fixture)["written"] is False


def test_watch_and_compat_refresh_against_the_recorded_index(tmp_path: Path, capsys):
    from tests.data.index.server import serve_index

    with serve_index(INDEX) as url:
        code, watched = _run(["watch", str(REPO / "skus" / "nvidia-h200-vllm.yaml"), "--index-url", url, "--json"],
                             capsys)
        assert code == 0 and _ok(watched)["proposals"][0]["sku"] == "nvidia-h200-vllm"
        code, refreshed = _run(["compat", "refresh", "--index-url", url, "--out", str(tmp_path / "compat.yaml"),
                                "--json"], capsys)
    assert code == 0 and _ok(refreshed)["engine_rows"] > 0
