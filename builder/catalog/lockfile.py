"""The lock: the fully resolved stack of one SKU, its file format and its content hash."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from packaging.utils import canonicalize_name
from pydantic import Field, ValidationError

from skupin.builder.catalog.grammar import Name, Sha256
from skupin.builder.catalog.manifest import SkuManifest
from skupin.common.errors import LockError
from skupin.common.model import Frozen, canonical_json
from skupin.common.untrusted import UntrustedInputError, load_json, read_regular_file

LOCK_VERSION: Literal[1] = 1
# Python layers in build order, slowest- to fastest-moving.
PY_LAYERS = ("framework", "compiler", "engine", "extras")


class LockedPackage(Frozen):
    """One Python distribution at an exact version with the sha256 of the exact file installed."""

    name: Name
    version: str
    filename: str = Field(pattern=r"^[A-Za-z0-9._+-]+\.(whl|tar\.gz|zip)$")
    sha256: Sha256
    url: str | None = Field(
        None, description="The file's own download URL (pip report download_info.url); None for a wheelhouse file"
    )
    source: Literal["index", "wheelhouse", "url", "git", "sdist"] = "index"

    def requirement(self) -> str:
        """The pip requirement line that installs exactly this file (hash-checked)."""
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


class LockedBase(Frozen):
    """The base the image starts from."""

    kind: Literal["image", "bootstrap"]
    reference: str = Field(description="image@sha256:... for registry bases; the local tag for bootstraps")
    digest: str | None = Field(None, description="sha256:... of the registry image; None for a local bootstrap")
    recipe_sha256: Sha256 | None = Field(None, description="Hash of the bootstrap recipe (bootstrap bases)")
    diff_id: str | None = Field(
        None, pattern=r"^sha256:[0-9a-f]{64}$",
        description="Bootstrap bases: the diff id (sha256 of the uncompressed tar) of the base's one layer as `skupin "
                    "lock` found it on the host that locked; a build refuses a base whose layer differs. Not a registry "
                    "digest: a local `docker import` has no manifest, and its image id hashes the import's wall time")

    def identity(self) -> LockedBase:
        """The base as the manifest decides it (without the host-made diff id): what makes a lock stale."""
        return self.model_copy(update={"diff_id": None})


class Lock(Frozen):
    """Everything an image build needs to be reproducible, committed next to its manifest."""

    lock_version: Literal[1] = LOCK_VERSION
    sku: Name
    manifest_sha256: Sha256 = Field(description="sha256 of the manifest's canonical JSON")
    python: str = Field(pattern=r"^3\.[0-9]{1,2}$")
    platform: str
    base: LockedBase
    layers: dict[Literal["framework", "compiler", "engine", "extras"], tuple[LockedPackage, ...]]
    system: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="apt packages per layer, name=version"
    )
    omitted: dict[Name, str] = Field(
        default_factory=dict,
        description="Requirements of locked distributions the image leaves out (stack.omit): name -> reason",
    )
    build: tuple[LockedPackage, ...] = Field(
        (), description="Wheels that build a source-built engine (stack.engine.source kind sdist) in the image's "
                        "build stage: its build-system requirements; not installed in the served image")
    dockerfile_sha256: Sha256 | None = Field(
        None, description="Locks made before 2026-12-01 recorded their pins-only Dockerfile's hash, which made every "
                          "template edit a relock; kept so their content hash (and attestations) stay valid, never "
                          "compared: a lock is stale when what decides the installed set changes (builder/lock.py)")
    apt_sources: tuple[str, ...] | None = Field(
        None, description="The base's apt sources (deb lines) the versions in `system` were resolved from at lock time "
                          "(apt-cache policy in a container of the base); None for a lock that pins only the manifest's "
                          "apt versions (made before 2026-12-01)")
    apt_closure: dict[str, tuple[str, ...]] | None = Field(
        None, description="Every Debian package each layer's apt-get install unpacks: the packages in `system` and "
                          "everything they depend on, name=version as `apt-get install -s --no-install-recommends` "
                          "resolved them in the base at lock time, each layer holding what it adds over the layers "
                          "below it (a build stage's from the base). The locked render installs all of them at these "
                          "versions. None: the lock pins only the packages the Dockerfile names, their dependencies "
                          "come from whatever the archive serves at build time (locks made before 2026-12-02, those "
                          "made with --apt manifest, e.g. of a registry base the locking host could not run)")
    resolver: str = Field(description="The resolver and its version, e.g. pip 25.3")
    tool_version: str
    created: str = Field(description="UTC time of locking; not part of the content hash")

    def json_data(self) -> dict[str, Any]:
        """The lock file's form: no legacy Dockerfile hash, apt sources, apt closure or base diff id in a lock that has
        none, no empty `build` or `omitted` (older tools read it too, and its content hash stays what it was)."""
        exclude: dict[str, Any] = {name: True for name, empty in (
            ("dockerfile_sha256", self.dockerfile_sha256 is None), ("apt_sources", self.apt_sources is None),
            ("apt_closure", self.apt_closure is None),
            ("build", not self.build), ("omitted", not self.omitted)) if empty}
        if self.base.diff_id is None:
            exclude["base"] = {"diff_id"}
        return self.model_dump(mode="json", exclude=exclude or None)

    def content_hash(self) -> str:
        """sha256 of the canonical JSON without the creation time: the same lock, the same hash."""
        data = self.json_data()  # without an empty `omitted` or `build`: a lock keeps the hash it had before them
        del data["created"]
        return hashlib.sha256(canonical_json(data)).hexdigest()

    def packages(self) -> dict[str, LockedPackage]:
        """Every locked Python package by normalised name."""
        return {canonicalize_name(p.name): p for layer in self.layers.values() for p in layer}

    def sources(self) -> dict[str, LockedPackage]:
        """The locked source distributions built inside the image (source sdist), by normalised name."""
        return {name: p for name, p in self.packages().items() if p.source == "sdist"}




def lock_path(manifest_path: Path) -> Path:
    """skus/x.yaml -> skus/x.lock.json."""
    return manifest_path.with_name(f"{manifest_path.stem}.lock.json")


MAX_LOCK_BYTES = 16 * 1024**2  # the largest committed lock is ~200 KB
MAX_LOCK_DEPTH = 16  # a lock nests 5 levels


def read_lock(path: Path) -> Lock:
    """Read and validate a lock file; LockError names the file and field on any problem."""
    if not path.exists() and not path.is_symlink():
        raise LockError(f"{path}: no lock; fix: run `skupin lock {path.name.split('.')[0]}`")
    try:  # bounded: size, depth, UTF-8, a regular file (a folder, FIFO or device is refused, not read)
        data = load_json(read_regular_file(path, max_bytes=MAX_LOCK_BYTES), source=str(path), max_depth=MAX_LOCK_DEPTH)
    except UntrustedInputError as exc:
        raise LockError(f"unreadable lock: {exc}") from exc
    try:
        return Lock.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(the whole file)"
        raise LockError(f"{path}: {field}: {first['msg']}") from exc


def write_lock(lock: Lock, path: Path) -> None:
    """Write a lock as stable, diff-friendly JSON (atomic replace)."""
    lock.write_json(path)


def content_tag(*, engine_version: str, lock: Lock, dockerfile_sha256: str) -> str:
    """`<engine-version>-<hash12>`, the hash over the lock and the locked Dockerfile the image is built from: the tag
    part of the local tag and the version tag a publish pushes (a template edit makes a new image, not a new lock)."""
    version = engine_version.replace("+", "_")
    both = hashlib.sha256(f"{lock.content_hash()}\n{dockerfile_sha256}".encode()).hexdigest()
    return f"{version}-{both[:12]}"


def image_tag(*, sku: str, engine_version: str, lock: Lock, dockerfile_sha256: str, repository: str = "skupin") -> str:
    """The content-addressed local tag of a SKU's image: repository/sku:<content_tag>."""
    return f"{repository}/{sku}:{content_tag(engine_version=engine_version, lock=lock, dockerfile_sha256=dockerfile_sha256)}"


def sku_image_tag(manifest: SkuManifest, *, lock: Lock, dockerfile_sha256: str) -> str:
    """The local tag of `manifest`'s image built from `lock` and the Dockerfile of sha256 `dockerfile_sha256`."""
    return image_tag(sku=manifest.name, engine_version=manifest.stack.engine.version, lock=lock,
                     dockerfile_sha256=dockerfile_sha256)
