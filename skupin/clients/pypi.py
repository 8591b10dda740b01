"""A PyPI-style package index over the shared transport: PEP 691 project pages, core metadata, release JSON.

  - PEP 691 JSON simple API: `GET {index}/<name>/` with `Accept: application/vnd.pypi.simple.v1+json`
    gives the project's files and versions (`project`, `versions`, `files`);
  - a file's core metadata (`core_metadata`): the PEP 658 `<file url>.metadata` when the index
    serves it, else the wheel's own `*.dist-info/METADATA` read with HTTP range requests (only the
    zip's central directory and that one member travel, not the whole wheel);
  - the JSON metadata API `GET {json_url}/<name>/<version>/json` (`release_json`), where the index has one.
The index URL is configurable for mirrors (`IndexClient("https://mirror.example/simple")`).
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urljoin

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from skupin.clients.transport import DEFAULT_RETRIES, DEFAULT_TIMEOUT, Sleep, Transport, safe_url, server_json
from skupin.common.errors import NetworkError
from skupin.common.model import Frozen
from skupin.common.paths import PYPI_SIMPLE

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


class IndexFile(Frozen):
    """One file of a project on an index (PEP 691 `files[]` entry, URL made absolute)."""

    filename: str
    url: str
    sha256: str | None = None
    requires_python: str | None = None
    core_metadata: bool = False
    yanked: bool = False
    size: int | None = None

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")

    def version(self) -> Version | None:
        """The file's version, from the wheel or sdist name (None when it cannot be parsed)."""
        try:
            if self.is_wheel:
                return parse_wheel_filename(self.filename)[1]
            stem = re.sub(r"\.(tar\.gz|zip|tar\.bz2)$", "", self.filename)
            return Version(stem.rsplit("-", 1)[1])
        except (InvalidVersion, IndexError, ValueError):
            return None

    def platform_tags(self) -> frozenset[str]:
        if not self.is_wheel:
            return frozenset()
        return frozenset(t.platform for t in parse_wheel_filename(self.filename)[3])


class Project(Frozen):
    """A project page of the simple API: its name, versions (as the index lists them) and files."""

    name: str
    versions: tuple[str, ...]
    files: tuple[IndexFile, ...]

    def releases(self, *, prereleases: bool = False) -> tuple[Version, ...]:
        """Parsed versions, sorted, without pre-releases unless asked; unparsable ones skipped."""
        found: set[Version] = set()
        for raw in self.versions or tuple(str(f.version()) for f in self.files if f.version()):
            try:
                v = Version(raw)
            except InvalidVersion:
                continue
            if prereleases or not (v.is_prerelease or v.is_devrelease):
                found.add(v)
        return tuple(sorted(found))

    def files_for(self, version: Version | str) -> tuple[IndexFile, ...]:
        want = Version(str(version))
        return tuple(f for f in self.files if f.version() == want)


def linux_x86_64_wheel(files: tuple[IndexFile, ...], *, python: str = "3.12") -> IndexFile | None:
    """The file whose metadata stands for the Linux x86_64 build: a manylinux x86_64 wheel for `python`
    (or abi3/py3; a py3-none-any wheel for pure-Python projects), preferring non-yanked files without a build tag;
    None when there is none."""
    cp = "cp" + python.replace(".", "")

    def score(f: IndexFile) -> tuple[int, int, int]:
        name, _, build, tags = parse_wheel_filename(f.filename)
        interp = {t.interpreter for t in tags}
        abis = {t.abi for t in tags}
        py = 2 if cp in interp else 1 if ("abi3" in abis or "py3" in interp) else 0
        return (py, 0 if build else 1, 0 if f.yanked else 1)

    wheels = [f for f in files if f.is_wheel and any("linux" in p and "x86_64" in p for p in f.platform_tags())]
    wheels = [f for f in wheels if score(f)[0] > 0]
    if not wheels:  # a pure-Python project: its py3-none-any wheel stands for every platform
        wheels = [f for f in files if f.is_wheel and f.platform_tags() == {"any"}]
    return max(wheels, key=score) if wheels else None


def parse_metadata(text: str) -> dict[str, tuple[str, ...]]:
    """Core metadata (RFC 822 style) -> {lowercased field: values}; enough for Name/Version/Requires-Dist."""
    import email.parser

    msg = email.parser.HeaderParser().parsestr(text)
    fields: dict[str, list[str]] = {}
    for key, value in msg.items():
        fields.setdefault(key.lower(), []).append(" ".join(str(value).split()))
    return {k: tuple(v) for k, v in fields.items()}


class IndexClient:
    """A PEP 691 package index (and its JSON API where it has one); the base URL is the `/simple` root.

    >>> with IndexClient("https://pypi.org/simple", ca_bundle="/etc/ssl/certs/ca-certificates.crt") as ix:
    ...     ix.requires_dist("vllm", "0.32.0")           # from the Linux x86_64 wheel's metadata
    """

    def __init__(self, base_url: str = PYPI_SIMPLE, *, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = DEFAULT_RETRIES, ca_bundle: Path | str | None = None, json_url: str | None = None,
                 backoff: float = 0.5, sleep: Sleep | None = None) -> None:
        self.base_url = base_url.rstrip("/") + "/"
        root = self.base_url.removesuffix("simple/") if self.base_url.endswith("/simple/") else None
        self.json_url = (json_url.rstrip("/") + "/") if json_url else (root + "pypi/" if root else None)
        self.http = Transport(timeout=timeout, retries=retries, ca_bundle=ca_bundle, backoff=backoff, sleep=sleep,
                          what=f"index {safe_url(self.base_url)}")
        self._projects: dict[str, Project] = {}
        self._metadata: dict[str, dict[str, tuple[str, ...]]] = {}

    def __enter__(self) -> IndexClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def __repr__(self) -> str:
        return f"IndexClient({safe_url(self.base_url)!r})"

    # -- simple API

    def project(self, name: str) -> Project:
        """The project's page (cached per client). NetworkError when the index has no such project."""
        key = canonicalize_name(name)
        if key not in self._projects:
            url = urljoin(self.base_url, f"{key}/")
            response = self.http.request("GET", url, headers={"Accept": f"{SIMPLE_JSON}, application/json;q=0.1"})
            try:
                data = server_json(response.content, source=safe_url(url))
                files = tuple(self._file(url, f) for f in data.get("files", ()))
                self._projects[key] = Project(name=data.get("name", key), versions=tuple(data.get("versions", ())),
                                              files=files)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise NetworkError(f"index {safe_url(url)}: not a PEP 691 JSON page "
                                   f"(content-type {response.headers.get('content-type', '?')}): {exc}") from exc
        return self._projects[key]

    @staticmethod
    def _file(page: str, entry: Mapping) -> IndexFile:
        meta = entry.get("core-metadata", entry.get("dist-info-metadata", False))
        yanked = entry.get("yanked", False)
        return IndexFile(filename=entry["filename"], url=urljoin(page, entry["url"]),
                         sha256=(entry.get("hashes") or {}).get("sha256"), requires_python=entry.get("requires-python"),
                         core_metadata=bool(meta), yanked=bool(yanked), size=entry.get("size"))

    def versions(self, name: str, *, prereleases: bool = False) -> tuple[Version, ...]:
        """Every release of a project, sorted (pre-releases only when asked)."""
        return self.project(name).releases(prereleases=prereleases)

    def files(self, name: str, version: Version | str) -> tuple[IndexFile, ...]:
        return self.project(name).files_for(version)

    # -- core metadata

    def core_metadata(self, file: IndexFile) -> dict[str, tuple[str, ...]]:
        """A wheel's core metadata: PEP 658 `.metadata` when served, else the wheel's METADATA via range reads."""
        if file.url in self._metadata:
            return self._metadata[file.url]
        text = None
        response = self.http.request("GET", file.url + ".metadata", ok=(200, 404))
        if response.status_code == 200:
            text = response.text
        elif file.is_wheel:
            text = self._metadata_from_wheel(file)
        if text is None:
            raise NetworkError(f"index {safe_url(self.base_url)}: no metadata for {file.filename}")
        self._metadata[file.url] = parse_metadata(text)
        return self._metadata[file.url]

    def _metadata_from_wheel(self, file: IndexFile) -> str:
        remote = _RangeFile(self.http, file.url, size=file.size)
        name, version, _, _ = parse_wheel_filename(file.filename)
        try:
            with zipfile.ZipFile(remote) as wheel:
                member = next((n for n in wheel.namelist()
                               if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
                if member is None:
                    raise NetworkError(f"{file.filename}: no *.dist-info/METADATA in the wheel")
                return wheel.read(member).decode("utf-8")
        except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as exc:
            raise NetworkError(f"{file.filename}: cannot read METADATA with range requests: {exc}") from exc

    def requires_dist(self, name: str, version: Version | str, *, python: str = "3.12") -> tuple[str, ...]:
        """Requires-Dist of the release's Linux x86_64 wheel (NetworkError when it has none)."""
        file = linux_x86_64_wheel(self.files(name, version), python=python)
        if file is None:
            raise NetworkError(f"index {safe_url(self.base_url)}: {name} {version} has no Linux x86_64 wheel")
        return self.core_metadata(file).get("requires-dist", ())

    # -- JSON API

    def release_json(self, name: str, version: Version | str) -> dict:
        """`{json_url}/<name>/<version>/json` (PyPI's JSON API); NetworkError when the index has none."""
        if self.json_url is None:
            raise NetworkError(f"index {safe_url(self.base_url)}: no JSON API configured (pass json_url)")
        url = urljoin(self.json_url, f"{canonicalize_name(name)}/{version}/json")
        try:
            return server_json(self.http.request("GET", url).content, source=safe_url(url))
        except ValueError as exc:
            raise NetworkError(f"index {safe_url(url)}: not JSON: {exc}") from exc


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file that fetches only the byte ranges zipfile asks for."""

    CHUNK = 256 * 1024

    def __init__(self, http: Transport, url: str, *, size: int | None) -> None:
        self.http, self.url, self.pos = http, url, 0
        if size is None:
            head = http.request("HEAD", url)
            size = int(head.headers["content-length"])
        self.size = size
        self._cache: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _chunk(self, index: int) -> bytes:
        if index not in self._cache:
            start = index * self.CHUNK
            end = min(self.size, start + self.CHUNK) - 1
            r = self.http.request("GET", self.url, ok=(206,), headers={"Range": f"bytes={start}-{end}"})
            self._cache[index] = r.content
        return self._cache[index]

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            index, skip = divmod(self.pos, self.CHUNK)
            piece = self._chunk(index)[skip: skip + (end - self.pos)]
            if not piece:
                break
            out += piece
            self.pos += len(piece)
        return bytes(out)

    def readinto(self, b: WriteableBuffer) -> int:
        view = memoryview(b)
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)
