"""A lock's PEP 751 form: `pylock.<sku>.toml` beside `<sku>.lock.json`, derived from it, never edited by hand.

PEP 751 names a lock file `pylock.toml` or `pylock.<name>.toml`; the file lists every Python distribution the image
installs (the four layers; not the `build` stage's wheels, which the served image does not hold) with its version and
the one file the lock pins (a wheel, or the sdist built in the image) by URL and sha256, so `uv pip install -r` and
other PEP 751 readers can install the same set. Pure: the same lock gives the same text (sorted, no timestamps).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name

from skupin.builder.catalog.lockfile import Lock, LockedPackage

PYLOCK_VERSION = "1.0"
# the image's platform (manifest base.platform) as PEP 508 markers
_MACHINES = {"linux/amd64": "x86_64", "linux/arm64": "aarch64", "linux/arm64/v8": "aarch64", "linux/ppc64le": "ppc64le",
             "linux/s390x": "s390x"}


def pylock_path(lock_file: Path) -> Path:
    """skus/x.lock.json -> skus/pylock.x.toml (PEP 751: `pylock.<name>.toml` in the same folder)."""
    return lock_file.with_name(f"pylock.{lock_file.name.removesuffix('.lock.json')}.toml")


def environment_marker(platform: str) -> str:
    """The PEP 508 marker of the image's platform, e.g. linux/amd64 -> sys_platform == 'linux' and platform_machine ==
    'x86_64'; a platform without a known machine gives only its operating system."""
    system, _, _ = platform.partition("/")
    machine = _MACHINES.get(platform)
    marker = f"sys_platform == '{system}'"
    return f"{marker} and platform_machine == '{machine}'" if machine else marker


def _s(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's; non-ASCII kept as is)."""
    return json.dumps(text, ensure_ascii=False)


def _file(package: LockedPackage) -> str:
    """The inline table of the pinned file: name, url and sha256; a wheelhouse file the lock has no URL of is named by
    `path` (its file name: PEP 751 reads it relative to the pylock, so it installs from a copy beside the wheels)."""
    fields = [f"name = {_s(package.filename)}"]
    fields.append(f"url = {_s(package.url)}" if package.url is not None else f"path = {_s(package.filename)}")
    fields.append(f"hashes = {{ sha256 = {_s(package.sha256)} }}")
    return "{ " + ", ".join(fields) + " }"


def pylock_text(lock: Lock) -> str:
    """The PEP 751 lock of `lock`'s installed Python packages, for its image's Python and platform."""
    lines = [
        f"lock-version = {_s(PYLOCK_VERSION)}",
        f"environments = [{_s(environment_marker(lock.platform))}]",
        f"requires-python = {_s(f'=={lock.python}.*')}",
        'created-by = "skupin"',
    ]
    for name, package in sorted(lock.packages().items()):
        lines += ["", "[[packages]]", f"name = {_s(str(canonicalize_name(name)))}", f"version = {_s(package.version)}"]
        if package.filename.endswith(".whl"):
            lines.append(f"wheels = [{_file(package)}]")
        else:  # a source distribution the image builds (source sdist; url/git sources as the lock records their file)
            lines.append(f"sdist = {_file(package)}")
    lines += ["", "[tool.skupin]", f"sku = {_s(lock.sku)}", f"lock-sha256 = {_s(lock.content_hash())}"]
    return "\n".join(lines) + "\n"


def pylock_missing(lock_file: Path) -> str | None:
    """A note when no pylock lies beside `lock_file` (a lock copied alone is still the lock: the note says how to make
    its PEP 751 form), else None."""
    path = pylock_path(lock_file)
    if path.is_symlink() or path.exists():
        return None
    return f"no {path.name} beside it (python -m skupin.builder.catalog.pylock {lock_file} writes it)"


def pylock_problem(lock: Lock, lock_file: Path) -> str | None:
    """Why the pylock beside `lock_file` is not `lock`'s (a link, not a file, or other text), or None when it is or
    when there is none (pylock_missing says so)."""
    path = pylock_path(lock_file)
    fix = f"(rewrite it from the lock: python -m skupin.builder.catalog.pylock {lock_file})"
    if not path.is_symlink() and not path.exists():
        return None
    if path.is_symlink() or not path.is_file():
        return f"{path.name} is not a regular file {fix}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path.name} unreadable: {exc} {fix}"
    return None if text == pylock_text(lock) else f"{path.name} differs from the lock {fix}"


def write_pylock(lock: Lock, lock_file: Path) -> Path:
    """Write `lock`'s pylock beside `lock_file` (atomic replace); returns its path."""
    path = pylock_path(lock_file)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # a unique name: never a
    try:                                                                                 # planted link written through
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(pylock_text(lock))
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str]) -> int:
    """`python -m skupin.builder.catalog.pylock LOCK...`: write each lock's pylock (no resolution, no network)."""
    from skupin.builder.catalog.lockfile import read_lock
    from skupin.common.errors import LockError

    if not argv:
        print("usage: python -m skupin.builder.catalog.pylock skus/SKU.lock.json ...", file=sys.stderr)
        return 2
    for name in argv:
        try:
            print(write_pylock(read_lock(Path(name)), Path(name)))
        except LockError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 4
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
