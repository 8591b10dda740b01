"""The apt closure of the CPU SKU read for real in its bootstrapped base (a Docker engine and the Debian mirror; ~6 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skupin.builder.aptlock import host_facts
from skupin.builder.catalog.lockfile import read_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.render import render_manifest
from skupin.common.errors import LockError
from skupin.dockerd import Docker

pytestmark = pytest.mark.integration

CPU = Path(__file__).resolve().parents[2] / "skus" / "cpu-x86_64.yaml"


def test_the_cpu_bases_closure_is_every_package_each_apt_layer_adds(docker: Docker) -> None:
    manifest = load_manifest(CPU)
    if not docker.image_exists(manifest.base.reference):
        pytest.skip(f"no {manifest.base.reference} on this engine (`skupin base cpu-x86_64` makes it)")
    events: list[str] = []
    try:
        facts = host_facts(manifest=manifest, docker=docker, on_event=events.append)
    except LockError as exc:
        if "apt-get update" in str(exc):
            pytest.skip(f"the base's Debian mirror is unreachable from here: {exc}")
        raise
    closure = facts.apt_closure
    assert closure is not None and set(closure) == {"python", "compiler"}
    names = {layer: {item.partition("=")[0] for item in items} for layer, items in closure.items()}
    assert {"ca-certificates", "python3.11", "python3.11-venv", "libpython3.11-stdlib", "libssl3"} <= names["python"]
    assert {"g++-12", "gcc-12", "cpp-12", "binutils", "libc6-dev", "libstdc++-12-dev"} <= names["compiler"]
    assert not names["python"] & names["compiler"]  # a layer holds what it adds over the ones below
    compiler = dict(item.partition("=")[::2] for item in closure["compiler"])
    assert compiler["g++-12"] == manifest.stack.compiler.source.version  # type: ignore[union-attr]
    assert any(event.startswith("apt closure: python ") for event in events)
    # the committed lock's render installs exactly this closure while the archive has not moved on
    lock = read_lock(CPU.with_name("cpu-x86_64.lock.json"))
    if lock.apt_closure == closure:
        text = render_manifest(manifest=manifest, lock=lock).text
        assert all(f" {item}" in text for items in closure.values() for item in items)
