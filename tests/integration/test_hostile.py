"""Whole gate runs of hostile images that pass `pins`: every run ends in a verdict, with the right exit code, within its
deadline; nothing is written on the host outside the gate folder; no container survives, not even a `kill -9`.

Each image carries a *locked* test wheel (tests/integration/tampered.py, modes of tests/integration/derived/swap.py),
so the static check passes it and the hostile behaviour reaches the probe or the server:
- `flood`: every Python process writes 400 MB to stdout; `forge`: the probe's process prints a frame whose JSON is
  nested 100 000 deep; `plant`: every process leaves symlinks to a host path and FIFOs named like the gate's files
  wherever it can write; `sse`: the image's server streams `data: [1]`; `hang`: every process sleeps.
(tests/integration/test_sandbox.py drives the same mechanisms below the gate, with unlocked hooks.)
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skupin.dockerd import DEADLINE_GRACE_S, KILL_AFTER_S, Docker
from skupin.gates.gate import gate_image

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLANTED_TARGET = Path("/tmp/skupin-test-planted-target")  # swap.py's symlinks point here


def _gate(derived, stack, mode: str, out: Path, docker: Docker, **kwargs):
    swapped = derived.swap(mode)
    start = time.monotonic()
    verdict = gate_image(stack=swapped.stack(stack), image=swapped.image, docker=docker, out=out,
                         wheelhouse=swapped.wheelhouse, **kwargs)
    assert (out / "verdict.json").is_file() and (out / "report.md").is_file()
    assert not docker.containers(label=f"io.skupin.session={docker.session}"), "a container was left behind"
    return verdict, time.monotonic() - start


def test_an_output_flood_ends_in_could_not_run(derived, stack, docker: Docker, tmp_path: Path) -> None:
    verdict, seconds = _gate(derived, stack, "flood", tmp_path, docker)
    assert verdict.decision == "could_not_run" and verdict.exit_code == 11
    assert verdict.check("pins").status == "pass"
    assert "stdout passed its cap" in verdict.check("boot").reason, verdict.check("boot").reason
    print(f"flood: {verdict.check('boot').reason[:200]} ({seconds:.1f} s)")


def test_a_forged_nested_frame_ends_in_could_not_run(derived, stack, docker: Docker, tmp_path: Path) -> None:
    verdict, seconds = _gate(derived, stack, "forge", tmp_path, docker)
    assert verdict.decision == "could_not_run" and verdict.exit_code == 11
    assert "nested" in verdict.check("boot").reason, verdict.check("boot").reason
    print(f"forge: {verdict.check('boot').reason[:200]} ({seconds:.1f} s)")


def test_planted_links_and_fifos_never_reach_the_host(derived, stack, docker: Docker, tmp_path: Path) -> None:
    PLANTED_TARGET.unlink(missing_ok=True)
    verdict, seconds = _gate(derived, stack, "plant", tmp_path, docker)
    assert not PLANTED_TARGET.exists(), "the host followed a link the image planted"
    for path in tmp_path.rglob("*"):  # the gate folder holds only what the host wrote itself
        mode = os.lstat(path).st_mode
        assert stat.S_ISREG(mode) or stat.S_ISDIR(mode), f"{path} is a link or a FIFO"
    # the planting image computes honestly: it passes, and its numbers are the reference's
    assert verdict.decision == "pass", verdict.reason
    print(f"plant: {verdict.decision} ({seconds:.1f} s); no host file written outside {tmp_path}")


def test_a_hostile_server_stream_fails_serve_with_a_verdict(derived, stack, docker: Docker, tmp_path: Path) -> None:
    verdict, seconds = _gate(derived, stack, "sse", tmp_path, docker)
    status = {c.name: c.status for c in verdict.checks}
    assert status["pins"] == status["boot"] == status["kernels"] == status["model"] == "pass", verdict.reason
    assert status["serve"] == "fail" and verdict.exit_code == 10
    assert "not a JSON object" in verdict.check("serve").reason, verdict.check("serve").reason
    print(f"sse: {verdict.check('serve').reason[:200]} ({seconds:.1f} s)")


def test_kill_9_of_skupin_gate_leaves_no_container_past_its_deadline(derived, stack, docker: Docker,
                                                                      tmp_path: Path) -> None:
    """The real CLI, killed while its probe container runs: the container removes itself at its own deadline."""
    swapped = derived.swap("hang")
    manifest = tmp_path / "cpu-x86_64.yaml"  # the CPU SKU with a short deadline and the test lock beside it
    text = (REPO / "skus" / "cpu-x86_64.yaml").read_text().replace("deadline_s: 600", "deadline_s: 20")
    manifest.write_text(text)
    lock = swapped.lock.model_copy(update={"manifest_sha256": _manifest_sha(manifest)})
    lock.write_json(tmp_path / "cpu-x86_64.lock.json")
    env = {**os.environ, "SKUPIN_WHEELHOUSE": str(swapped.wheelhouse)}
    proc = subprocess.Popen([sys.executable, "-m", "skupin.cli", "gate", str(manifest), "--image", swapped.image,
                             "--out", str(tmp_path / "out")], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    label = "io.skupin.role=gate-probe"
    try:
        start = time.monotonic()
        while not [c for c in docker.containers(label=label) if _owner(docker, c) == proc.pid]:
            assert proc.poll() is None and time.monotonic() - start < 240, "the probe container never started"
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = time.monotonic()
    limit = 20 + DEADLINE_GRACE_S + KILL_AFTER_S + 20
    while [c for c in docker.containers(label=label) if _owner(docker, c) == proc.pid]:
        assert time.monotonic() - killed < limit, f"the container outlived its deadline by more than {limit} s"
        time.sleep(1)
    print(f"kill -9 of skupin gate: its probe container was gone {time.monotonic() - killed:.1f} s after the kill")


def _owner(docker: Docker, cid: str) -> int | None:
    try:
        labels = docker._client.api.inspect_container(cid)["Config"]["Labels"]
    except Exception:  # removed meanwhile
        return None
    value = labels.get("io.skupin.owner-pid")
    return int(value) if value and value.isdigit() else None


def _manifest_sha(path: Path) -> str:
    from skupin.builder.catalog.manifest import load_manifest, manifest_digest

    return manifest_digest(load_manifest(path))
