"""The host's record of a wheel built from a locked sdist inside an image's build stage (stack.engine.source sdist).

The lock cannot hash a wheel that does not exist before the build. So `skupin build` exports the
build stage's wheel (the stage that holds nothing else, builder/render.py ENGINE_WHEEL_STAGE) right
after BuildKit made the image, puts it into the wheel store (content-addressed) and writes
`.skupin/built/<lock sha256>.json`: which sdist it was built from and the wheel's file name and
sha256. The gate's pins check (gates/integrity/static.py) then verifies every file the image's
venv holds for that distribution against this wheel, from the host's store, exactly as it does for
locked wheels: what the gate trusts is what this host's builder recorded, never what the image
says about itself. A wheel of another build of the same lock (compilers are not bit-reproducible
here) fails the check until that image is built again here.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from skupin.builder.catalog.grammar import Sha256
from skupin.builder.catalog.lockfile import Lock, LockedPackage
from skupin.builder.wheels import file_sha256, store_path, wheel_store
from skupin.common.errors import BuildError
from skupin.common.model import Frozen
from skupin.common.paths import state_dir


def built_dir() -> Path:
    """The host's records of source-built wheels: STATE/built."""
    return state_dir() / "built"
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+) --hash=sha256:([0-9a-f]{64})$")


class BuiltWheel(Frozen):
    """A wheel this host built from a locked sdist, and which lock and image it belongs to."""

    sku: str
    lock_sha256: Sha256
    image_id: str
    sdist: LockedPackage
    wheel: LockedPackage
    created: str


def record_path(lock_sha256: str, *, folder: Path | None = None) -> Path:
    return (folder or built_dir()) / f"{lock_sha256}.json"


def read_built(lock: Lock, *, folder: Path | None = None) -> BuiltWheel | None:
    """The record of the wheel built for `lock` (None when this host built none); BuildError when unreadable."""
    path = record_path(lock.content_hash(), folder=folder)
    if not path.exists():
        return None
    try:
        record = BuiltWheel.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, ValidationError) as exc:
        raise BuildError(f"{path}: unreadable record of a built wheel: {exc}") from exc
    if record.lock_sha256 != lock.content_hash() or record.sku != lock.sku:
        raise BuildError(f"{path}: records a build of {record.sku} {record.lock_sha256[:12]}, not of this lock")
    return record


def export_wheel(folder: Path, *, lock: Lock, image_id: str, store: Path | None = None) -> BuiltWheel:
    """The wheel of an exported build stage (`folder`: wheel/<one .whl> and requirements.txt), into the store."""
    sdists = list(lock.sources().values())
    if len(sdists) != 1:
        raise BuildError(f"the lock of {lock.sku} records {len(sdists)} engine sdists, not one")
    sdist = sdists[0]
    wheels = sorted((folder / "wheel").glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"the engine's build stage made {len(wheels)} wheels, not one: "
                         f"{', '.join(w.name for w in wheels) or 'none'}")
    wheel = wheels[0]
    sha = file_sha256(wheel)
    try:
        line = (folder / "requirements.txt").read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BuildError(f"the engine's build stage wrote no requirements.txt: {exc}") from exc
    m = _REQ.match(line)
    if m is None or m.group(3) != sha:
        raise BuildError(f"the engine's build stage names {line[:200]!r} but its wheel {wheel.name} has sha256 {sha}")
    pkg = LockedPackage(name=sdist.name, version=sdist.version, filename=wheel.name, sha256=sha, url=None,
                        source="sdist")
    dest = store_path(store or wheel_store(), pkg)
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        shutil.copyfile(wheel, tmp)
        tmp.replace(dest)
    return BuiltWheel(sku=lock.sku, lock_sha256=lock.content_hash(), image_id=image_id, sdist=sdist, wheel=pkg,
                      created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))


def write_built(record: BuiltWheel, *, folder: Path | None = None) -> Path:
    folder = folder or built_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return record.write_json(record_path(record.lock_sha256, folder=folder))
