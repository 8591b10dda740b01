"""Push an image with bytes of our own, so that one image id gives one manifest digest on any machine.

`docker push` compresses each layer with the engine's gzip, and reuses whatever compressed digest the engine
remembers for a layer (from an earlier pull or push to that registry): the manifest digest of one image then depends
on the pushing machine's history and Docker's version. Here every layer of `docker save` is compressed by
`compress_layer` (GZIP_FORMAT: zlib at level 6, a gzip header with no name and mtime 0, as zlib writes it) and the
Docker v2 schema-2 manifest is written by `image_manifest` (keys in a fixed order): the bytes depend on the image id,
on skupin and on the zlib Python links (zlib's deflate has given the same bytes for a level since 1.2; zlib-ng, the
system zlib of some distributions, does not: `push_format` names it in the signed record, and `verify --rebuild`
passes on the image id when only the compressed bytes differ). Blobs the registry holds already are not sent again.

`pack_image` is the one pass over `docker save` that both the publish (`push_image`) and the check by rebuild
(publishing/rebuild.py: the digest a rebuilt image would be published under, without pushing it) use. One
compressed layer is on disk at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final, cast

from skupin.builder.reproducible import is_tar_head
from skupin.clients.oci import RegistryClient
from skupin.common.errors import PublishError
from skupin.common.model import Frozen

if TYPE_CHECKING:  # the engine is passed in: importing this module loads no Docker client
    from skupin.dockerd import Docker

GZIP_FORMAT: Final = "gzip zlib-6 mtime-0"
GZIP_LEVEL: Final = 6
MANIFEST_MEDIA: Final = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA: Final = "application/vnd.docker.container.image.v1+json"
LAYER_MEDIA: Final = "application/vnd.docker.image.rootfs.diff.tar.gzip"
MAX_CONFIG_BYTES: Final = 16 * 1024**2
CHUNK: Final = 1 << 20
OnEvent = Callable[[str], None]
OnLayer = Callable[["PackedLayer", Path], None]


def _quiet(_: str) -> None:
    return None


class PackedLayer(Frozen):
    """One layer as the registry stores it."""

    diff_id: str
    digest: str
    size: int


class PackedImage(Frozen):
    """An image as it would be pushed: config, compressed layers (bottom first) and the manifest."""

    image_id: str
    config: bytes
    layers: tuple[PackedLayer, ...]
    manifest: bytes
    digest: str
    seconds: float


def push_format() -> str:
    """GZIP_FORMAT and the zlib this process compresses with (the signed record's `build.push`)."""
    return f"{GZIP_FORMAT}, zlib {zlib.ZLIB_RUNTIME_VERSION}"


def compress_layer(src: IO[bytes], dst: IO[bytes]) -> tuple[str, str, int]:
    """Compress one layer tar: (its diff id, the compressed blob's digest, its size)."""
    raw, packed, size = hashlib.sha256(), hashlib.sha256(), 0
    gzip = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # wbits 31: a gzip header, mtime 0, no name
    while chunk := src.read(CHUNK):
        raw.update(chunk)
        out = gzip.compress(chunk)
        packed.update(out)
        size += dst.write(out)
    out = gzip.flush()
    packed.update(out)
    size += dst.write(out)
    return "sha256:" + raw.hexdigest(), "sha256:" + packed.hexdigest(), size


class _Prefixed:
    """A read-only stream: `head` (already read from `source`), then the rest of `source`; its first read returns what
    an unread `source` would (so the compressor sees the same chunks)."""

    def __init__(self, head: bytes, source: IO[bytes]) -> None:
        self.head, self.source = head, source

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.source.read(n)
        head, self.head = self.head, b""
        return head + self.source.read(-1 if n < 0 else max(n - len(head), 0))


def image_manifest(config: bytes, layers: tuple[PackedLayer, ...]) -> bytes:
    """The schema-2 manifest of a config and its compressed layers (what `docker pull` reads)."""
    doc = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA,
           "config": {"mediaType": CONFIG_MEDIA, "size": len(config), "digest": "sha256:" + hashlib.sha256(config).hexdigest()},
           "layers": [{"mediaType": LAYER_MEDIA, "size": layer.size, "digest": layer.digest} for layer in layers]}
    return json.dumps(doc, indent=3).encode()


def pack_image(docker: Docker, image_id: str, *, on_layer: OnLayer | None = None, scratch: Path | None = None,
               on_event: OnEvent = _quiet) -> PackedImage:
    """Compress every layer of `image_id` (see the module doc); `on_layer` gets each with its file before the file goes.

    Both layouts of `docker save`: Docker < 25's (`<id>/layer.tar`, `<image hex>.json`) and Docker >= 25's OCI layout
    (`blobs/sha256/<hex>`: the blob named by the image id is the config, the blobs that are tars are the layers; the
    legacy names are links, skipped). PublishError when `docker save` gives another image than `image_id` or misses a
    layer of its config."""
    started = time.monotonic()
    packed: dict[str, PackedLayer] = {}
    config = b""
    with tempfile.TemporaryDirectory(prefix="skupin-pack-", dir=scratch) as tmp:
        saved = io.BufferedReader(docker.save_image(image_id), CHUNK)
        with tarfile.open(fileobj=cast(IO[bytes], saved), mode="r|", bufsize=CHUNK) as outer:
            for member in outer:
                source = outer.extractfile(member) if member.isreg() else None
                if source is None:
                    continue
                blob = member.name.startswith("blobs/sha256/")
                if member.name == image_id.removeprefix("sha256:") + ".json" or (
                        blob and member.name.rpartition("/")[2] == image_id.removeprefix("sha256:")):
                    if member.size > MAX_CONFIG_BYTES:
                        raise PublishError(f"the config of {image_id[:19]} is {member.size} bytes (limit {MAX_CONFIG_BYTES})")
                    config = source.read()
                elif member.name.endswith("/layer.tar") or blob:
                    head = source.read(tarfile.BLOCKSIZE)
                    if blob and not is_tar_head(head):  # the OCI manifest blob
                        continue
                    with tempfile.NamedTemporaryFile(dir=tmp, prefix="layer-", suffix=".tar.gz") as handle:
                        diff_id, digest, size = compress_layer(cast(IO[bytes], _Prefixed(head, source)), handle)
                        handle.flush()
                        if diff_id in packed:
                            continue
                        packed[diff_id] = layer = PackedLayer(diff_id=diff_id, digest=digest, size=size)
                        on_event(f"layer {diff_id[:19]}: {size / 1e6:.1f} MB compressed as {digest[:19]}")
                        if on_layer is not None:
                            on_layer(layer, Path(handle.name))
    if "sha256:" + hashlib.sha256(config).hexdigest() != image_id:
        raise PublishError(f"docker save of {image_id[:19]} gave no config with that id")
    diff_ids = [str(d) for d in (json.loads(config).get("rootfs") or {}).get("diff_ids") or []]
    missing = [d for d in diff_ids if d not in packed]
    if missing:
        raise PublishError(f"docker save of {image_id[:19]} gave no layer {missing[0]}")
    layers = tuple(packed[d] for d in diff_ids)
    manifest = image_manifest(config, layers)
    return PackedImage(image_id=image_id, config=config, layers=layers, manifest=manifest,
                       digest="sha256:" + hashlib.sha256(manifest).hexdigest(),
                       seconds=round(time.monotonic() - started, 2))


def push_image(*, docker: Docker, client: RegistryClient, repository: str, image_id: str, tag: str,
               on_event: OnEvent = _quiet) -> str:
    """Push `image_id` under `repository:tag` (its layers, its config, then the manifest); the manifest digest."""
    sent = [0]

    def upload(layer: PackedLayer, path: Path) -> None:
        if client.push_blob_file(repository, path, digest=layer.digest, size=layer.size):
            sent[0] += 1
            on_event(f"pushed layer {layer.digest[:19]} ({layer.size / 1e6:.1f} MB)")
        else:
            on_event(f"layer {layer.digest[:19]} is in the registry already")

    image = pack_image(docker, image_id, on_layer=upload, on_event=on_event)
    client.push_blob(repository, image.config)
    digest = client.put_manifest(repository, tag, image.manifest, MANIFEST_MEDIA)
    if digest != image.digest:
        raise PublishError(f"the registry stored the manifest of {image_id[:19]} as {digest}, not {image.digest}")
    on_event(f"pushed {image_id[:19]} as {repository}@{digest} ({sent[0]} of {len(image.layers)} layers sent, "
             f"{image.seconds}s)")
    return digest
