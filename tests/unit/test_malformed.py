"""Malformed inputs through the CLI (issue 20): each ends with one error line and its documented exit code, quickly,
with no traceback: locks, --out targets, reference bundles, server JSON, manifests with several problems."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from skupin.cli import main
from skupin.clients.transport import server_json
from tests.paths import REPO, SKUS

CPU = "cpu-x86_64"


@pytest.fixture
def catalog(tmp_path, monkeypatch) -> Path:
    """A catalog holding the CPU SKU and its lock; the tests run from inside it."""
    root = tmp_path / "catalog"
    (root / "skus").mkdir(parents=True)
    for name in (f"{CPU}.yaml", f"{CPU}.lock.json"):
        shutil.copy(SKUS / name, root / "skus" / name)
    monkeypatch.chdir(root)
    monkeypatch.delenv("SKUPIN_ROOT", raising=False)
    return root


def _cli(args: list[str], capsys) -> tuple[int, str, float]:
    start = time.monotonic()
    code = main(args)
    seconds = time.monotonic() - start
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text, text
    return code, text, seconds


def _lock(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "list":
        path.write_text("[]")
    elif kind == "truncated":
        path.write_bytes((SKUS / f"{CPU}.lock.json").read_bytes()[:300])
    elif kind == "not-utf8":
        path.write_bytes(b"\xff\xfe{}")
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)


@pytest.mark.parametrize("kind, why", [
    ("list", "(the whole file): Input should be a valid dictionary"),
    ("truncated", "not valid JSON: Unterminated string"),
    ("not-utf8", "codec can't decode byte 0xff"),
    ("deep", "nested 100000 levels deep"),
    ("folder", "not a regular file"),
    ("fifo", "not a regular file"),  # never opened for a blocking read
])
def test_a_malformed_lock_fails_check_with_exit_4(catalog, capsys, kind, why):
    _lock(catalog / "skus" / f"{CPU}.lock.json", kind)
    code, text, seconds = _cli(["check"], capsys)
    assert code == 4 and why in text and "fix: skupin lock cpu-x86_64" in text, text
    assert seconds < 1
    code, text, _ = _cli(["check", "--json"], capsys)
    report = json.loads(text)
    assert code == 4 and report["exit_code"] == 4 and report["manifests"][0]["lock"] == "stale"


def test_a_stale_lock_fails_check_the_way_build_would(catalog, capsys):
    lock = catalog / "skus" / f"{CPU}.lock.json"
    data = json.loads(lock.read_text())
    data["omitted"] = {"torchvision": "not needed"}  # as if stack.omit had changed what gets installed since the lock
    lock.write_text(json.dumps(data))
    code, text, _ = _cli(["check"], capsys)
    assert code == 4 and "stack.omit differs from the lock" in text, text
    assert "1 of 1 lock(s) are stale: a build would refuse them; fix: skupin lock cpu-x86_64" in text


@pytest.mark.parametrize("target, why", [
    ("existing-file", "exists and is not a folder"),
    ("/dev/null", "a system folder"),
    ("/proc", "a system folder"),
    ("/proc/self/x", "a system folder"),
])
def test_render_out_refuses_what_is_not_a_folder_before_fetching_anything(catalog, capsys, target, why):
    (catalog / "existing-file").write_text("keep me")
    code, text, seconds = _cli(["render", CPU, "--out", target], capsys)
    assert code == 2 and f"--out {target}: {why}" in text and seconds < 1, text
    assert (catalog / "existing-file").read_text() == "keep me"


@pytest.mark.parametrize("meta, why", [
    (b"[1, 2]", "format None is not skupin-bundle/1"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nested 5000 levels deep"),
    (b"\xff", "not valid JSON"),
])
def test_a_bundle_with_a_malformed_meta_is_refused_with_exit_7(tmp_path, capsys, meta, why):
    import hashlib

    bundle = tmp_path / "bundle"
    shutil.copytree(REPO / "gates/references/tiny-llama/h200-float32", bundle)
    (bundle / "meta.json").write_bytes(meta)
    sums = [line for line in (bundle / "SHA256SUMS").read_text().splitlines() if not line.endswith("meta.json")]
    sums.append(f"{hashlib.sha256(meta).hexdigest()}  meta.json")
    (bundle / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    code, text, seconds = _cli(["reference", "verify", str(bundle), "--sku", CPU], capsys)
    assert code == 7 and why in text and seconds < 1, text


@pytest.mark.parametrize("body, why", [
    (b"[" * 50_000 + b"]" * 50_000, "nested 50000 levels deep"),
    (b'{"files": [], "files": []}', "duplicate key"),
    (b"\xff", "not valid JSON"),
    (b'{"a": NaN}', "NaN is not JSON"),
])
def test_json_from_a_server_is_bounded(body, why):
    with pytest.raises(ValueError, match=why):
        server_json(body, source="https://index.example/simple/vllm/")


def test_every_problem_of_a_manifest_at_once_the_file_name_and_the_pins(catalog, capsys):
    other = catalog / "skus" / "other.yaml"
    other.write_text((SKUS / f"{CPU}.yaml").read_text().replace("version: 2.13.0+cpu", "version: 2.3.0+cpu"))
    code, text, _ = _cli(["check", str(other)], capsys)
    assert code == 2, text
    assert "name: 'cpu-x86_64' differs from the file name" in text
    assert "transformers 5.24.0 requires torch >=2.6, not 2.3.0+cpu" in text
