"""Install a Debian package on this host with apt-get (the engine, debootstrap, the local registry), only when asked.

System packages are installed only when the user allowed it: `skupin --install-missing ...` (`allow_installs`) or
SKUPIN_INSTALL_MISSING=1 (scripts/run and scripts/test set it). Otherwise a missing package is an error naming it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

from skupin.common.errors import SkupinError

ENV = "SKUPIN_INSTALL_MISSING"
_allowed = False


def allow_installs(allowed: bool = True) -> None:
    global _allowed
    _allowed = allowed


def installs_allowed() -> bool:
    return _allowed or os.environ.get(ENV) == "1"


def apt_install(package: str, *, why: str, error: type[SkupinError], on_event: Callable[[str], None]) -> None:
    """`apt-get update && apt-get install -y PACKAGE` when installs are allowed; `error` (with the log tail) when
    either step fails, and `error` naming the package and the fix when installs are not allowed."""
    if not installs_allowed():
        raise error(f"{why}: Debian's {package} is needed; fix: `apt-get install {package}`, or let skupin install "
                    f"it: `skupin --install-missing ...` (or {ENV}=1)")
    on_event(f"{why}: installing Debian's {package} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", package]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise error(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
