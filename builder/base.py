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

from skupin.builder.catalog.lockfile import LockedBase
from skupin.builder.catalog.manifest import Bootstrap, SkuManifest
from skupin.common.apt import apt_install
from skupin.common.errors import BuildError, DockerError
from skupin.common.model import Frozen
from skupin.common.paths import state_dir
from skupin.dockerd import Docker, ImageInfo

OnEvent = Callable[[str], None]
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# Every mtime of a bootstrapped tree is clamped to this (bookworm's release, 2023-06-10 UTC) at import, and
# debootstrap runs with it as SOURCE_DATE_EPOCH: a file debootstrap wrote does not carry the hour it ran.
SOURCE_DATE_EPOCH = 1686355200
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


def check_locked_base(*, locked: LockedBase, layers: tuple[str, ...], sku: str) -> None:
    """BuildError unless a bootstrapped base's layers are the one layer the lock records (`base.diff_id`)."""
    if locked.kind != "bootstrap":
        return
    if locked.diff_id is None:
        raise BuildError(f"the lock of {sku} records no identity of its bootstrapped base (base.diff_id); fix: "
                         f"skupin lock {sku} (it makes or finds the base on this host and records its layer)")
    if layers != (locked.diff_id,):
        found = ", ".join(layers) or "no layers"
        raise BuildError(
            f"the base {locked.reference} of {sku} is not the one its lock records: the lock names layer "
            f"{locked.diff_id}, this host's base has {found} (bootstrapped on another host or day, or again); fix: "
            f"review and commit `skupin lock {sku}` to take this host's base, or docker load the base the lock names")


def base_diff_id(*, manifest: SkuManifest, docker: Docker, on_event: OnEvent = _quiet, bases: Path | None = None
                 ) -> str | None:
    """The diff id of a bootstrapped base's one layer (made or found on this host: `ensure_base`); None for a
    registry base (its digest already names it)."""
    if manifest.base.bootstrap is None:
        return None
    image_id = ensure_base(manifest=manifest, docker=docker, on_event=on_event, bases=bases)
    info = docker.inspect_image(image_id)
    if info is None or len(info.layers) != 1:
        raise BuildError(f"the bootstrapped base {manifest.base.reference} ({image_id}) has "
                         f"{len(info.layers) if info else 'no'} layers, not one; fix: docker rmi it and skupin base")
    return info.layers[0]


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


def _ensure_keyring(recipe: Bootstrap, on_event: OnEvent) -> Path:
    """The recipe's keyring file; Debian's debian-archive-keyring installed first when it is the default one and missing."""
    keyring = Path(recipe.keyring)
    if not keyring.is_file() and recipe.keyring == DEBIAN_KEYRING:
        apt_install("debian-archive-keyring", why=f"{keyring} not found", error=BuildError, on_event=on_event)
    if not keyring.is_file():
        raise BuildError(f"base.bootstrap.keyring: {keyring} is not a file; debootstrap verifies the archive's signed "
                         "Release file with it; fix: install the keyring (Debian: debian-archive-keyring) or name one")
    return keyring


def debootstrap_command(recipe: Bootstrap, *, tool: str, root: Path) -> list[str]:
    """The debootstrap command line of a recipe: signatures checked against its keyring, never skipped."""
    cmd = [tool, f"--variant={recipe.variant}", f"--keyring={recipe.keyring}", "--force-check-gpg"]
    if recipe.include:
        cmd.append("--include=" + ",".join(recipe.include))
    return [*cmd, recipe.suite, str(root), str(recipe.mirror)]


def bootstrap_tree(recipe: Bootstrap, root: Path, *, on_event: OnEvent = _quiet) -> None:
    """debootstrap the recipe into `root` (signatures verified) and normalise the tree (`normalise_tree`)."""
    tool = _ensure_debootstrap(on_event)
    _ensure_keyring(recipe, on_event)
    cmd = debootstrap_command(recipe, tool=tool, root=root)
    on_event(f"bootstrapping {recipe.local_tag()}: {' '.join(cmd)}")
    start = time.monotonic()
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH), "LC_ALL": "C.UTF-8", "TZ": "UTC"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise BuildError(f"debootstrap of {recipe.suite} ({recipe.variant}) failed (exit {proc.returncode}):\n{tail}")
    on_event(f"debootstrap done in {time.monotonic() - start:.1f} s")
    normalise_tree(root)


def _bootstrap(*, recipe: Bootstrap, docker: Docker, on_event: OnEvent, folder: Path) -> str:
    tag = recipe.local_tag()
    with tempfile.TemporaryDirectory(prefix="skupin-base-") as tmp:
        root = Path(tmp) / "rootfs"
        bootstrap_tree(recipe, root, on_event=on_event)
        image_id = docker.import_rootfs(rootfs=root, reference=tag, on_event=on_event,
                                        source_date_epoch=SOURCE_DATE_EPOCH)
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


# Files of a debootstrapped tree that say when or where it was made, not what it is: dropped (emptied where a
# package expects the file). Everything else is kept, its mtime clamped to SOURCE_DATE_EPOCH at import.
_DROP_DIRS = ("var/cache/apt/archives", "var/lib/apt/lists", "var/log", "var/cache/debconf", "tmp", "run")
_DROP_FILES = ("var/cache/apt/pkgcache.bin", "var/cache/apt/srcpkgcache.bin", "var/cache/ldconfig/aux-cache",
               "var/lib/dpkg/status-old", "var/lib/dpkg/diversions-old", "var/lib/dpkg/statoverride-old",
               "var/lib/dpkg/available-old", "etc/passwd-", "etc/group-", "etc/shadow-", "etc/gshadow-")
_EMPTY_FILES = ("etc/machine-id", "etc/hostname", "etc/resolv.conf")


def normalise_tree(root: Path) -> None:
    """Drop what records the time or host of the bootstrap: apt's archives, lists and caches, logs, debconf's
    `-old` copies, dpkg's and shadow's backups, ldconfig's aux cache; empty machine-id, hostname and resolv.conf
    (debootstrap copies the host's; the Docker engine mounts its own in a container)."""
    for sub in _DROP_DIRS:
        d = root / sub
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*"), reverse=True):
            keep = sub == "var/cache/debconf" and not p.name.endswith("-old")
            if keep or p.name == "lock" or (p.is_dir() and not p.is_symlink()):
                continue
            p.unlink()
    for rel in _DROP_FILES:
        (root / rel).unlink(missing_ok=True)
    for rel in _EMPTY_FILES:
        p = root / rel
        if p.is_file() and not p.is_symlink():
            p.write_bytes(b"")
