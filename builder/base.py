"""Make a SKU's base image available locally: reuse, debootstrap + `docker import`, or pull by digest.

A bootstrap base is named by a local tag, which anything that can talk to the engine can re-point
(a `docker load` of a tarball carrying that tag). So the base's layer diff ids and config are kept
in a host-side record, STATE/bases/<recipe sha256>.json, written when `skupin base` makes the base
(or, for a base already under its tag with no record, when it first finds it: trust on first use,
said so in the event). The gate's `pins` check matches an image's bottom layers with that record,
never with whatever the tag points at now; `ensure_base` refuses a tag that no longer points at a
recorded base.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from builder.manifest import Bootstrap, SkuManifest
from common.apt import apt_install
from common.errors import BuildError, DockerError
from common.model import Frozen
from common.paths import state_dir
from dockerd import Docker, ImageInfo

OnEvent = Callable[[str], None]
RECORD_FORMAT: Literal["skupin-base-record/1"] = "skupin-base-record/1"
MAX_RECORD_BYTES = 4 * 1024**2


class RecordedBase(Frozen):
    """One image made (or first found) for a bootstrap recipe: its id, layer diff ids (bottom first) and config."""

    image_id: str
    layers: tuple[str, ...]
    config: dict[str, Any]
    origin: Literal["bootstrapped", "found"]
    created: str


class BaseRecord(Frozen):
    """STATE/bases/<recipe sha256>.json: the bases this host made or accepted for one bootstrap recipe."""

    format: Literal["skupin-base-record/1"] = RECORD_FORMAT
    recipe_sha256: str
    tag: str
    bases: tuple[RecordedBase, ...] = ()

    def matching(self, layers: tuple[str, ...]) -> RecordedBase | None:
        """The recorded base whose layers are the bottom of `layers` (the longest when several are)."""
        found = [b for b in self.bases if b.layers and tuple(layers[: len(b.layers)]) == b.layers]
        return max(found, key=lambda b: len(b.layers), default=None)




def bases_dir() -> Path:
    return state_dir() / "bases"


def base_record_path(recipe_sha256: str, *, folder: Path | None = None) -> Path:
    return Path(folder or bases_dir()) / f"{recipe_sha256}.json"


def read_base_record(recipe_sha256: str, *, folder: Path | None = None) -> BaseRecord | None:
    """The host's record of a bootstrap recipe's bases; None when there is none; BuildError when it is unreadable."""
    path = base_record_path(recipe_sha256, folder=folder)
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BuildError(f"{path}: cannot read the base record: {exc}") from exc
    try:
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
        record = BaseRecord.model_validate(json.loads(data))
    except (ValueError, ValidationError) as exc:
        raise BuildError(f"{path}: not a base record ({exc}); fix: remove it and run skupin base") from exc
    if record.recipe_sha256 != recipe_sha256:
        raise BuildError(f"{path}: records recipe {record.recipe_sha256[:12]}, not {recipe_sha256[:12]}")
    return record


def record_base(*, recipe: Bootstrap, info: ImageInfo, config: dict[str, Any], origin: Literal["bootstrapped", "found"],
                folder: Path | None = None) -> BaseRecord:
    """Add the base `info` (with its engine config) to the recipe's record in `folder` (made when missing)."""
    sha = recipe.recipe_sha256()
    record = read_base_record(sha, folder=folder) or BaseRecord(recipe_sha256=sha, tag=recipe.local_tag())
    entry = RecordedBase(image_id=info.id, layers=tuple(info.layers), config=config, origin=origin,
                         created=_dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat())
    kept = tuple(b for b in record.bases if b.layers != entry.layers)
    record = record.model_copy(update={"bases": (*kept, entry)})
    path = base_record_path(sha, folder=folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    record.write_json(path)
    return record

def _quiet(_: str) -> None:
    return None


def ensure_base(*, manifest: SkuManifest, docker: Docker, on_event: OnEvent = _quiet, bases: Path | None = None) -> str:
    """Return the image id of the SKU's base, making it locally when it is missing.

    Bootstrap bases: reuse the local tag `Bootstrap.local_tag()` when present and it points at a
    base the host's record names (recorded now when there is no record yet), else run debootstrap
    and `docker import` the tree, and record it. Image bases: use the local copy, else pull by
    digest (DockerError when no registry is reachable). `bases` is the folder of the host's base records.
    """
    bases = bases or bases_dir()
    ref = manifest.base.reference
    info = docker.inspect_image(ref)
    recipe = manifest.base.bootstrap
    if info is not None and recipe is not None:
        return _recorded(recipe=recipe, info=info, docker=docker, on_event=on_event, folder=bases)
    if info is not None:
        on_event(f"base {ref} present ({info.id})")
        return info.id
    if recipe is not None:
        return _bootstrap(recipe=recipe, docker=docker, on_event=on_event, folder=bases)
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


def _bootstrap(*, recipe: Bootstrap, docker: Docker, on_event: OnEvent, folder: Path) -> str:
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
    record_base(recipe=recipe, info=info, config=docker.image_config(info.id), origin="bootstrapped", folder=folder)
    on_event(f"base {tag} made: {info.id} (layer {info.layers[0] if info.layers else '?'}), recorded in "
             f"{base_record_path(recipe.recipe_sha256(), folder=folder)}")
    return info.id or image_id


def _recorded(*, recipe: Bootstrap, info: ImageInfo, docker: Docker, on_event: OnEvent, folder: Path) -> str:
    """The bootstrap base under its tag, when the host's record names it (recorded first when there is no record)."""
    tag, path = recipe.local_tag(), base_record_path(recipe.recipe_sha256(), folder=folder)
    record = read_base_record(recipe.recipe_sha256(), folder=folder)
    if record is None:
        record_base(recipe=recipe, info=info, config=docker.image_config(info.id), origin="found", folder=folder)
        on_event(f"base {tag} present ({info.id}) but not recorded: its layers are recorded now in {path} as found "
                 "(trust on first use; if this engine may have loaded untrusted images, remove the tag and the record "
                 "and run skupin base again to bootstrap it here)")
        return info.id
    if not any(base.layers == tuple(info.layers) for base in record.bases):
        raise BuildError(f"the local tag {tag} points at {info.id}, whose layers are not a base recorded in {path}: "
                         "the tag was re-pointed (e.g. by docker load); fix: docker rmi the tag, then skupin base to "
                         "bootstrap the recipe again (or remove the record to accept the image as found)")
    on_event(f"base {tag} present ({info.id}), recorded in {path}")
    return info.id


def _clean_tree(root: Path) -> None:
    """Drop apt's downloaded archives and lists: they are not part of the base's content."""
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = root / sub
        if d.is_dir():
            for p in d.iterdir():
                if p.is_file() and p.name != "lock":
                    p.unlink()
