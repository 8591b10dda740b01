"""Writing the host's own files: atomically, under a temporary name no other writer shares, and `--out` targets checked
before any work is done."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from skupin.common.errors import UsageError

SYSTEM_FOLDERS = ("/proc", "/sys", "/dev")


def write_atomic(path: Path | str, data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """Replace `path` with `data` in one step: written to a fresh temporary file in the same folder (a unique name, so two
    writers never share one), flushed to disk, then renamed over `path`. A reader sees the old file or the new one,
    never a mix; a failed write leaves `path` as it was and no temporary behind. A new file gets the mode a plain
    `open(..., "w")` would; an existing file keeps its mode."""
    path = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else data
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread for a moment)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def writable_file(path: Path | str, *, flag: str) -> Path:
    """`flag`'s FILE target, checked before any work: not a folder, not under /proc, /sys or /dev, in an existing folder
    this user can write. UsageError (exit 2) naming the flag and the fix otherwise."""
    path = Path(path)
    resolved = path.resolve()
    if any(resolved.is_relative_to(system) for system in SYSTEM_FOLDERS):
        raise UsageError(f"{flag} {path}: a system path, not a file of yours; fix: name a file of your own")
    if resolved.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; fix: name a file (for example {path}/out.json)")
    folder = resolved.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: its folder {folder} does not exist; fix: make it first, or name another file")
    if not os.access(folder, os.W_OK | os.X_OK) or (resolved.exists() and not os.access(resolved, os.W_OK)):
        raise UsageError(f"{flag} {path}: cannot be written by this user; fix: name a file you can write")
    return path
