"""Lock the CPU SKU for real: pip against PyPI plus the local wheelhouse (needs PyPI and /opt/wheels)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from skupin.builder.catalog.lockfile import PY_LAYERS, image_tag
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.lock import lock_sku, tcp_reachable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CPU = REPO / "skus" / "cpu-x86_64.yaml"
WHEELHOUSE = Path(os.environ.get("SKUPIN_WHEELHOUSE", "/opt/wheels"))
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"


@pytest.fixture(scope="module")
def cpu_locks():
    if not (WHEELHOUSE / TORCH_WHEEL).is_file():
        pytest.skip(f"no {TORCH_WHEEL} in {WHEELHOUSE} (set SKUPIN_WHEELHOUSE)")
    if not tcp_reachable("https://pypi.org/simple"):
        pytest.skip("PyPI is unreachable from this machine")
    manifest = load_manifest(CPU)
    lines: list[str] = []
    locks = [
        lock_sku(manifest=manifest, manifest_path=CPU, wheelhouse=WHEELHOUSE,
                 progress=lines.append)
        for _ in range(2)
    ]
    return manifest, locks, lines


def test_cpu_lock_layers_and_hashes(cpu_locks):
    manifest, (lock, _), lines = cpu_locks
    packages = lock.packages()
    torch = packages["torch"]
    assert torch in lock.layers["framework"]
    assert (torch.version, torch.source, torch.filename) == ("2.13.0+cpu", "wheelhouse", TORCH_WHEEL)
    assert torch.sha256 == hashlib.sha256((WHEELHOUSE / TORCH_WHEEL).read_bytes()).hexdigest()
    assert packages["transformers"] in lock.layers["engine"]
    assert packages["transformers"].version == manifest.stack.engine.version
    for pin in manifest.extras.python:
        assert packages[canonicalize_name(pin.name)].version == pin.version
    names = [p.name for layer in PY_LAYERS for p in lock.layers[layer]]
    assert len(names) == len(set(names)), "layers overlap"
    for pkg in packages.values():
        assert len(pkg.sha256) == 64 and pkg.filename.endswith(".whl"), pkg
        if pkg.source == "index":
            assert pkg.url and pkg.url.startswith("https://")
    assert lock.system["compiler"] == ("g++-12=12.2.0-14+deb12u1",)
    assert any("resolved" in line for line in lines)


def test_cpu_lock_twice_names_the_same_image(cpu_locks):
    manifest, (first, second), _ = cpu_locks
    assert first.content_hash() == second.content_hash()
    version = manifest.stack.engine.version
    assert image_tag(sku=manifest.name, engine_version=version, lock=first, dockerfile_sha256="d" * 64) == image_tag(
        sku=manifest.name, engine_version=version, lock=second, dockerfile_sha256="d" * 64
    )
