"""The static `pins` check on real images: the honest CPU image's files are its lock; every change outside the lock fails
before the image runs.

Tampered images are thin layers FROM the honest image (tests/integration/tampered.py). Each is gated for real; the
verdict must fail at `pins` (exit 10) with the finding that names the changed file, and `boot` must not have run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skupin.builder.render import render
from skupin.common.paths import state_dir
from skupin.dockerd import ContainerSpec, Docker
from skupin.gates.gate import gate_image
from skupin.gates.integrity.static import inspect_image_files
from skupin.imageview.layers import image_view

pytestmark = pytest.mark.integration


def test_the_honest_image_is_its_lock(honest_image: str, stack, docker: Docker, wheelhouse) -> None:
    report = inspect_image_files(docker=docker, image_id=honest_image, lock=stack.lock, state=state_dir(),
                                 dockerfile=render(stack).text, wheelhouse=wheelhouse)
    assert report.ok, (report.findings[:5], report.unverifiable)
    counts = report.counts
    assert counts["wheel_files_verified"] > 20_000 and counts["bytecode_verified"] > 5_000
    assert counts["debian_files_verified"] > 5_000 and counts["base_files"] > 1_000
    print(f"honest image: {counts}; interpreter {report.interpreter}")


@pytest.mark.parametrize("mode, kind, where", [
    ("hook", "hook", "site-packages/zz_gateaware.pth"),
    ("drift", "wheel", "safetensors-0.8.0.dist-info/METADATA"),
    ("extra", "extra_distribution", "skupin_test_extra-1.0.dist-info/METADATA"),
    ("label", "label", ""),
    ("bytecode", "bytecode", "safetensors/__pycache__/__init__.cpython-311.pyc"),
    ("debian", "debian", "usr/lib/python3.11/json/__init__.py"),
    ("binary", "executable", "usr/local/bin/skupin-test-binary"),
    ("preload", "config", "etc/ld.so.preload"),
    ("path", "config", "sets PATH='/opt/evil:"),
    ("path", "unaccounted", "/opt/evil/transformers: "),
    ("dpkg-fake", "debian", "skupin-test-fake 1.0 (amd64) is a Debian package outside the lock"),
    ("dpkg-list", "debian", "site-packages/zz_dpkg.pth: libpython3.11-stdlib"),
])
def test_a_change_outside_the_lock_fails_pins_before_anything_runs(mode, kind, where, derived, stack,
                                                                   docker: Docker, tmp_path: Path) -> None:
    image = derived.tamper(mode)
    verdict = gate_image(stack=stack, image=image, docker=docker, out=tmp_path)
    pins = verdict.check("pins")
    assert verdict.decision == "fail" and verdict.exit_code == 10, verdict.reason
    assert pins.status == "fail", pins.reason
    assert verdict.check("boot").status == "skipped"  # the tampered image never ran
    assert pins.details["finding_kinds"].get(kind), pins.details["findings"][:5]
    assert any(where in line for line in pins.details["findings"]), pins.details["findings"][:5]
    data = json.loads((tmp_path / "verdict.json").read_text())
    assert data["checks"][1]["name"] == "pins" and data["checks"][1]["status"] == "fail"
    print(f"{mode}: {pins.reason[:300]}")


def test_the_gate_aware_hook_really_behaves_only_under_the_gate(derived, docker: Docker) -> None:
    """Why the check must be static: the hooked image computes SiLU wrong with a network, right in the gate's sandbox."""
    image = derived.tamper("hook")
    code = ("import torch, torch.nn.functional as F; x = torch.linspace(-4, 4, 64); "
            "print(float((F.silu(x) - x * torch.sigmoid(x)).abs().max()))")
    errors = {}
    for network in ("none", "bridge"):
        spec = ContainerSpec(image=image, entrypoint=("python3", "-c", code), network=network, mem_limit="2g")
        result = docker.run(spec, deadline_s=120)
        assert result.exit_code == 0, result.stderr[-2000:]
        errors[network] = float(str(result.stdout).strip().splitlines()[-1])
    assert errors["none"] < 1e-5  # rounding only
    assert errors["bridge"] > 1e-3


def test_the_path_attack_really_runs_a_data_file_with_the_images_own_command(derived, docker: Docker) -> None:
    """Why PATH, the working folder and links are judged: the `path` image's unchanged CMD runs /srv/serve."""
    result = docker.run(ContainerSpec(image=derived.tamper("path"), network="none", mem_limit="1g"), deadline_s=120)
    assert "skupin-test: /srv/serve ran instead of the server" in str(result.stdout_excerpt), result.stderr[-2000:]


def test_layers_read_from_disk_and_from_docker_save_agree(docker: Docker, stack, tmp_path: Path) -> None:
    base = docker.inspect_image(stack.lock.base.reference)
    assert base is not None, "the CPU SKU's bootstrap base is not on this engine"
    on_disk = image_view(docker=docker, image=base.id, layers=base.layers, cache=tmp_path / "disk")

    class Streamed:  # the same engine, with its layer folders hidden: `docker save` is used instead
        def __getattr__(self, name):
            return getattr(docker, name)

        def layer_dirs(self, ref: str):
            return None

    streamed = image_view(docker=Streamed(), image=base.id, layers=base.layers, cache=tmp_path / "tar")
    assert on_disk.entries == streamed.entries
    assert len(on_disk.entries) > 3000
    assert on_disk.read_file("var/lib/dpkg/status") == streamed.read_file("var/lib/dpkg/status")
