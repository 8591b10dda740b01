"""Reproducible images: what BuildKit built, rewritten so that one lock gives one image id on any machine.

Docker 20.10's built-in BuildKit (0.8) has no SOURCE_DATE_EPOCH and no `rewrite-timestamp`: two `--no-cache` builds
of one lock give the same file contents under different layer digests (the mtimes of what apt and the build touched,
folder mtimes, the config's `created`). So the build normalises its image, as BuildKit >= 0.13's rewrite-timestamp
does, in one pass over `docker save` into `docker load` (docs/REPRODUCIBLE.md says why this route):

- every layer above the SKU's base is rewritten entry by entry, in BuildKit's order (its exporter walks folders in
  lexical order): every mtime clamped to IMAGE_EPOCH (the time the installed Python files already carry; one
  constant for every lock, so a layer is a function of its step's inputs), access and change times dropped, owner
  names dropped (the numeric ids stay), file bytes, modes, links, devices and extended attributes kept as they are,
  written as a POSIX (pax) tar by Python's tarfile, a deterministic writer;
- the base's layers are kept byte for byte (the lock records their diff ids);
- a layer that rewrites to itself (BuildKit took it from a registry cache of rewritten layers, `skupin build --cache`)
  is not sent to `docker load` again while every layer below it is unchanged too: the engine has that chain already;
- the config keeps everything the Dockerfile set; its `created` and every history entry's are the epoch, and
  BuildKit's own metadata (`moby.buildkit.*`) goes.

The result is loaded under a new image id (the sha256 of that config); the gate judges it, the publish pushes it with
the deterministic compression of publishing/imagepush.py. LAYER_FORMAT names this rewrite: a change to it is a
change to every image's id, so it is part of every build record and signed predicate.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, Protocol, cast

from pydantic import Field

from skupin.common.errors import BuildError, DockerError
from skupin.common.model import Frozen

if TYPE_CHECKING:  # the engine is passed in: importing this module loads no Docker client
    from skupin.dockerd import Docker

LAYER_FORMAT: Final = "skupin-layers/2"
# SOURCE_DATE_EPOCH of every image: mtimes are clamped to it and the installed Python files' mtimes (and so their
# bytecode headers) are set to it. One constant, not the lock's time: then a step's output is a function of the step's
# own inputs, and a step BuildKit takes from the cache of an older lock is the step a cold build of this lock makes.
# 2023-06-10, Debian 12's release: the bootstrapped base's SOURCE_DATE_EPOCH too (builder/base.py).
IMAGE_EPOCH: Final = 1686355200
INLINE_CACHE_KEY: Final = "moby.buildkit.cache.v0"  # BuildKit's inline cache: steps' cache keys -> layer indexes
MAX_CONFIG_BYTES: Final = 16 * 1024**2
CHUNK: Final = 1 << 20
_PAX_KEPT_PREFIX: Final = "SCHILY.xattr."
OnEvent = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class NormalisedImage(Frozen):
    """What `normalise_image` made: the new image id, from which BuildKit image, and what it rewrote."""

    image_id: str
    source_id: str
    format: str = LAYER_FORMAT
    epoch: int
    kept_layers: int
    rewritten_layers: int
    unchanged_layers: int = Field(0, description="Layers that were rewritten already (from a registry cache of "
                                                 "rewritten layers): not loaded again")
    cache_image_id: str | None = Field(None, description="With inline_cache: the rewritten layers under a config that "
                                                         "also carries BuildKit's inline cache (the registry cache)")
    seconds: float


class _Hashing:
    """A write-only file that passes bytes on and hashes them (a rewritten layer's diff id)."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)

    def tell(self) -> int:
        return self.size


def normal_entry(info: tarfile.TarInfo, *, epoch: int) -> tarfile.TarInfo:
    """One tar entry as the rewrite writes it: mtime clamped to `epoch`, no owner names, no atime/ctime."""
    out = copy.copy(info)
    out.mtime = min(int(info.mtime), epoch)
    out.uname = out.gname = ""
    out.pax_headers = {k: v for k, v in sorted(info.pax_headers.items()) if k.startswith(_PAX_KEPT_PREFIX)}
    return out


def normalise_layer(src: IO[bytes], dst: IO[bytes], *, epoch: int) -> tuple[str, int]:
    """Rewrite one layer tar from the seekable file `src` into `dst`: (the output's diff id, its entries).

    Read with random access, not as a stream: half the time of tarfile's stream mode, the same bytes out.
    BuildError on a tar that cannot be read (the layer is BuildKit's own output, so that is a broken engine)."""
    writer = _Hashing(dst)
    entries = 0
    try:
        with tarfile.open(fileobj=src, mode="r:") as inner, \
                tarfile.open(fileobj=cast(IO[bytes], writer), mode="w:", format=tarfile.PAX_FORMAT,
                             encoding="utf-8") as out:
            for info in inner:
                data = inner.extractfile(info) if info.isreg() else None
                out.addfile(normal_entry(info, epoch=epoch), data)
                entries += 1
    except tarfile.TarError as exc:
        raise BuildError(f"a layer of the built image is not a readable tar: {exc}") from exc
    return "sha256:" + writer.sha.hexdigest(), entries


def epoch_text(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def normal_config(config: dict[str, Any], *, diff_ids: list[str], epoch: int) -> dict[str, Any]:
    """The config of the rewritten image: the layers' new diff ids, every time the epoch, no BuildKit metadata."""
    out = {k: copy.deepcopy(v) for k, v in config.items() if not k.startswith("moby.buildkit.")}
    out["created"] = epoch_text(epoch)
    out["rootfs"] = {"type": "layers", "diff_ids": list(diff_ids)}
    history = out.get("history")
    if isinstance(history, list):
        out["history"] = [{**h, "created": epoch_text(epoch)} if isinstance(h, dict) else h for h in history]
    return out


def config_bytes(config: dict[str, Any]) -> bytes:
    """The config as the image stores it: compact JSON, keys sorted (its sha256 is the image id)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _tar_member(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % tarfile.BLOCKSIZE)


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            yield chunk


def is_tar_head(head: bytes) -> bool:
    """Whether `head` (a file's first 512 bytes) starts a tar: a header whose checksum holds, or the end-of-archive
    block of an empty layer. An OCI layout's manifest blob (JSON) does not."""
    if head == b"\0" * tarfile.BLOCKSIZE:
        return True
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


class _Rewrite:
    """One pass over `docker save`: the docker-load tarball of the rewritten image, as chunks (see the module doc).

    Both layouts of `docker save`: Docker < 25's (`<id>/layer.tar`, the config `<image hex>.json`) and Docker >= 25's
    OCI layout (`blobs/sha256/<hex>`: the config is the blob named by the image id, layers are the blobs that are
    tars, the OCI manifest blob is skipped; the legacy `layer.tar` names are links to the blobs)."""

    def __init__(self, saved: Readable, *, epoch: int, keep: frozenset[str], scratch: Path, on_event: OnEvent,
                 image: str = "", order: tuple[str, ...] = ()) -> None:
        self.saved, self.epoch, self.keep, self.scratch, self.on_event = saved, epoch, keep, scratch, on_event
        self.order = list(order)  # the image's diff ids bottom first, as the engine reports them (settles held layers)
        self.image_hex = image.removeprefix("sha256:")
        self.renamed: dict[str, str] = {}  # BuildKit's diff id -> the rewritten one
        self.config: dict[str, Any] | None = None
        self.config_name = ""
        self.kept = 0
        self.unchanged = 0  # layers that rewrote to themselves and were not sent again (the engine has their chain)
        self.held: dict[str, Path] = {}  # old diff id -> a layer that rewrote to itself, sent only if a layer below changed
        self.image_config = b""
        self.inline_cache: str | None = None  # BuildKit's inline cache in the built config (BUILDKIT_INLINE_CACHE=1)

    def chunks(self) -> Iterator[bytes]:
        with tarfile.open(fileobj=cast(IO[bytes], self.saved), mode="r|", bufsize=CHUNK) as outer:
            for member in outer:
                source = outer.extractfile(member) if member.isreg() else None
                if source is None:
                    continue
                blob = member.name.startswith("blobs/sha256/")
                if blob and self.image_hex and member.name.rpartition("/")[2] == self.image_hex:
                    self._read_config(member, source)
                elif member.name.endswith("/layer.tar") or blob:
                    yield from self._layer(source, blob=blob)
                elif "/" not in member.name and member.name.endswith(".json") and member.name != "manifest.json":
                    self._read_config(member, source)
        if self.config is None:
            raise BuildError("docker save gave no image config")
        old = [str(d) for d in (self.config.get("rootfs") or {}).get("diff_ids") or []]
        missing = [d for d in old if d not in self.keep and d not in self.renamed]
        if missing:
            raise BuildError(f"docker save gave no layer for {len(missing)} diff id(s) of the image, e.g. {missing[0]}")
        if self.order and self.order != old:
            raise BuildError("the engine's layers of the image are not the ones its saved config names")
        new = [d if d in self.keep else self.renamed[d] for d in old]
        yield from self._settle(old)  # everything is known now: every held layer is sent or dropped
        self.image_config = config_bytes(normal_config(self.config, diff_ids=new, epoch=self.epoch))
        yield from config_only_tarball(self.image_config, new)  # the config and manifest after the layers sent

    def _read_config(self, member: tarfile.TarInfo, source: Readable) -> None:
        if member.size > MAX_CONFIG_BYTES:
            raise BuildError(f"docker save gave an image config of {member.size} bytes (limit {MAX_CONFIG_BYTES})")
        raw = source.read(MAX_CONFIG_BYTES + 1)
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise BuildError(f"docker save gave an image config that is not JSON: {exc}") from exc
        if isinstance(config, dict) and "rootfs" in config:
            self.config, self.config_name = config, member.name
            if isinstance(config.get(INLINE_CACHE_KEY), str):
                self.inline_cache = config[INLINE_CACHE_KEY]

    def _layer(self, source: Readable, *, blob: bool = False) -> Iterator[bytes]:
        with tempfile.NamedTemporaryFile(dir=self.scratch, prefix="built-", suffix=".tar") as raw, \
                tempfile.NamedTemporaryFile(dir=self.scratch, prefix="layer-", suffix=".tar") as handle:
            sha = hashlib.sha256()  # the layer's diff id as BuildKit wrote it
            while chunk := source.read(CHUNK):
                sha.update(chunk)
                raw.write(chunk)
            old = "sha256:" + sha.hexdigest()
            if blob:  # an OCI layout's blob: a layer only if it is a tar (its manifest blob is JSON)
                raw.seek(0)
                if not is_tar_head(raw.read(tarfile.BLOCKSIZE)):
                    return
                raw.seek(0, io.SEEK_END)
            if old in self.keep:  # a base layer: the engine has it already, byte for byte
                self.kept += 1
                return
            if old in self.renamed:
                return
            raw.flush()
            raw.seek(0)
            new, entries = normalise_layer(cast(IO[bytes], raw), handle, epoch=self.epoch)
            handle.flush()
            self.renamed[old] = new
            size = Path(handle.name).stat().st_size
            if new == old:  # already rewritten (a registry cache of rewritten layers): sent only if one below changed
                self.held[old] = Path(handle.name).with_suffix(".same")
                os.link(handle.name, self.held[old])
                self.on_event(f"layer {old[:19]} is already rewritten: {entries} entries, {size / 1e6:.1f} MB")
            else:
                self.on_event(f"rewrote layer {old[:19]} -> {new[:19]}: {entries} entries, {size / 1e6:.1f} MB")
                yield from self._member(f"{new.removeprefix('sha256:')}/layer.tar", Path(handle.name))
        if self.order:
            yield from self._settle(self.order)

    def _settle(self, order: list[str]) -> Iterator[bytes]:
        """Held layers (rewritten to themselves) that sit above a changed layer are sent (their chain is new); those
        whose every layer below is known to be unchanged are dropped (the engine has their chain); others wait."""
        status = [True if d in self.keep else (self.renamed[d] == d if d in self.renamed else None) for d in order]
        changed = next((i for i, known in enumerate(status) if known is False), len(status))
        unknown = next((i for i, known in enumerate(status) if known is None), len(status))
        for diff_id in list(self.held):
            at = [i for i, d in enumerate(order) if d == diff_id]
            if at and max(at) > changed:
                path = self.held.pop(diff_id)
                yield from self._member(f"{diff_id.removeprefix('sha256:')}/layer.tar", path)
                path.unlink()
            elif at and max(at) <= unknown:
                self.held.pop(diff_id).unlink()
                self.unchanged += 1

    @staticmethod
    def _member(name: str, path: Path) -> Iterator[bytes]:
        size = path.stat().st_size
        yield _tar_member(name, size)
        yield from _file_chunks(path)
        yield _padding(size)


def config_only_tarball(config: bytes, diff_ids: list[str]) -> Iterator[bytes]:
    """A docker-load tarball of one config whose layers the engine has already (their chain exists): no layer files."""
    name = hashlib.sha256(config).hexdigest() + ".json"
    layers = [f"{d.removeprefix('sha256:')}/layer.tar" for d in diff_ids]
    manifest = json.dumps([{"Config": name, "RepoTags": None, "Layers": layers}]).encode()
    for member_name, data in ((name, config), ("manifest.json", manifest)):
        yield _tar_member(member_name, len(data)) + data + _padding(len(data))
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def cache_config(image_config: bytes, inline_cache: str) -> bytes:
    """The rewritten image's config with BuildKit's inline cache put back: the same layers in the same order, so the
    cache's layer indexes name the rewritten layers and a cache hit gives BuildKit layers that are rewritten already."""
    config = json.loads(image_config)
    config[INLINE_CACHE_KEY] = inline_cache
    return config_bytes(config)


def _load_expected(docker: Docker, chunks: Iterator[bytes], config: Callable[[], bytes]) -> str:
    """Load `chunks`; the image id, which must be that of the config `config()` returns once they are all sent."""
    loaded = docker.load_image(chunks)
    expected = "sha256:" + hashlib.sha256(config()).hexdigest()
    if loaded != expected:
        with contextlib.suppress(DockerError):  # not the image this rewrite made: not left behind (unless tagged)
            info = docker.inspect_image(loaded)
            if info is not None and not info.tags:
                docker.remove_image(loaded)
        raise BuildError(f"docker load made {loaded}, not the rewritten image {expected}")
    return loaded


def normalise_image(docker: Docker, image: str, *, epoch: int, base_layers: tuple[str, ...],
                    scratch: Path | None = None, on_event: OnEvent = _quiet, inline_cache: bool = False
                    ) -> NormalisedImage:
    """Rewrite the built `image` (see the module doc) and load it; its base's layers (`base_layers`) are kept.

    Only one rewritten layer is on disk at a time (in `scratch`, a temporary folder by default), besides layers that
    were rewritten already, held until the layers below them are known (`docker save` writes layers in no set order).
    With `inline_cache` and BuildKit's
    inline cache in `image`'s config, also load the cache image (`cache_config`: a config only, the layers are the
    rewritten ones). BuildError when the engine's answer is not the image this rewrite made."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="skupin-normalise-", dir=scratch) as tmp:
        saved = io.BufferedReader(docker.save_image(image), CHUNK)
        info = docker.inspect_image(image)
        rewrite = _Rewrite(saved, epoch=epoch, keep=frozenset(base_layers), scratch=Path(tmp), on_event=on_event,
                           image=image, order=info.layers if info is not None else ())
        loaded = _load_expected(docker, rewrite.chunks(), lambda: rewrite.image_config)
    cache_id = None
    if inline_cache and rewrite.inline_cache is not None:
        config = cache_config(rewrite.image_config, rewrite.inline_cache)
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        try:
            cache_id = _load_expected(docker, config_only_tarball(config, diff_ids), lambda: config)
        except (BuildError, DockerError) as exc:  # the cache costs the next build time, never this build its image
            on_event(f"the cache image was not made: {exc}")
    return NormalisedImage(cache_image_id=cache_id, image_id=loaded, source_id=image, epoch=epoch, kept_layers=rewrite.kept,
                           rewritten_layers=len(rewrite.renamed) - rewrite.unchanged, unchanged_layers=rewrite.unchanged,
                           seconds=round(time.monotonic() - started, 2))
