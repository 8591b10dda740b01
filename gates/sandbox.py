"""The gate's sandbox: the container spec every image under test runs in (the probe's and the server's alike)."""

from __future__ import annotations

import os

from skupin.builder.catalog.manifest import SkuManifest
from skupin.dockerd import BindMount, ContainerSpec

# Environment every probe container gets (the SKU's runtime env is applied on top, --threads below).
SANDBOX_ENV = {
    "HOME": "/tmp", "HF_HOME": "/tmp/hf", "XDG_CACHE_HOME": "/tmp/cache", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": "/tmp/triton",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor", "MPLCONFIGDIR": "/tmp/mpl",
}
# The tmpfs every sandboxed container gets (the root is read-only): what the image holds there the gate never sees, so
# `pins` (gates/integrity/static.py) requires it to be empty.
SANDBOX_TMPFS = {"/tmp": "rw,exec,size=1g"}


def sandbox_cpus(manifest: SkuManifest, host_cpus: int | None = None) -> float:
    """CPUs a gate container may use: the SKU's gate.cpus, else the host's CPUs - 0.5 (at least 1); never more
    than the host has (Docker refuses that)."""
    host = float(host_cpus or os.cpu_count() or 1)
    wanted = manifest.gate.cpus if manifest.gate.cpus is not None else max(1.0, host - 0.5)
    return min(float(wanted), host)


def sandbox_spec(*, manifest: SkuManifest, image: str, entrypoint: tuple[str, ...], command: tuple[str, ...],
                 mounts: tuple[BindMount, ...], labels: dict[str, str], env: dict[str, str] | None = None,
                 max_stdout_bytes: int | None = None, cpuset: str | None = None,
                 lifetime_s: float | None = None) -> ContainerSpec:
    """A container for an image under test with the gate's sandbox (probe and server alike): no network, no
    capabilities, no-new-privileges, read-only root with a tmpfs /tmp, the SKU's memory limit, a pid limit, a CPU
    limit (`sandbox_cpus`; with `cpuset`, those CPUs instead, whole and without a quota), the in-container deadline
    gate.deadline_s (`lifetime_s` instead when given), output caps, the SKU's runtime (shm, devices, groups, GPUs)
    with private IPC even where the runtime asks for the host's, and SANDBOX_ENV + the SKU's runtime env (+ `env` on
    top)."""
    runtime = manifest.runtime
    caps = {"max_stdout_bytes": max_stdout_bytes} if max_stdout_bytes is not None else {}
    return ContainerSpec(
        image=image, entrypoint=entrypoint, command=command, env={**SANDBOX_ENV, **runtime.env, **(env or {})},
        network="none", read_only=True, tmpfs=dict(SANDBOX_TMPFS), mem_limit=manifest.gate.memory,
        pids_limit=1024, shm_size=runtime.shm_size, ipc="private",
        cap_drop=("ALL",), security_opt=("no-new-privileges",), mounts=mounts,
        devices=tuple(runtime.devices), group_add=tuple(runtime.group_add), gpus=runtime.gpus == "all",
        labels=labels, cpus=None if cpuset else sandbox_cpus(manifest), cpuset=cpuset or None,
        deadline_s=float(lifetime_s if lifetime_s is not None else manifest.gate.deadline_s), **caps,
    )
