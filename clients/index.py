"""The one module that talks HTTP to package indexes and OCI registries (httpx): timeouts, retries, clear errors.

Package indexes (`IndexClient`):
  - PEP 691 JSON simple API: `GET {index}/<name>/` with `Accept: application/vnd.pypi.simple.v1+json`
    gives the project's files and versions (`project`, `versions`, `files`);
  - a file's core metadata (`core_metadata`): the PEP 658 `<file url>.metadata` when the index
    serves it, else the wheel's own `*.dist-info/METADATA` read with HTTP range requests (only the
    zip's central directory and that one member travel, not the whole wheel);
  - the JSON metadata API `GET {json_url}/<name>/<version>/json` (`release_json`), where the index has one.
  The index URL is configurable for mirrors (`IndexClient("https://mirror.example/simple")`).

OCI registries (`RegistryClient`, used by publish/verify too):
  - `list_tags(repo)`, `resolve(repo, ref)` (HEAD manifest -> Docker-Content-Digest),
    `get_manifest(repo, ref)`, `get_blob(repo, digest)`, `has_blob`, `push_blob(repo, data)`
    (monolithic POST + PUT), `put_manifest(repo, ref, body, media_type)` (OCI artifacts, or a
    verification record under a tag such as `sha256-<hex>.verification`);
  - authentication: credentials from ~/.docker/config.json `auths` (or given explicitly), Basic
    or the Bearer token flow (WWW-Authenticate realm/service/scope); credentials never appear in
    errors, reprs or logs.

Every request has a timeout and is retried with exponential backoff on connect/read errors and on
429/5xx answers (honouring Retry-After, capped). Failures raise `NetworkError` (exit code 9) with
the URL and what went wrong, chained from the httpx error.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import os
import re
import ssl
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urljoin, urlparse


def _lazy_module(name: str):
    """Import `name` on first attribute access: `skupin --help` and `check` never pay for httpx."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


httpx = _lazy_module("httpx")
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from pydantic import SecretStr

from common.errors import NetworkError
from common.model import Frozen
from common.paths import PYPI_SIMPLE

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
DEFAULT_TIMEOUT = 30.0
DEFAULT_RETRIES = 3
MAX_RETRY_AFTER = 30.0
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
Sleep = Callable[[float], None]


# ------------------------------------------------------------------ shared transport


class _Http:
    """An httpx.Client with retries and backoff; raises NetworkError, never returns a 429/5xx."""

    def __init__(self, *, timeout: float, retries: int, ca_bundle: Path | str | None, backoff: float,
                 sleep: Sleep | None, what: str, transport: httpx.BaseTransport | None = None) -> None:
        verify: bool | ssl.SSLContext = ssl.create_default_context(cafile=str(ca_bundle)) if ca_bundle else True
        self.client = httpx.Client(timeout=timeout, verify=verify, follow_redirects=True, transport=transport,
                                   headers={"User-Agent": "skupin (+https://skupin.dev)"})
        self.retries = max(0, retries)
        self.backoff = backoff
        self.sleep = sleep or time.sleep
        self.what = what

    def close(self) -> None:
        self.client.close()

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        delay = self.backoff * (2**attempt)
        if response is not None and (after := response.headers.get("Retry-After", "")).isdigit():
            delay = max(delay, float(after))
        return min(delay, MAX_RETRY_AFTER)

    def request(self, method: str, url: str, *, ok: tuple[int, ...] = (200,), **kwargs) -> httpx.Response:
        """Send with retries; return the response when its status is in `ok`, else raise NetworkError."""
        last: str = ""
        for attempt in range(self.retries + 1):
            try:
                response = self.client.request(method, url, **kwargs)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
                if attempt == self.retries:
                    raise NetworkError(f"{self.what}: {method} {_safe(url)} failed after "
                                       f"{attempt + 1} attempt(s): {last}") from exc
                self.sleep(self._delay(attempt, None))
                continue
            if response.status_code in ok:
                return response
            if response.status_code in RETRY_STATUS and attempt < self.retries:
                last = f"HTTP {response.status_code}"
                self.sleep(self._delay(attempt, response))
                continue
            raise NetworkError(f"{self.what}: {method} {_safe(url)} answered HTTP {response.status_code}"
                               f"{_excerpt(response)}" + (f" after {attempt + 1} attempts" if attempt else ""))
        raise NetworkError(f"{self.what}: {method} {_safe(url)}: {last}")  # pragma: no cover


    def download(self, url: str, folder: Path, *, prefix: str) -> tuple[Path, str, int]:
        """Stream a GET into a new temporary file in `folder`, with the retries of `request` (each
        attempt starts the file again); (that file, its sha256, its size). The caller keeps or
        removes it; on an error nothing is left behind."""
        last = ""
        for attempt in range(self.retries + 1):
            fd, name = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".part")
            tmp, digest, size, status = Path(name), hashlib.sha256(), 0, 0
            try:
                with os.fdopen(fd, "wb") as handle, self.client.stream("GET", url) as response:
                    status = response.status_code
                    if status == 200:
                        for chunk in response.iter_bytes(1 << 20):
                            handle.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                        return tmp, digest.hexdigest(), size
                    last = f"HTTP {status}"
                    if status not in RETRY_STATUS or attempt == self.retries:
                        raise NetworkError(f"{self.what}: GET {_safe(url)} answered {last}")
                    delay = self._delay(attempt, response)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
                delay = self._delay(attempt, None)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            tmp.unlink(missing_ok=True)
            if attempt < self.retries:
                self.sleep(delay)
        raise NetworkError(f"{self.what}: GET {_safe(url)} failed after {self.retries + 1} attempt(s): {last}")


def _safe(url: str) -> str:
    """A URL without user:password@ and without a query string (tokens live there sometimes)."""
    p = urlparse(url)
    host = p.hostname or ""
    netloc = f"{host}:{p.port}" if p.port else host
    return p._replace(netloc=netloc, query="").geturl()


def _excerpt(response: httpx.Response) -> str:
    try:
        text = response.text.strip().replace("\n", " ")
    except Exception:  # noqa: BLE001 - undecodable body
        return ""
    return f": {text[:200]}" if text and not text.startswith("<") else ""


# ------------------------------------------------------------------ package indexes


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
    (or abi3/py3; a py3-none-any wheel for pure-Python projects), preferring non-yanked files without a build tag; None when there is none."""
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
        self.http = _Http(timeout=timeout, retries=retries, ca_bundle=ca_bundle, backoff=backoff, sleep=sleep,
                          what=f"index {_safe(self.base_url)}")
        self._projects: dict[str, Project] = {}
        self._metadata: dict[str, dict[str, tuple[str, ...]]] = {}

    def __enter__(self) -> "IndexClient":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def __repr__(self) -> str:
        return f"IndexClient({_safe(self.base_url)!r})"

    # -- simple API

    def project(self, name: str) -> Project:
        """The project's page (cached per client). NetworkError when the index has no such project."""
        key = canonicalize_name(name)
        if key not in self._projects:
            url = urljoin(self.base_url, f"{key}/")
            response = self.http.request("GET", url, headers={"Accept": f"{SIMPLE_JSON}, application/json;q=0.1"})
            try:
                data = response.json()
                files = tuple(self._file(url, f) for f in data.get("files", ()))
                self._projects[key] = Project(name=data.get("name", key), versions=tuple(data.get("versions", ())),
                                              files=files)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise NetworkError(f"index {_safe(url)}: not a PEP 691 JSON page "
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
            raise NetworkError(f"index {_safe(self.base_url)}: no metadata for {file.filename}")
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
            raise NetworkError(f"index {_safe(self.base_url)}: {name} {version} has no Linux x86_64 wheel")
        return self.core_metadata(file).get("requires-dist", ())

    # -- JSON API

    def release_json(self, name: str, version: Version | str) -> dict:
        """`{json_url}/<name>/<version>/json` (PyPI's JSON API); NetworkError when the index has none."""
        if self.json_url is None:
            raise NetworkError(f"index {_safe(self.base_url)}: no JSON API configured (pass json_url)")
        url = urljoin(self.json_url, f"{canonicalize_name(name)}/{version}/json")
        try:
            return self.http.request("GET", url).json()
        except ValueError as exc:
            raise NetworkError(f"index {_safe(url)}: not JSON: {exc}") from exc


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file that fetches only the byte ranges zipfile asks for."""

    CHUNK = 256 * 1024

    def __init__(self, http: _Http, url: str, *, size: int | None) -> None:
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

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


# ------------------------------------------------------------------ OCI registries


class ImageName(Frozen):
    """An image reference split into registry host, repository, tag and digest."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """The digest when pinned, else the tag (else 'latest')."""
        return self.digest or self.tag or "latest"


def parse_image_ref(ref: str) -> ImageName:
    """`[registry/]repo[:tag][@sha256:..]` -> ImageName; docker.io names get library/ and registry-1.docker.io."""
    rest, _, digest = ref.partition("@")
    first, sep, remainder = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
    else:
        registry, path = "docker.io", rest
    tag = None
    if ":" in path.rsplit("/", 1)[-1]:
        path, tag = path.rsplit(":", 1)
    if registry in ("docker.io", "index.docker.io", "registry-1.docker.io"):
        registry = "registry-1.docker.io"
        if "/" not in path:
            path = f"library/{path}"
    return ImageName(registry=registry, repository=path, tag=tag, digest=digest or None)


def registry_url(host: str) -> str:
    """Base URL of a registry host: http for loopback hosts, https otherwise (a full URL is kept)."""
    if "://" in host:
        return host.rstrip("/")
    name = host.split(":")[0]
    loopback = name in ("localhost", "127.0.0.1", "::1", "[::1]") or name.startswith("127.")
    return f"{'http' if loopback else 'https'}://{host}"


class Credentials(Frozen):
    """A registry login; the secret never shows in repr, str or logs."""

    username: str
    secret: SecretStr


def docker_credentials(host: str, *, config: Path | None = None) -> Credentials | None:
    """The login for `host` from a Docker config.json `auths` (username/password or base64 `auth`)."""
    path = config or Path.home() / ".docker" / "config.json"
    try:
        auths = json.loads(path.read_text(encoding="utf-8")).get("auths", {})
    except (OSError, ValueError, AttributeError):
        return None
    keys = {host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"https://{host}/v2/"}
    if host in ("registry-1.docker.io", "docker.io", "index.docker.io"):
        keys |= {"https://index.docker.io/v1/", "index.docker.io", "docker.io"}
    for key, entry in auths.items():
        if key in keys and isinstance(entry, dict):
            if entry.get("auth"):
                try:
                    user, _, secret = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    continue
                return Credentials(username=user, secret=SecretStr(secret))
            if entry.get("username") and entry.get("password"):
                return Credentials(username=entry["username"], secret=SecretStr(entry["password"]))
    return None


class Manifest(Frozen):
    """A manifest as the registry stored it: exact bytes, media type and digest."""

    media_type: str
    digest: str
    body: bytes

    def json(self) -> dict:  # type: ignore[override]
        return json.loads(self.body)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


class RegistryClient:
    """An OCI distribution (v2) registry: tags, digests, manifests, blobs; push by digest.

    `url` is the registry's base URL or host (`http://127.0.0.1:5000`, `ghcr.io`); repositories
    are passed per call (`"skupin/cpu-x86_64"`). Credentials default to the host's entry in
    ~/.docker/config.json; anonymous access otherwise. Token auth follows the Bearer challenge
    (realm, service, scope) and caches a token per scope.

    >>> reg = RegistryClient("http://127.0.0.1:5000")
    >>> digest = reg.push_blob("skupin/x", b"{}")                       # config blob
    >>> reg.put_manifest("skupin/x", "v1", body, "application/vnd.oci.image.manifest.v1+json")
    'sha256:...'
    >>> reg.resolve("skupin/x", "v1")                                   # HEAD -> Docker-Content-Digest
    """

    def __init__(self, url: str, *, credentials: Credentials | None = None, docker_config: Path | None = None,
                 timeout: float = DEFAULT_TIMEOUT, retries: int = DEFAULT_RETRIES,
                 ca_bundle: Path | str | None = None, backoff: float = 0.5, sleep: Sleep | None = None) -> None:
        self.url = registry_url(url)
        self.host = urlparse(self.url).netloc
        self._credentials = credentials or docker_credentials(self.host, config=docker_config)
        self.http = _Http(timeout=timeout, retries=retries, ca_bundle=ca_bundle, backoff=backoff, sleep=sleep,
                          what=f"registry {self.host}")
        self._tokens: dict[str, str] = {}

    def __repr__(self) -> str:
        who = f", as {self._credentials.username!r}" if self._credentials else ""
        return f"RegistryClient({self.url!r}{who})"

    def __enter__(self) -> "RegistryClient":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- auth

    def _basic(self) -> str | None:
        if self._credentials is None:
            return None
        raw = f"{self._credentials.username}:{self._credentials.secret.get_secret_value()}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    def _token(self, challenge: str, scope: str) -> str:
        params = dict(_CHALLENGE.findall(challenge))
        realm = params.pop("realm", None)
        if not realm:
            raise NetworkError(f"registry {self.host}: Bearer challenge without realm")
        params.setdefault("scope", scope)
        headers = {"Authorization": b} if (b := self._basic()) else {}
        response = self.http.request("GET", realm, params=params, headers=headers)
        try:
            body = response.json()
            return body.get("token") or body["access_token"]
        except (ValueError, KeyError) as exc:
            raise NetworkError(f"registry {self.host}: token endpoint {_safe(realm)} gave no token") from exc

    def _send(self, method: str, path: str, *, scope: str, ok: tuple[int, ...] = (200,), **kwargs) -> httpx.Response:
        """One authenticated request; on a 401 answer, authenticate per the challenge and send again."""
        url = path if "://" in path else f"{self.url}{path}"
        headers = dict(kwargs.pop("headers", {}) or {})
        if scope in self._tokens:
            headers["Authorization"] = self._tokens[scope]
        response = self.http.request(method, url, ok=(*ok, 401), headers=headers, **kwargs)
        if response.status_code != 401 or 401 in ok:
            return response
        challenge = response.headers.get("WWW-Authenticate", "")
        if challenge.lower().startswith("bearer"):
            self._tokens[scope] = "Bearer " + self._token(challenge, scope)
            headers["Authorization"] = self._tokens[scope]
        elif challenge.lower().startswith("basic") and (b := self._basic()):
            self._tokens[scope] = headers["Authorization"] = b
        else:
            raise NetworkError(f"registry {self.host}: {method} {_safe(url)} needs credentials "
                               f"(docker login {self.host})")
        response = self.http.request(method, url, ok=(*ok, 401, 403), headers=headers, **kwargs)
        if response.status_code in (401, 403):
            raise NetworkError(f"registry {self.host}: {method} {_safe(url)} refused (HTTP {response.status_code}); "
                               f"check the login for {self.host}")
        return response

    @staticmethod
    def _scope(repo: str, push: bool = False) -> str:
        return f"repository:{repo}:{'pull,push' if push else 'pull'}"

    # -- reads

    def ping(self) -> None:
        """GET /v2/ (the API version check); NetworkError when the registry does not answer as one."""
        self._send("GET", "/v2/", scope="")

    def list_tags(self, repo: str) -> tuple[str, ...]:
        """Every tag of a repository (follows Link pagination)."""
        tags: list[str] = []
        path: str | None = f"/v2/{repo}/tags/list?n=1000"
        while path:
            response = self._send("GET", path, scope=self._scope(repo))
            tags += response.json().get("tags") or []
            link = response.headers.get("Link", "")
            match = re.match(r"<([^>]+)>", link)
            path = urljoin(self.url + "/", match.group(1)) if match else None
        return tuple(tags)

    def resolve(self, repo: str, ref: str) -> str:
        """Tag (or digest) -> the manifest digest the registry reports (HEAD, Docker-Content-Digest)."""
        response = self._send("HEAD", f"/v2/{repo}/manifests/{ref}", scope=self._scope(repo),
                              headers={"Accept": ", ".join(MANIFEST_TYPES)})
        digest = response.headers.get("Docker-Content-Digest")
        if digest:
            return digest
        return self.get_manifest(repo, ref).digest

    def get_manifest(self, repo: str, ref: str, *, accept: tuple[str, ...] = MANIFEST_TYPES) -> Manifest:
        """The manifest's exact bytes; its digest is checked against Docker-Content-Digest and a digest ref."""
        response = self._send("GET", f"/v2/{repo}/manifests/{ref}", scope=self._scope(repo),
                              headers={"Accept": ", ".join(accept)})
        body = response.content
        digest = sha256_digest(body)
        claimed = response.headers.get("Docker-Content-Digest")
        for want in (claimed, ref if ref.startswith("sha256:") else None):
            if want and want != digest:
                raise NetworkError(f"registry {self.host}: manifest {repo}@{ref} has digest {digest}, expected {want}")
        media = response.headers.get("Content-Type", "").split(";")[0] or json.loads(body).get("mediaType", "")
        return Manifest(media_type=media, digest=digest, body=body)

    def has_blob(self, repo: str, digest: str) -> bool:
        response = self._send("HEAD", f"/v2/{repo}/blobs/{digest}", scope=self._scope(repo), ok=(200, 404))
        return response.status_code == 200

    def get_blob(self, repo: str, digest: str) -> bytes:
        """A blob's bytes, verified against its digest."""
        data = self._send("GET", f"/v2/{repo}/blobs/{digest}", scope=self._scope(repo)).content
        if sha256_digest(data) != digest:
            raise NetworkError(f"registry {self.host}: blob {repo}@{digest} does not match its digest")
        return data

    # -- writes

    def push_blob(self, repo: str, data: bytes) -> str:
        """Upload a blob (monolithic: POST an upload, PUT the bytes with ?digest=); returns its digest.
        A blob already present is not sent again."""
        digest = sha256_digest(data)
        scope = self._scope(repo, push=True)
        if self._send("HEAD", f"/v2/{repo}/blobs/{digest}", scope=scope, ok=(200, 404)).status_code == 200:
            return digest
        start = self._send("POST", f"/v2/{repo}/blobs/uploads/", scope=scope, ok=(202,))
        location = urljoin(self.url + "/", start.headers["Location"])
        sep = "&" if "?" in location else "?"
        self._send("PUT", f"{location}{sep}digest={digest}", scope=scope, ok=(201,), content=data,
                   headers={"Content-Type": "application/octet-stream"})
        return digest

    def put_manifest(self, repo: str, ref: str, body: bytes, media_type: str) -> str:
        """Store a manifest under a tag or digest (e.g. `sha256-<hex>.verification`); returns its digest."""
        digest = sha256_digest(body)
        response = self._send("PUT", f"/v2/{repo}/manifests/{ref}", scope=self._scope(repo, push=True), ok=(201,),
                              content=body, headers={"Content-Type": media_type})
        claimed = response.headers.get("Docker-Content-Digest")
        if claimed and claimed != digest:
            raise NetworkError(f"registry {self.host}: stored manifest digest {claimed}, sent {digest}")
        return digest

    def delete_tag(self, repo: str, tag: str) -> bool:
        """Remove a tag (not its manifest): DELETE /v2/<repo>/manifests/<tag>. True when the registry
        did it; False when it does not support deleting tags (distribution 2.x answers 400/405)."""
        response = self._send("DELETE", f"/v2/{repo}/manifests/{tag}", scope=self._scope(repo, push=True),
                              ok=(200, 202, 400, 404, 405))
        return response.status_code in (200, 202)
