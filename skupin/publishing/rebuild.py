"""`skupin verify REF --rebuild`: rebuild a published image from the lock its signed record names, and compare digests.

An operator who trusts the catalog and the keys, but not the machine that built and pushed an image, checks it here:

1. the reference is verified as `skupin verify` does (a trusted signature for the SKU, the catalog's lock, bundle and
   tolerance); a refusal ends it;
2. the catalog's lock must be the record's (else: check out the catalog revision the record names) and its render
   must be the Dockerfile the published image's label names;
3. the image is built again from that lock with no BuildKit cache (`--no-cache`) in a fresh build context, normalised
   as every build is (builder/reproducible.py), and packed as the publish pushes (publishing/imagepush.py) without
   being pushed;
4. the manifest digest it would be published under is compared with the published one. On a mismatch the first
   differing layer is found from the two configs' diff ids, the published layer is downloaded (bounded by its
   manifest's size, checked against its digest) and both layers are indexed as the gate reads hostile layers
   (imageview/layers.py): the first differing file is named with what differs. Same layers under another config
   name the config fields; the same image under another manifest names the compression.

Nothing is tagged or pushed: the rebuilt image carries a temporary local tag that goes at the end.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Final, cast

from pydantic import Field

from skupin.builder.build import TagImage, execute_build, plan_build
from skupin.builder.check import resolve
from skupin.builder.render import render
from skupin.clients.oci import RegistryClient, parse_image_ref, registry_url
from skupin.common.errors import NetworkError, PublishError, SkupinError
from skupin.common.model import Frozen
from skupin.common.paths import sku_path
from skupin.common.untrusted import UntrustedInputError, load_json, printable
from skupin.dockerd import Docker
from skupin.imageview.layers import Entry, LayerIndex, iter_saved_layers, scan_layer_tar
from skupin.publishing.attest import TrustedKeys
from skupin.publishing.imagepush import PackedImage, pack_image
from skupin.publishing.verify import Verification, verify_reference

DOCKERFILE_LABEL: Final = "io.skupin.dockerfile-sha256"
MAX_CONFIG_BYTES: Final = 16 * 1024**2
MAX_LAYER_BYTES: Final = 64 * 1024**3  # a published layer, compressed and as its tar
DISK_MARGIN: Final = 1024**3  # left free on the scratch folder's disk by the download of a published layer
_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}")
OnEvent = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


class Rebuilt(Frozen):
    """The answer of `verify --rebuild`."""

    ok: bool
    ref: str
    reference: str = Field(description="The published image by digest")
    sku: str
    published_digest: str
    rebuilt_digest: str
    published_image_id: str
    rebuilt_image_id: str
    difference: str = Field("", description="What differs first: the layer and file, the config fields or the "
                                            "compression; empty when the digests are equal")
    note: str = Field("", description="A pass on the image id alone: the same config and layers, other compressed "
                                      "bytes (another zlib, or a push other than skupin's publish)")
    layer: int | None = Field(None, description="The index (bottom 0) of the first differing layer")
    file: str | None = Field(None, description="The first differing file of that layer")
    build_s: float
    total_s: float

    def line(self) -> str:
        if self.ok:
            same = f"manifest {self.rebuilt_digest}" if not self.note else f"published as {self.published_digest}: {self.note}"
            return (f"rebuilt: {self.ref} -> {self.reference}: the lock builds the same image here "
                    f"({self.sku}, image {self.rebuilt_image_id[:19]}, {same}; build {self.build_s:.0f}s)")
        return (f"NOT rebuilt to the same image: {self.ref} -> {self.reference} ({self.sku}): the lock builds "
                f"{self.rebuilt_digest[:19]} (image {self.rebuilt_image_id[:19]}) here, the registry holds "
                f"{self.published_digest[:19]} (image {self.published_image_id[:19]}): {self.difference}")

    def error(self) -> SkupinError:
        return PublishError(self.line(), fix="do not run this image: what was published is not what its lock builds")


def _entry_text(entry: Entry | None) -> str:
    if entry is None:
        return "absent"
    kind = {"f": "file", "d": "folder", "l": "symlink", "w": "whiteout", "o": "other"}.get(entry.kind, entry.kind)
    facts = [kind, f"mode {entry.mode:o}", f"mtime {entry.mtime}"]
    if entry.kind == "f":
        facts += [f"{entry.size} bytes", f"sha256 {entry.sha256[:16]}"]
    if entry.kind == "l":
        facts.append(f"-> {printable(entry.target, 200)}")
    return ", ".join(facts)


def first_file_difference(published: LayerIndex, rebuilt: LayerIndex) -> tuple[str, str] | None:
    """The first path (in the published layer's order, then the rebuilt one's) whose entry differs, and how."""
    for path in [*published.entries, *(p for p in rebuilt.entries if p not in published.entries)]:
        a, b = published.entries.get(path), rebuilt.entries.get(path)
        if a != b:
            return printable(path), f"published: {_entry_text(a)}; rebuilt: {_entry_text(b)}"
    opaque = published.opaque ^ rebuilt.opaque
    if opaque:
        path = sorted(opaque)[0]
        return printable(path), f"an opaque folder in only the {'published' if path in published.opaque else 'rebuilt'} layer"
    return None


def config_difference(published: dict[str, Any], rebuilt: dict[str, Any]) -> str:
    """The fields of two configs (and of their `config` objects) that differ, named."""
    fields = sorted(printable(k, 80) for k in set(published) | set(rebuilt)
                    if published.get(k) != rebuilt.get(k) and k != "config")
    inner_a, inner_b = published.get("config") or {}, rebuilt.get("config") or {}
    if isinstance(inner_a, dict) and isinstance(inner_b, dict):
        fields += sorted(f"config.{printable(k, 80)}" for k in set(inner_a) | set(inner_b) if inner_a.get(k) != inner_b.get(k))
    return "the configs differ in " + (", ".join(fields[:12]) or "their bytes only")


def _diff_ids(config: dict[str, Any]) -> list[str]:
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    return [str(d) for d in diff_ids] if isinstance(diff_ids, list) else []


def _blob(ref: Any, *, what: str, limit: int) -> tuple[str, int]:
    """(digest, size) of a manifest's descriptor from the registry: PublishError unless a sha256 and 1..limit bytes."""
    digest = ref.get("digest") if isinstance(ref, dict) else None
    size = ref.get("size") if isinstance(ref, dict) else None
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise PublishError(f"{what} names no sha256 digest")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= limit:
        raise PublishError(f"{what} declares {printable(repr(size), 40)} bytes (limit {limit})")
    return digest, size


class _Bounded:
    """A read-only stream that ends in UntrustedInputError past `limit` bytes (a gzip bomb stops there)."""

    def __init__(self, source: IO[bytes], limit: int, what: str) -> None:
        self.source, self.left, self.limit, self.what = source, limit, limit, what

    def read(self, n: int = -1) -> bytes:
        data = self.source.read(self.left + 1 if n < 0 else min(n, self.left + 1))
        self.left -= len(data)
        if self.left < 0:
            raise UntrustedInputError(f"{self.what} decompresses to more than {self.limit} bytes")
        return data


class _Compare:
    """Find what differs between the published image and the rebuilt one (see the module doc, step 4)."""

    def __init__(self, *, client: RegistryClient, repository: str, manifest: dict[str, Any], config: dict[str, Any],
                 rebuilt: PackedImage, docker: Docker, scratch: Path) -> None:
        self.client, self.repository, self.manifest, self.config = client, repository, manifest, config
        self.rebuilt, self.docker, self.scratch = rebuilt, docker, scratch

    def difference(self) -> tuple[str, int | None, str | None]:
        rebuilt_config = json.loads(self.rebuilt.config)
        ours, theirs = _diff_ids(rebuilt_config), _diff_ids(self.config)
        index = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), None)
        if index is None and len(ours) != len(theirs):
            index = min(len(ours), len(theirs))
            more = "published" if len(theirs) > len(ours) else "rebuilt"
            return f"the {more} image has more layers ({len(theirs)} published, {len(ours)} rebuilt)", index, None
        if index is None:
            if self.rebuilt.image_id != self.manifest.get("config", {}).get("digest"):
                return config_difference(self.config, rebuilt_config), None, None
            return ("the same image (config and layers) pushed with other compressed bytes: it was not pushed by "
                    "skupin's publish"), None, None
        found = self._file(index, theirs[index], ours[index])
        where = f"layer {index} (published {theirs[index][:19]}, rebuilt {ours[index][:19]})"
        if found is None:
            return f"{where}: the same files, other tar bytes", index, None
        path, how = found
        return f"{where}: first differing file /{path}: {how}", index, path

    def _file(self, index: int, published_diff_id: str, rebuilt_diff_id: str) -> tuple[str, str] | None:
        layers = self.manifest.get("layers")
        if not isinstance(layers, list) or index >= len(layers):
            raise PublishError(f"the published manifest lists no layer {index}")
        digest, size = _blob(layers[index], what=f"the published layer {index}", limit=MAX_LAYER_BYTES)
        free = shutil.disk_usage(self.scratch).free
        if size > free - DISK_MARGIN:
            raise UntrustedInputError(f"the published layer {index} is {size} bytes; {free} are free here: not downloaded")
        path = self.client.open_blob(self.repository, digest, self.scratch, max_bytes=size)
        try:
            with gzip.open(path, "rb") as stream:
                bounded = _Bounded(cast(IO[bytes], stream), MAX_LAYER_BYTES, f"the published layer {index}")
                published = scan_layer_tar(cast(IO[bytes], bounded), diff_id=published_diff_id)
        except (OSError, EOFError, zlib.error) as exc:
            raise UntrustedInputError(f"the published layer {index} is not a gzipped tar: {exc}") from exc
        finally:
            path.unlink(missing_ok=True)
        saved = io.BufferedReader(self.docker.save_image(self.rebuilt.image_id), 1 << 20)
        rebuilt = next((lay for lay in iter_saved_layers(cast(IO[bytes], saved)) if lay.diff_id == rebuilt_diff_id), None)
        if rebuilt is None:
            raise PublishError(f"docker save of the rebuilt image gave no layer {rebuilt_diff_id}")
        return first_file_difference(published, rebuilt)


def _published(client: RegistryClient, repository: str, digest: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The published manifest and config (bounded, digest-checked)."""
    try:
        manifest = client.get_manifest(repository, digest).json()
    except ValueError as exc:
        raise PublishError(f"{repository}@{digest}: its manifest is not JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise PublishError(f"{repository}@{digest}: its manifest is not a JSON object")
    config_digest, size = _blob(manifest.get("config"), what=f"the config of {repository}@{digest}",
                                limit=MAX_CONFIG_BYTES)
    config = load_json(client.get_blob(repository, config_digest, max_bytes=size), source=f"the config of {digest}")
    if not isinstance(config, dict):
        raise PublishError(f"{repository}@{digest}: its config is not a JSON object")
    return manifest, config


def rebuild_reference(*, ref: str, docker: Docker, sku: str | None = None,
                      trusted: TrustedKeys | list[Path] | None = None, on_event: OnEvent = _quiet,
                      verify: Callable[..., Verification] = verify_reference,
                      client: RegistryClient | None = None, no_cache: bool = True) -> Rebuilt:
    """Verify `ref`, rebuild its image from the catalog's lock and compare (see the module doc). `no_cache=False`
    lets BuildKit reuse its cache (the tests' second rebuild of one lock; never the command's)."""
    with contextlib.ExitStack() as held:
        return _rebuild(ref=ref, docker=docker, sku=sku, trusted=trusted, on_event=on_event, verify=verify,
                        client=client, no_cache=no_cache, held=held)


def _rebuild(*, ref: str, docker: Docker, sku: str | None, trusted: TrustedKeys | list[Path] | None,
             on_event: OnEvent, verify: Callable[..., Verification], client: RegistryClient | None, no_cache: bool,
             held: contextlib.ExitStack) -> Rebuilt:
    started = time.monotonic()
    verified = verify(ref=ref, sku=sku, trusted=trusted)
    if not verified.ok:
        raise verified.error()
    assert verified.sku and verified.reference and verified.digest and verified.lock_sha256
    name = parse_image_ref(verified.reference)
    client = client or held.enter_context(RegistryClient(registry_url(name.registry)))
    manifest, config = _published(client, name.repository, verified.digest)
    stack = resolve(sku_path(verified.sku), require_lock=True)
    lock = stack.current_lock
    if lock is None or lock.content_hash() != verified.lock_sha256:
        have = lock.content_hash()[:12] if lock is not None else "none"
        raise PublishError(f"the catalog's lock of {verified.sku} is {have}, the signed record of {ref} names "
                           f"{verified.lock_sha256[:12]}; nothing was rebuilt",
                           fix=f"check out the catalog revision the record names (skupin inspect {ref}: source)")
    rendered = render(stack)
    label = str(((config.get("config") or {}).get("Labels") or {}).get(DOCKERFILE_LABEL, ""))
    if label != rendered.sha256:
        raise PublishError(f"the catalog renders a Dockerfile {rendered.sha256[:12]} for {verified.sku}, the published "
                           f"image was built from {label[:12] or 'an unlabelled one'}; nothing was rebuilt",
                           fix="use the skupin version and catalog revision the record names (skupin inspect REF)")
    with tempfile.TemporaryDirectory(prefix="skupin-rebuild-") as tmp:
        scratch = Path(tmp)
        temporary = f"skupin-rebuild/{verified.sku}:{verified.digest.removeprefix('sha256:')[:12]}"
        steps = tuple(TagImage(tag=temporary) if isinstance(step, TagImage) else step
                      for step in plan_build(rendered, no_cache=no_cache, contexts=scratch / "contexts"))
        on_event(f"rebuilding {verified.sku} from lock {verified.lock_sha256[:12]}" + (" with no cache" if no_cache else ""))
        built = execute_build(steps, rendered=rendered, docker=docker, on_line=on_event)
        try:
            packed = pack_image(docker, built.image_id, scratch=scratch, on_event=on_event)
            common = dict(ref=ref, reference=verified.reference, sku=verified.sku, published_digest=verified.digest,
                          rebuilt_digest=packed.digest, published_image_id=str((manifest.get("config") or {}).get("digest")),
                          rebuilt_image_id=built.image_id, build_s=built.total_s)
            if packed.digest == verified.digest:
                return Rebuilt(ok=True, total_s=round(time.monotonic() - started, 2), **common)
            if built.image_id == common["published_image_id"]:  # the config binds every layer's diff id
                note = (f"the same image (config and every layer's tar); only the registry's compressed bytes differ "
                        f"from what this host writes (zlib {zlib.ZLIB_RUNTIME_VERSION}), so the manifest digests differ")
                return Rebuilt(ok=True, note=note, total_s=round(time.monotonic() - started, 2), **common)
            try:
                difference, layer, file = _Compare(client=client, repository=name.repository, manifest=manifest,
                                                   config=config, rebuilt=packed, docker=docker,
                                                   scratch=scratch).difference()
            except (NetworkError, UntrustedInputError, PublishError) as exc:  # what the registry holds is unreadable
                difference, layer, file = f"the digests differ; the first differing file could not be read: {exc}", None, None
            return Rebuilt(ok=False, difference=difference, layer=layer, file=file,
                           total_s=round(time.monotonic() - started, 2), **common)
        finally:
            docker.remove_image(temporary)
