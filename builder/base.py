"""Make a SKU's base image available locally: reuse, debootstrap + `docker import`, or pull by digest."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from builder.manifest import Bootstrap, SkuManifest
from common.apt import apt_install
from common.errors import BuildError, DockerError
from dockerd import Docker

OnEvent = Callable[[str], None]

def _quiet(_: str) -> None:
    return None


def ensure_base(*, manifest: SkuManifest, docker: Docker, on_event: OnEvent = _quiet) -> str:
    """Return the image id of the SKU's base, making it locally when it is missing.

    Bootstrap bases: reuse the local tag `Bootstrap.local_tag()` when present, else run
    debootstrap and `docker import` the tree. Image bases: use the local copy, else pull by
    digest (DockerError when no registry is reachable).
    """
    ref = manifest.base.reference
    info = docker.inspect_image(ref)
    if info is not None:
        on_event(f"base {ref} present ({info.id})")
        return info.id
    if manifest.base.bootstrap is not None:
        return _bootstrap(recipe=manifest.base.bootstrap, docker=docker, on_event=on_event)
    on_event(f"base {ref} not present locally: pulling by digest")
    try:
        return docker.pull(ref)
    except DockerError as exc:
        raise DockerError(
            f"base image {ref} of SKU {manifest.name} is not on this engine and cannot be pulled ({exc}); "
            "fix: `docker load` it here, or give the SKU a base.bootstrap recipe"
        ) from exc


def _ensure_debootstrap(on_event: OnEvent) -> str:
    found = shutil.which("debootstrap") or (os.access("/usr/sbin/debootstrap", os.X_OK) and "/usr/sbin/debootstrap")
    if found:
        return str(found)
    apt_install("debootstrap", why="debootstrap not found", error=BuildError, on_event=on_event)
    return shutil.which("debootstrap") or "/usr/sbin/debootstrap"


def _bootstrap(*, recipe: Bootstrap, docker: Docker, on_event: OnEvent) -> str:
    tool = _ensure_debootstrap(on_event)
    tag = recipe.local_tag()
    with tempfile.TemporaryDirectory(prefix="skupin-base-") as tmp:
        root = Path(tmp) / "rootfs"
        cmd = [tool, f"--variant={recipe.variant}"]
        if recipe.include:
            cmd.append("--include=" + ",".join(recipe.include))
        cmd += [recipe.suite, str(root), str(recipe.mirror)]
        on_event(f"bootstrapping {tag}: {' '.join(cmd)}")
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
            raise BuildError(f"debootstrap of {recipe.suite} ({recipe.variant}) failed (exit {proc.returncode}):\n{tail}")
        on_event(f"debootstrap done in {time.monotonic() - start:.1f} s")
        _clean_tree(root)
        image_id = docker.import_rootfs(rootfs=root, reference=tag, on_event=on_event)
    info = docker.inspect_image(tag)
    if info is None:
        raise BuildError(f"imported base {tag} but the engine does not show it")
    on_event(f"base {tag} made: {info.id} (layer {info.layers[0] if info.layers else '?'})")
    return info.id or image_id


def _clean_tree(root: Path) -> None:
    """Drop apt's downloaded archives and lists: they are not part of the base's content."""
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = root / sub
        if d.is_dir():
            for p in d.iterdir():
                if p.is_file() and p.name != "lock":
                    p.unlink()
