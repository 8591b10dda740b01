"""Install a Debian package on this host with apt-get (the engine, debootstrap, the local registry)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

from common.errors import SkupinError


def apt_install(package: str, *, why: str, error: type[SkupinError], on_event: Callable[[str], None]) -> None:
    """`apt-get update && apt-get install -y PACKAGE`; `error` (with the log tail) when either step fails."""
    on_event(f"{why}: installing Debian's {package} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", package]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise error(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
