"""`skupin watch` against the recorded index (and a small registry) served on loopback: coupled bumps, --apply, check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skupin.builder.catalog.manifest import load_manifest
from skupin.releases.watch import markdown, watch
from skupin.releases.yamledit import set_scalars
from tests.data.index.server import serve_index, serve_registry

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "tests" / "data" / "index"
H200 = REPO / "skus" / "nvidia-h200-vllm.yaml"


def _sku(tmp_path: Path, **values: str) -> Path:
    """The H200 vLLM manifest with some scalars changed, in its own folder (name = file stem)."""
    out = tmp_path / "skus" / H200.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(set_scalars(H200.read_text(encoding="utf-8"), values), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def index_url():
    with serve_index(INDEX) as url:
        yield url


def _check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skupin.cli", "check", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_engine_patch_release_with_same_torch_is_proposed_alone(tmp_path, index_url):
    path = _sku(tmp_path, **{"stack.engine.version": "0.27.0", "description": "H200, vLLM 0.27.0"})
    report = watch(paths=[path], index_url=index_url)
    (p,) = report.proposals
    assert p.state == "bump"
    assert [(b.field, b.old, b.new) for b in p.bumps] == [("stack.engine.version", "0.27.0", "0.27.1")]


def test_engine_release_needing_new_torch_moves_torch_triton_engine_together(tmp_path, index_url):
    minor = {f"update_policy.{k}": "minor" for k in ("framework", "compiler", "engine")}
    path = _sku(tmp_path, **minor)
    before = path.read_text(encoding="utf-8")
    report = watch(paths=[path], index_url=index_url, apply=True)
    (p,) = report.proposals
    moves = {b.field: (b.old, b.new) for b in p.bumps}
    assert moves == {"stack.framework.version": ("2.13.0", "2.14.0"), "stack.compiler.version": ("3.7.1", "3.8.0"),
                     "stack.engine.version": ("0.32.0", "0.33.0")}
    assert report.applied == ("nvidia-h200-vllm",)
    assert report.stale_locks and "not relocked" in report.stale_locks[0]
    after = path.read_text(encoding="utf-8")
    m = load_manifest(path)
    assert (m.stack.framework.version, m.stack.compiler.version, m.stack.engine.version) == ("2.14.0", "3.8.0", "0.33.0")
    # comments and layout kept: every comment line survives and only the bumped lines differ
    old_lines, new_lines = before.splitlines(), after.splitlines()
    assert len(old_lines) == len(new_lines)
    changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=False) if a != b]
    assert len(changed) == 4  # three versions and the description
    assert all(not a.lstrip().startswith("#") for a, _ in changed)
    assert "vLLM 0.33.0" in m.description and "torch 2.14.0" in m.description
    result = _check(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok  nvidia-h200-vllm" in result.stdout
    body = markdown(report)
    assert "| torch | `2.13.0` | `2.14.0` |" in body and "Locks left stale" in body


def test_engine_release_needing_new_torch_is_blocked_by_patch_policy(tmp_path, index_url):
    path = _sku(tmp_path, **{"update_policy.engine": "minor"})
    before = path.read_text(encoding="utf-8")
    report = watch(paths=[path], index_url=index_url, apply=True)
    (p,) = report.proposals
    assert p.state == "blocked"
    assert "vllm 0.33.0 needs torch 2.14.0" in p.why and "framework policy 'patch'" in p.why
    assert path.read_text(encoding="utf-8") == before and report.applied == ()


def test_cli_json_and_markdown(tmp_path, index_url):
    path = _sku(tmp_path, **{"stack.engine.version": "0.14.0", "stack.framework.version": "2.9.1",
                             "stack.compiler.version": "3.5.1"})
    cmd = [sys.executable, "-m", "skupin.cli", "watch", str(path), "--index-url", index_url]
    out = subprocess.run(cmd + ["--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [b["new"] for b in data["proposals"][0]["bumps"]] == ["0.14.1"]
    md = subprocess.run(cmd + ["--markdown"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "| vllm | `0.14.0` | `0.14.1` |" in md.stdout


def test_base_image_point_release_from_registry(tmp_path, index_url):
    """A ROCm SKU whose driver comes with the base image moves to the newest 7.2.x tag of the same flavour."""
    src = REPO / "skus" / "amd-mi300x-vllm.yaml"
    path = tmp_path / "skus" / src.name
    path.parent.mkdir(parents=True)
    path.write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    store: dict = {}
    with serve_registry(store) as reg_url:
        from skupin.clients.oci import RegistryClient

        with RegistryClient(reg_url) as reg:
            digests = {}
            for tag in ("7.2.1-complete", "7.2.2-complete", "7.2.2", "7.3.0-complete"):
                body = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                   "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                              "digest": reg.push_blob("rocm/dev-ubuntu-24.04", tag.encode()),
                                              "size": len(tag)}, "layers": []}).encode()
                digests[tag] = reg.put_manifest("rocm/dev-ubuntu-24.04", tag, body,
                                                "application/vnd.oci.image.manifest.v1+json")
        report = watch(paths=[path], index_url=index_url, registry_url=reg_url)
    (p,) = report.proposals
    moves = {b.field: b.new for b in p.bumps}
    assert moves["base.image"].endswith(f":7.2.2-complete@{digests['7.2.2-complete']}")
    assert moves["stack.driver.version"] == "7.2.2"


def test_apply_relocks_what_it_can_and_lists_the_rest(tmp_path, index_url):
    from skupin.common.errors import LockError

    a = _sku(tmp_path / "a", **{"stack.engine.version": "0.27.0"})
    b = _sku(tmp_path / "b", **{"stack.engine.version": "0.14.0", "stack.framework.version": "2.9.1",
                                "stack.compiler.version": "3.5.1"})
    locked: list[str] = []

    def relock_fn(manifest, path):
        if manifest.stack.engine.version == "0.14.1":
            raise LockError("https://pypi.org/simple is not reachable")
        locked.append(manifest.stack.engine.version)

    report = watch(paths=[a, b], index_url=index_url, apply=True, relock_fn=relock_fn)
    assert locked == ["0.27.1"] and report.relocked == ("nvidia-h200-vllm",)
    assert len(report.stale_locks) == 1 and "not reachable" in report.stale_locks[0]


@pytest.mark.parametrize("page, why", [
    (b"[" * 100_000 + b"]" * 100_000, "nested 100000 levels deep"),
    (b'{"files": [], "files": []}', "duplicate key"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_a_hostile_index_answer_is_one_line_and_exit_9(tmp_path, page, why):
    """An index answering JSON nested 100,000 deep (or otherwise broken) to `watch`: one line, exit 9, no traceback."""
    import shutil
    import time

    index = tmp_path / "index"
    shutil.copytree(INDEX, index)
    (index / "simple" / "vllm.json").write_bytes(page)
    with serve_index(index) as url:
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "skupin.cli", "watch", str(H200), "--index-url", url], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - start
    text = run.stdout + run.stderr
    assert "Traceback" not in text and why in text, text
    assert run.returncode == 9 and seconds < 5, (run.returncode, seconds, text)
