"""The Docker adapter (dockerd) against a real daemon: readiness, base reuse, the container sandbox."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from skupin.builder.base import ensure_base
from skupin.builder.catalog.manifest import Base, load_manifest
from skupin.common.errors import DockerError
from skupin.dockerd import BindMount, ContainerSpec, Docker, ensure_dockerd

from .conftest import CPU_SKU

pytestmark = pytest.mark.integration


def _dockerd_pids() -> set[str]:
    out = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True, check=False).stdout
    return set(out.split())


@pytest.fixture(scope="module")
def base_image(docker: Docker) -> str:
    """The CPU SKU's bootstrap base (made if missing: debootstrap takes ~30 s)."""
    return ensure_base(manifest=load_manifest(CPU_SKU), docker=docker)


def test_docker_up_is_idempotent(docker: Docker) -> None:
    pids = _dockerd_pids()
    events: list[str] = []
    status = ensure_dockerd(on_event=events.append, socket=docker.socket)
    assert status.action == "already running"
    assert status.server_version == docker.ping()
    assert status.pid is None
    assert _dockerd_pids() == pids  # nothing started, nothing restarted
    assert any("already running" in e for e in events)


def test_cli_engine_up_alias_is_idempotent(docker: Docker, capsys: pytest.CaptureFixture[str]) -> None:
    from skupin.cli import main

    pids = _dockerd_pids()
    assert main(["engine", "up"]) == 0
    assert "already running" in capsys.readouterr().out
    assert _dockerd_pids() == pids


def test_bootstrap_base_is_reused(docker: Docker, base_image: str) -> None:
    manifest = load_manifest(CPU_SKU)
    events: list[str] = []
    again = ensure_base(manifest=manifest, docker=docker, on_event=events.append)
    assert again == base_image
    assert not any("debootstrap" in e for e in events), events
    info = docker.inspect_image(manifest.base.bootstrap.local_tag())
    assert info is not None and info.id == base_image and len(info.layers) == 1


def test_missing_image_base_without_registry_is_a_clear_engine_error(docker: Docker) -> None:
    manifest = load_manifest(CPU_SKU)
    ref = "registry.invalid/skupin/none@sha256:" + "0" * 64
    base = Base.model_validate({**manifest.base.model_dump(), "bootstrap": None, "image": ref})
    with pytest.raises(DockerError) as err:
        ensure_base(manifest=manifest.model_copy(update={"base": base}), docker=docker)
    assert ref in str(err.value) and "cannot be pulled" in str(err.value)
    assert err.value.exit_code == 6


def _probe_spec(image: str, script: str, **kw) -> ContainerSpec:
    return ContainerSpec(image=image, entrypoint=("/bin/sh", "-c", script), **kw)


def test_sandbox_defaults_hold(docker: Docker, base_image: str) -> None:
    script = (
        "grep CapEff /proc/self/status; grep NoNewPrivs /proc/self/status; "
        "ls /sys/class/net; touch /rootfs-write 2>/dev/null && echo ROOT-WRITABLE; "
        "touch /tmp/ok && echo TMP-WRITABLE; id -u; echo ENV=$SKUPIN_X"
    )
    res = docker.run(_probe_spec(base_image, script, user="65534:65534", env={"SKUPIN_X": "42"}), deadline_s=60)
    assert res.exit_code == 0, res.stderr
    out = res.stdout
    assert "CapEff:\t0000000000000000" in out
    assert "NoNewPrivs:\t1" in out
    assert out.split("NoNewPrivs:\t1\n")[1].split("\n")[0] == "lo"  # network none: loopback only
    assert "ROOT-WRITABLE" not in out and "TMP-WRITABLE" in out
    assert "65534" in out and "ENV=42" in out


def test_read_only_bind_mount(docker: Docker, base_image: str, tmp_path: Path) -> None:
    (tmp_path / "probe.txt").write_text("hello from the host\n")
    spec = _probe_spec(base_image, "cat /probe/probe.txt; echo x > /probe/new 2>/dev/null || echo RO",
                       mounts=(BindMount(source=tmp_path, target="/probe"),))
    res = docker.run(spec, deadline_s=60)
    assert res.stdout.splitlines() == ["hello from the host", "RO"]
    assert not (tmp_path / "new").exists()


def test_deadline_kills_and_removes(docker: Docker, base_image: str) -> None:
    name = f"skupin-test-{uuid.uuid4().hex[:8]}"
    res = docker.run(_probe_spec(base_image, "sleep 120", name=name), deadline_s=2)
    assert res.timed_out and res.exit_code is None and res.seconds < 60
    assert name not in _names(docker)


def test_container_is_removed_on_exception(docker: Docker, base_image: str) -> None:
    name = f"skupin-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(KeyboardInterrupt):
        with docker.container(_probe_spec(base_image, "sleep 120", name=name)) as c:
            assert c.running()
            assert c.exec(["/bin/sh", "-c", "echo in-there"]).output.strip() == "in-there"
            assert c.pid() > 0
            raise KeyboardInterrupt
    assert name not in _names(docker)


def test_memory_limit_applies(docker: Docker, base_image: str) -> None:
    res = docker.run(
        _probe_spec(
            base_image,
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null; true",
            mem_limit="64m",
        ),
        deadline_s=60,
    )
    assert str(64 * 1024 * 1024) in res.stdout


def _names(docker: Docker) -> set[str]:
    out = subprocess.run([docker.cli(), "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                         env={"DOCKER_HOST": f"unix://{docker.socket}", "PATH": "/usr/bin:/bin"}, check=True).stdout
    return set(out.split())
