"""Index an image's files from its layers, without running it: every path's type, mode, size and hashes.

The static integrity check (gates/integrity/static.py) reads an image under test from the outside, so an
image that behaves well only while it is probed has nowhere to hide. Two sources, one result:

- ``scan_layer_dir``: a layer as the Docker engine stores it with the overlay2 driver (a folder
  per layer, whiteouts as 0:0 character devices, opaque folders marked by an xattr). Fast: the
  files are read in place.
- ``scan_layer_tar``: a layer as `docker save` streams it (OCI whiteouts ``.wh.NAME`` and
  ``.wh..wh..opq``), for engines whose layers are not on this machine's disk.

Both walk hostile content: nothing is followed (symlinks are recorded with their target), files
are opened with O_NOFOLLOW below a folder descriptor chain, names, sizes and folder depth are bounded,
and a broken tar stream is an ``UntrustedInputError``. A
``LayerIndex`` is cached on disk by the layer's diff id (a sha256 of its content that the engine
computed, immutable): a derived image re-reads only its new layers. ``merge`` applies layers
bottom to top into one ``FileView``, the file system a container of the image starts with.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple, Protocol, cast

from skupin.common.untrusted import UntrustedInputError

if TYPE_CHECKING:
    import io

INDEX_FORMAT = "skupin-layer-index/2"
MAX_ENTRIES = 2_000_000
MAX_PATH = 4096
MAX_DEPTH = 256  # folders below a layer's root (a descriptor each while it is walked)
MAX_KEPT_BYTES = 64 * 1024**2
MAX_EXTENDED_HEADER = 1024**2  # a pax header or GNU long name: Go's archive/tar (docker pull) reads no larger one
MAX_EXTENDED_CHAIN = 8  # extended headers in a row before one member
MAX_GLOBAL_HEADERS = 16
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class Entry(NamedTuple):
    """One path of a layer or of the merged view. kind: f file, d folder, l symlink, w whiteout, o other."""

    kind: str
    mode: int
    size: int
    mtime: int
    sha256: str = ""
    md5: str = ""
    target: str = ""
    elf: bool = False
    layer: int = -1


@dataclass
class LayerIndex:
    """The entries of one layer (paths relative to /, no leading slash) and its opaque folders."""

    diff_id: str
    entries: dict[str, Entry] = field(default_factory=dict)
    opaque: set[str] = field(default_factory=set)

    def to_json(self) -> bytes:
        doc = {"format": INDEX_FORMAT, "diff_id": self.diff_id, "opaque": sorted(self.opaque),
               "entries": [[p, *e[:8]] for p, e in sorted(self.entries.items())]}
        return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=3)

    @classmethod
    def from_json(cls, data: bytes, *, diff_id: str) -> LayerIndex:
        doc = json.loads(gzip.decompress(data))
        if doc.get("format") != INDEX_FORMAT or doc.get("diff_id") != diff_id:
            raise ValueError("stale or foreign layer index")
        entries = {row[0]: Entry(*row[1:]) for row in doc["entries"]}
        return cls(diff_id=diff_id, entries=entries, opaque=set(doc["opaque"]))


def _hash_stream(read: Callable[[int], bytes], keep: IO[bytes] | None = None) -> tuple[str, str, int, bool]:
    """(sha256, md5, bytes, starts with the ELF magic) of a stream, copying it to `keep` when given."""
    sha, md5, size, head = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0, b""
    while chunk := read(1 << 20):
        if len(head) < 4:
            head += chunk[: 4 - len(head)]
        sha.update(chunk)
        md5.update(chunk)
        size += len(chunk)
        if keep is not None:
            keep.write(chunk)
    return sha.hexdigest(), md5.hexdigest(), size, head == b"\x7fELF"


def _check_name(rel: str) -> str:
    if len(rel) > MAX_PATH or "\x00" in rel:
        raise UntrustedInputError(f"layer path {rel[:80]!r}...: longer than {MAX_PATH} characters or not a path")
    return rel


# ---------------------------------------------------------------- overlay2 folders


def _opaque(path: str) -> bool:
    for name in OPAQUE_XATTRS:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def scan_layer_dir(root: Path, *, diff_id: str) -> LayerIndex:
    """Index an overlay2 layer folder (read in place: links recorded, never followed).

    Depth first, holding a descriptor only for each folder on the current path (at most `MAX_DEPTH`, so a
    layer with more folders than the open-files limit is read like any other); a deeper tree is refused.
    """
    index = LayerIndex(diff_id=diff_id)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(root, flags)
    path: list[tuple[str, int, list[str]]] = [("", top, sorted(os.listdir(top), reverse=True))]  # (rel/, fd, names left)
    try:
        while path:
            rel_dir, fd, names = path[-1]
            if not names:
                os.close(fd)
                path.pop()
                continue
            name = names.pop()
            rel = _check_name(f"{rel_dir}{name}")
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if len(index.entries) >= MAX_ENTRIES:
                raise UntrustedInputError(f"layer {diff_id[:19]}: more than {MAX_ENTRIES} entries")
            index.entries[rel] = _dir_entry(fd, name, st, root / rel)
            if stat.S_ISDIR(st.st_mode):
                if len(path) > MAX_DEPTH:  # `rel` is len(path) folders deep
                    raise UntrustedInputError(f"layer {diff_id[:19]}: folders nested deeper than {MAX_DEPTH} levels "
                                              f"(/{rel[:200]})")
                if _opaque(str(root / rel)):
                    index.opaque.add(rel)
                child = os.open(name, flags, dir_fd=fd)
                try:
                    children = sorted(os.listdir(child), reverse=True)
                except BaseException:
                    os.close(child)
                    raise
                path.append((rel + "/", child, children))
    finally:
        for _, fd, _ in path:
            os.close(fd)
    return index


def _dir_entry(fd: int, name: str, st: os.stat_result, _path: Path) -> Entry:
    mode, mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
    if stat.S_ISREG(st.st_mode):
        ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        with os.fdopen(ffd, "rb") as handle:
            sha, md5, size, elf = _hash_stream(handle.read)
        return Entry("f", mode, size, mtime, sha, md5, "", elf)
    if stat.S_ISDIR(st.st_mode):
        return Entry("d", mode, 0, mtime)
    if stat.S_ISLNK(st.st_mode):
        return Entry("l", mode, 0, mtime, target=os.readlink(name, dir_fd=fd)[:MAX_PATH])
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return Entry("w", mode, 0, mtime)
    return Entry("o", mode, 0, mtime)


def open_in_layer(root: Path, rel: str) -> int:
    """A read descriptor of regular file `rel` of a layer folder, walking each component with O_NOFOLLOW."""
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise UntrustedInputError(f"{rel!r}: not a plain path")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- docker save streams


class BoundedTarInfo(tarfile.TarInfo):
    """A header of a hostile tar, read by tarfile with bounds (`tarfile.open(..., tarinfo=BoundedTarInfo)`).

    tarfile reads a pax header or GNU long name whole into memory (an 8 GiB one from a few MB of gzip), parses pax
    records in quadratic time and memory before CPython 3.11.10 (CVE-2024-6232: a 64 KiB header costs seconds or
    700 MB), reads GNU sparse maps of any length, recurses once per extended header in a row, and ends the archive
    silently at an invalid header (a scan would miss every later entry). Here an extended header is at most
    MAX_EXTENDED_HEADER bytes, its pax records are parsed here in linear time and strictly (length, keyword, `=`,
    newline), at most MAX_EXTENDED_CHAIN precede a member, sparse files (which no image writer makes) are refused,
    and an invalid header is an error, not the end."""

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> BoundedTarInfo:
        try:
            return super().frombuf(buf, encoding, errors)
        except tarfile.InvalidHeaderError as exc:  # type: ignore[attr-defined]  # (not in typeshed)
            raise tarfile.ReadError(f"an invalid tar header: {exc}") from None

    def _extended(self, tar: tarfile.TarFile) -> contextlib.AbstractContextManager[None]:
        if not 0 <= self.size <= MAX_EXTENDED_HEADER:
            raise tarfile.ReadError(f"an extended tar header of {self.size} bytes (limit {MAX_EXTENDED_HEADER})")
        depth = getattr(tar, "_skupin_chain", 0)
        if depth >= MAX_EXTENDED_CHAIN:
            raise tarfile.ReadError(f"more than {MAX_EXTENDED_CHAIN} extended tar headers in a row")

        @contextlib.contextmanager
        def chained() -> Iterator[None]:
            setattr(tar, "_skupin_chain", depth + 1)  # noqa: B010 - a mark of this reader's own on the TarFile
            try:
                yield
            finally:
                setattr(tar, "_skupin_chain", depth)  # noqa: B010
        return chained()

    def _proc_gnulong(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        with self._extended(tar):
            return cast(tarfile.TarInfo, super()._proc_gnulong(tar))  # type: ignore[misc]

    def _proc_sparse(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        raise tarfile.ReadError(f"{self.name[:200]!r}: a GNU sparse file (no image writer makes one; refused)")

    def _proc_pax(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        """tarfile's own `_proc_pax` (CPython 3.11), with the records parsed by `pax_records` and no sparse maps."""
        with self._extended(tar):
            if self.type == tarfile.XGLTYPE:
                seen = getattr(tar, "_skupin_globals", 0) + 1
                if seen > MAX_GLOBAL_HEADERS:
                    raise tarfile.ReadError(f"more than {MAX_GLOBAL_HEADERS} global pax headers")
                setattr(tar, "_skupin_globals", seen)  # noqa: B010
            buf = cast(IO[bytes], tar.fileobj).read(_blocks(self.size))
            records = pax_records(buf[: self.size])
            shared = cast(dict[str, str], tar.pax_headers)
            pax_headers = shared if self.type == tarfile.XGLTYPE else dict(shared)
            charset = next((v for k, v in records if k == b"hdrcharset"), None)
            if charset is not None:
                pax_headers["hdrcharset"] = charset.decode("utf-8", "surrogateescape")
            encoding = tar.encoding if pax_headers.get("hdrcharset") == "BINARY" else "utf-8"
            decode = self._decode_pax_field  # type: ignore[attr-defined]
            for raw_key, raw_value in records:
                keyword = decode(raw_key, "utf-8", "utf-8", tar.errors)
                if keyword.startswith("GNU.sparse."):
                    raise tarfile.ReadError(f"a pax header of a GNU sparse file ({keyword}; refused)")
                pax_headers[keyword] = (decode(raw_value, encoding, tar.encoding, tar.errors)
                                        if keyword in tarfile.PAX_NAME_FIELDS
                                        else decode(raw_value, "utf-8", "utf-8", tar.errors))
            try:
                following = self.fromtarfile(tar)
            except tarfile.HeaderError as exc:
                raise tarfile.ReadError(str(exc)) from None
        if self.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
            following._apply_pax_info(pax_headers, tar.encoding, tar.errors)  # type: ignore[attr-defined]
            following.offset = self.offset
            if "size" in pax_headers:  # the pax size replaces the header's: where the next header starts
                offset = following.offset_data
                if following.isreg() or following.type not in tarfile.SUPPORTED_TYPES:
                    offset += _blocks(following.size)
                tar.offset = offset
        return following


def _blocks(size: int) -> int:
    """`size` rounded up to whole tar blocks (tarfile's TarInfo._block)."""
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def pax_records(payload: bytes) -> list[tuple[bytes, bytes]]:
    """The (keyword, value) records of a pax header, in linear time; tarfile.ReadError unless each is
    `LENGTH KEYWORD=VALUE\\n` with LENGTH its byte count (NULs may pad the end)."""
    records: list[tuple[bytes, bytes]] = []
    pos = 0
    while pos < len(payload) and payload[pos] != 0:
        space = payload.find(b" ", pos, pos + 21)
        digits = payload[pos:space] if space > pos else b""
        end = pos + int(digits) if digits.isdigit() else -1
        if not digits.isdigit() or not space + 3 < end <= len(payload) or payload[end - 1] != 0x0A:
            raise tarfile.ReadError(f"a malformed pax record at byte {pos}")
        equals = payload.find(b"=", space + 1, end - 1)
        if equals <= space + 1:
            raise tarfile.ReadError(f"a pax record without a keyword and '=' at byte {pos}")
        records.append((payload[space + 1:equals], payload[equals + 1:end - 1]))
        pos = end
    if payload[pos:].strip(b"\0"):
        raise tarfile.ReadError(f"bytes after the pax records at byte {pos}")
    return records


def _tar_rel(name: str) -> str:
    rel = name[2:] if name.startswith("./") else name.lstrip("/")
    rel = rel.rstrip("/")
    return "" if rel == "." else _check_name(rel)


def scan_layer_tar(stream: IO[bytes], *, diff_id: str, store: BlobStore | None = None) -> LayerIndex:
    """Index one layer tar (OCI whiteouts); files `store` wants are copied into it (by sha256)."""
    index = LayerIndex(diff_id=diff_id)
    try:
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=BoundedTarInfo) as tar:
            for member in tar:
                rel = _tar_rel(member.name)
                if not rel:
                    continue
                if len(index.entries) >= MAX_ENTRIES:
                    raise UntrustedInputError(f"layer {diff_id[:19]}: more than {MAX_ENTRIES} entries")
                folder, _, base = rel.rpartition("/")
                if base == OPAQUE:
                    index.opaque.add(folder)
                    continue
                if base.startswith(WHITEOUT):
                    index.entries[f"{folder}/{base[len(WHITEOUT):]}" if folder else base[len(WHITEOUT):]] = Entry(
                        "w", 0, 0, int(member.mtime))
                    continue
                index.entries[rel] = _tar_entry(tar, member, rel, index, store)
    except (tarfile.TarError, EOFError) as exc:
        raise UntrustedInputError(f"layer {diff_id[:19]}: not a readable tar stream: {exc}") from exc
    return index


def _tar_entry(tar: tarfile.TarFile, member: tarfile.TarInfo, rel: str, index: LayerIndex,
               store: BlobStore | None) -> Entry:
    mode, mtime = member.mode & 0o7777, int(member.mtime)
    if member.isreg():
        source = tar.extractfile(member)
        assert source is not None
        if store is not None and store.wanted(rel, member.size):
            with store.writer() as (out, commit):
                sha, md5, size, elf = _hash_stream(source.read, out)
                commit(sha)
        else:
            sha, md5, size, elf = _hash_stream(source.read)
        return Entry("f", mode, size, mtime, sha, md5, "", elf)
    if member.islnk():  # a hard link to an earlier member of the same layer
        linked = index.entries.get(_tar_rel(member.linkname))
        if linked is None or linked.kind != "f":
            return Entry("o", mode, 0, mtime)
        return linked._replace(mode=mode, mtime=mtime)
    if member.isdir():
        return Entry("d", mode, 0, mtime)
    if member.issym():
        return Entry("l", mode, 0, mtime, target=member.linkname[:MAX_PATH])
    return Entry("o", mode, 0, mtime)


def iter_saved_layers(stream: IO[bytes], *, store: BlobStore | None = None) -> Iterator[LayerIndex]:
    """Every layer of a `docker save` stream (legacy `<id>/layer.tar` or OCI `blobs/sha256/<hex>`).

    A layer's diff id is the sha256 of its tar bytes, computed while it streams by; members that are
    not layers (manifests, configs) are skipped. Layers come in stream order, not image order.
    """
    try:
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=BoundedTarInfo) as outer:
            for member in outer:
                if not member.isreg() or not (member.name.endswith("layer.tar") or "blobs/sha256/" in member.name):
                    continue
                source = outer.extractfile(member)
                assert source is not None
                hashing = _HashingReader(source)
                head = hashing.peek_tar()
                if not head:
                    hashing.drain()
                    continue
                index = scan_layer_tar(cast(IO[bytes], hashing), diff_id="pending", store=store)
                hashing.drain()
                index.diff_id = "sha256:" + hashing.sha.hexdigest()
                yield index
    except (tarfile.TarError, EOFError) as exc:
        raise UntrustedInputError(f"the `docker save` stream is not a readable tar stream: {exc}") from exc


class _HashingReader:
    """A read-only stream that hashes what passes through it (for a layer's diff id)."""

    def __init__(self, source: IO[bytes]) -> None:
        self.source, self.sha, self.buffer = source, hashlib.sha256(), b""

    def peek_tar(self) -> bool:
        """Whether the stream starts like a tar archive (a config blob does not)."""
        self.buffer = self.source.read(512)
        return len(self.buffer) == 512 and self.buffer[257:262] == b"ustar"

    def read(self, size: int = -1) -> bytes:
        if self.buffer:
            data, self.buffer = (self.buffer, b"") if size < 0 or size >= len(self.buffer) else (
                self.buffer[:size], self.buffer[size:])
            self.sha.update(data)
            return data
        data = self.source.read(size)
        self.sha.update(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


class BlobStore:
    """A content-addressed folder of file bytes copied out of streamed layers (what later checks must read)."""

    def __init__(self, root: Path, wanted: Callable[[str, int], bool]) -> None:
        self.root, self.wanted = Path(root), wanted
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    @contextlib.contextmanager
    def writer(self) -> Iterator[tuple[IO[bytes], Callable[[str], None]]]:
        """(a new temporary file, commit(sha256)); an uncommitted file is removed."""
        handle = tempfile.NamedTemporaryFile(dir=self.root, prefix=".part-", delete=False)
        done: list[str] = []
        try:
            with handle:
                yield handle, done.append
            if done:
                os.replace(handle.name, self.path(done[0]))
        finally:
            if os.path.exists(handle.name):
                os.unlink(handle.name)


# ---------------------------------------------------------------- the merged view


ReadAt = Callable[[int, int], bytes]  # (offset, size) -> at most `size` bytes of one file
RangeOpener = Callable[[str, Entry], contextlib.AbstractContextManager[ReadAt]]


@dataclass
class FileView:
    """The merged file system of an image: path -> Entry (with the index of the layer it came from).

    `ranges`, when the layers are on this disk, opens one file for reads at offsets (`open_ranges`): the binaries
    check reads a few kilobytes of headers of files of gigabytes. Without it a file is read whole (bounded).
    """

    entries: dict[str, Entry]
    layers: tuple[str, ...]
    read: Callable[[str, Entry, int], bytes] = field(repr=False, default=lambda *_: b"")
    bottom: dict[str, Entry] | None = field(repr=False, default=None)  # the bottom layers alone (`image_view(bottom=)`)
    ranges: RangeOpener | None = field(repr=False, default=None)

    def bottom_view(self, count: int) -> FileView:
        """The file system of the bottom `count` layers alone, as they were before any upper layer changed them."""
        if count == 0:
            return FileView(entries={}, layers=(), read=self.read, ranges=self.ranges)
        if self.bottom is None:
            raise UntrustedInputError("the view was made without its bottom layers")
        return FileView(entries=self.bottom, layers=self.layers[:count], read=self.read, ranges=self.ranges)

    @contextlib.contextmanager
    def open_ranges(self, path: str) -> Iterator[ReadAt]:
        """`read_at(offset, size)` over regular file `path` of the image, while the context lasts (UntrustedInputError
        when it is not one, or when it cannot be read here: a file a streamed layer did not keep)."""
        rel = path.lstrip("/")
        entry = self.entries.get(rel)
        if entry is None or entry.kind != "f":
            raise UntrustedInputError(f"/{rel}: not a regular file of the image")
        if self.ranges is None:
            data = self.read_file(rel)
            yield lambda offset, size: data[offset:offset + size]
            return
        with self.ranges(rel, entry) as read_at:
            yield read_at

    def get(self, path: str) -> Entry | None:
        return self.entries.get(path.lstrip("/"))

    def under(self, folder: str) -> Iterator[tuple[str, Entry]]:
        prefix = folder.strip("/") + "/"
        for path, entry in self.entries.items():
            if path.startswith(prefix):
                yield path, entry

    def read_file(self, path: str, *, max_bytes: int = MAX_KEPT_BYTES) -> bytes:
        """The bytes of regular file `path` of the image (UntrustedInputError when it is not one or too big)."""
        entry = self.get(path)
        if entry is None or entry.kind != "f":
            raise UntrustedInputError(f"/{path.lstrip('/')}: not a regular file of the image")
        if entry.size > max_bytes:
            raise UntrustedInputError(f"/{path.lstrip('/')}: {entry.size} bytes exceed the limit of {max_bytes}")
        return self.read(path.lstrip("/"), entry, max_bytes)

    def resolve(self, path: str, *, hops: int = 40) -> str | None:
        """The path `path` names after following the image's symlinks (inside the image), or None when dangling."""
        parts = [p for p in path.strip("/").split("/") if p]
        done: list[str] = []
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            current = "/".join([*done, part])
            entry = self.entries.get(current)
            if entry is None:
                return None
            if entry.kind == "l":
                hops -= 1
                if hops < 0:
                    return None
                target = [p for p in entry.target.split("/") if p]
                parts = target + parts
                if entry.target.startswith("/"):
                    done = []
                continue
            done.append(part)
        return "/".join(done)


def merge(layers: Iterable[LayerIndex]) -> dict[str, Entry]:
    """Apply layers bottom to top (opaque folders, whiteouts, replacements) as overlayfs does.

    Per layer, what it removes from the layers below is gathered first (whited-out paths, and the folders
    whose lower content goes: opaque ones, whited-out ones, ones it replaces by a non-folder), then the
    merged map is filtered once, each path checked by its ancestors: linear in paths, not paths x whiteouts.
    """
    merged: dict[str, Entry] = {}
    for number, layer in enumerate(layers):
        gone: set[str] = set()  # exact paths removed
        emptied = {folder.rstrip("/") for folder in layer.opaque}  # folders whose lower content is removed
        for path, entry in layer.entries.items():
            if entry.kind == "w":
                gone.add(path)
                emptied.add(path)
            elif entry.kind != "d" and (old := merged.get(path)) is not None and old.kind == "d":
                emptied.add(path)
        if gone or emptied:
            merged = {p: e for p, e in merged.items() if p not in gone and not _under_any(p, emptied)}
        for path, entry in layer.entries.items():
            if entry.kind != "w":
                merged[path] = entry._replace(layer=number)
    return merged


def _under_any(path: str, folders: set[str]) -> bool:
    """Whether `path` lies below one of `folders` (checked by its ancestors, not by scanning `folders`)."""
    cut = path.find("/")
    while cut != -1:
        if path[:cut] in folders:
            return True
        cut = path.find("/", cut + 1)
    return False


# ---------------------------------------------------------------- an image, from the engine


class ImageLayers(Protocol):
    """What the view reads of a Docker engine (skupin.dockerd's `Docker`, which this room may not import)."""

    def layer_dirs(self, ref: str) -> tuple[Path, ...] | None: ...

    def save_image(self, ref: str) -> io.RawIOBase: ...


def kept_for_checks(rel: str, size: int) -> bool:
    """The files the integrity check reads back (streamed layers keep a copy of these only)."""
    if size > MAX_KEPT_BYTES:
        return False
    return (rel.endswith((".py", ".pyc", ".pth", ".cfg")) or rel.startswith(("var/lib/dpkg/", "etc/python"))
            or rel in ("etc/os-release", "usr/lib/os-release"))  # the SBOM's distro (skupin/publishing/sbom.py)


def image_view(*, docker: ImageLayers, image: str, layers: tuple[str, ...], cache: Path, bottom: int = 0,
               on_event: Callable[[str], None] = lambda _: None) -> FileView:
    """The merged FileView of local image `image` whose layers (diff ids, bottom first) are `layers`; with
    `bottom`, the view also keeps the merge of its bottom `bottom` layers alone (`FileView.bottom_view`).

    Each layer is indexed once and cached under `cache` by its diff id; from the Docker daemon's
    overlay2 folders when they are on this disk, else from a `docker save` stream (files the checks
    read are then kept in a content-addressed store next to the indexes).
    """
    dirs = docker.layer_dirs(image)
    if dirs is not None and len(dirs) != len(layers):
        dirs = None
    mode = "dir" if dirs is not None else "tar"
    folder = Path(cache) / "layers"
    folder.mkdir(parents=True, exist_ok=True)
    store = BlobStore(Path(cache) / "blobs", kept_for_checks)
    found = {d: index for d in layers if (index := _cached(folder, d, mode)) is not None}
    if len(found) < len(layers) and dirs is not None:
        for diff_id, root in zip(layers, dirs, strict=True):
            if diff_id not in found:
                on_event(f"pins: indexing layer {diff_id[7:19]} ({root})")
                found[diff_id] = _cache(scan_layer_dir(root, diff_id=diff_id), folder, mode)
    elif len(found) < len(layers):
        _index_from_save(docker=docker, image=image, layers=layers, found=found, store=store, folder=folder,
                         on_event=on_event)
    entries = merge(found[d] for d in layers)
    read = _dir_reader(dirs) if dirs is not None else _store_reader(store)
    lower = merge(found[d] for d in layers[:bottom]) if bottom else None
    return FileView(entries=entries, layers=tuple(layers), read=read, bottom=lower,
                    ranges=_dir_ranges(dirs) if dirs is not None else None)


def _cached(folder: Path, diff_id: str, mode: str) -> LayerIndex | None:
    try:
        return LayerIndex.from_json((folder / f"{diff_id.removeprefix('sha256:')}.{mode}.json.gz").read_bytes(),
                                    diff_id=diff_id)
    except (OSError, ValueError, KeyError, EOFError):
        return None


def _index_from_save(*, docker: ImageLayers, image: str, layers: tuple[str, ...], found: dict[str, LayerIndex], store: BlobStore,
                     folder: Path, on_event: Callable[[str], None]) -> None:
    """Index the layers `found` lacks from one `docker save` stream of the image."""
    missing = [d for d in layers if d not in found]
    on_event(f"pins: indexing {len(missing)} layer(s) from a `docker save` stream of {image}")
    with docker.save_image(image) as stream:
        for index in iter_saved_layers(cast(IO[bytes], stream), store=store):
            if index.diff_id in missing:
                found[index.diff_id] = _cache(index, folder, "tar")
    lost = [d for d in layers if d not in found]
    if lost:
        raise UntrustedInputError(f"{image}: `docker save` did not contain layer(s) {', '.join(d[7:19] for d in lost)}")


def _dir_reader(dirs: tuple[Path, ...]) -> Callable[[str, Entry, int], bytes]:
    """Read a file of the view in place from its layer folder (O_NOFOLLOW at every step)."""
    def read(rel: str, entry: Entry, max_bytes: int) -> bytes:
        with os.fdopen(open_in_layer(dirs[entry.layer], rel), "rb") as handle:
            data = handle.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise UntrustedInputError(f"/{rel}: more than {max_bytes} bytes")
        return data
    return read


def _dir_ranges(dirs: tuple[Path, ...]) -> RangeOpener:
    """Open a file of the view in its layer folder (O_NOFOLLOW at every step) for `pread`s at offsets."""
    @contextlib.contextmanager
    def opened(rel: str, entry: Entry) -> Iterator[ReadAt]:
        fd = open_in_layer(dirs[entry.layer], rel)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UntrustedInputError(f"/{rel}: not a regular file in its layer")
            yield lambda offset, size: os.pread(fd, size, offset)
        finally:
            os.close(fd)
    return opened


def _store_reader(store: BlobStore) -> Callable[[str, Entry, int], bytes]:
    """Read a file of the view from the copies kept while its layers streamed by (checked against its hash)."""
    def read(rel: str, entry: Entry, max_bytes: int) -> bytes:
        try:
            data = store.path(entry.sha256).read_bytes()
        except OSError as exc:
            raise UntrustedInputError(f"/{rel}: not kept from the layer stream") from exc
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise UntrustedInputError(f"/{rel}: the kept copy does not match its hash")
        return data
    return read


def _cache(index: LayerIndex, folder: Path, mode: str) -> LayerIndex:
    """Write the index to the cache atomically, through a temporary file of its own (two gates may cache one layer)."""
    path = folder / f"{index.diff_id.removeprefix('sha256:')}.{mode}.json.gz"
    handle = tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".part", delete=False)
    try:
        with handle:
            handle.write(index.to_json())
        os.replace(handle.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise
    return index
