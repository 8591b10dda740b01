"""An OCI distribution registry over the shared transport (used by publish, verify and watch).

  - `list_tags(repo)`, `resolve(repo, ref)` (HEAD manifest -> Docker-Content-Digest),
    `get_manifest(repo, ref)`, `get_blob(repo, digest)`, `has_blob`, `push_blob(repo, data)`
    (monolithic POST + PUT), `put_manifest(repo, ref, body, media_type)` (OCI artifacts, or a
    signed attestation under a tag such as `sha256-<hex>.att`);
  - authentication: credentials from the Docker config as Docker finds them (its credential helpers,
    `credHelpers` and `credsStore`, then `auths`: skupin/clients/dockerauth.py), read when a registry
    first asks for them, or given explicitly; Basic or the Bearer token flow (WWW-Authenticate
    realm/service/scope); credentials never appear in errors, reprs or logs.
"""

from __future__ import annotations

import base64
import hashlib
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlparse

from skupin.clients.dockerauth import Credentials, docker_credentials
from skupin.clients.transport import DEFAULT_RETRIES, DEFAULT_TIMEOUT, Sleep, Transport, httpx, safe_url, server_json
from skupin.common.errors import ImageRefError, NetworkError, NotFoundError
from skupin.common.model import Frozen

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


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


# the distribution spec's grammar (distribution/reference): a repository path, a tag, a digest; a registry host[:port]
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?")
_PATH = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}")
MAX_REF = 1024


def parse_image_ref(ref: str) -> ImageName:
    """`[registry/]repo[:tag][@sha256:..]` -> ImageName; docker.io names get library/ and registry-1.docker.io.
    ImageRefError (bad input, exit 2) when `ref` is not a reference by the distribution spec's grammar."""
    _check_ref(ref)
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


def _check_ref(ref: str) -> None:
    """ImageRefError naming the part of `ref` that is not an image reference."""
    def bad(why: str) -> ImageRefError:
        return ImageRefError(f"{ref[:200]!r} is not an image reference: {why}", field="image reference",
                             fix="write host[:port]/repository:tag or host[:port]/repository@sha256:<64 hex digits>, "
                                 "e.g. 127.0.0.1:5000/cpu-x86_64:verified")

    if not ref or len(ref) > MAX_REF or not ref.isprintable() or any(c.isspace() for c in ref):
        raise bad("empty, too long, or it holds spaces or control characters")
    rest, at, digest = ref.partition("@")
    if at and not _DIGEST.fullmatch(digest):
        raise bad(f"the digest {digest[:80]!r} is not sha256:<64 lowercase hex digits>")
    first, sep, remainder = rest.partition("/")
    has_host = bool(sep) and ("." in first or ":" in first or first == "localhost")
    path = remainder if has_host else rest
    if has_host and not _HOST.fullmatch(first):
        raise bad(f"the registry {first[:80]!r} is not host[:port]")
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise bad(f"the tag {tag[:80]!r} is not a tag (letters, digits, _ . -; at most 128; not starting with . or -)")
    if not _PATH.fullmatch(path):
        raise bad(f"the repository {path[:80]!r} is not lowercase path parts (a-z 0-9, separated by . _ __ - or /)")


def registry_url(host: str) -> str:
    """Base URL of a registry host: http for loopback hosts, https otherwise (a full URL is kept)."""
    if "://" in host:
        return host.rstrip("/")
    name = host.split(":")[0]
    loopback = name in ("localhost", "127.0.0.1", "::1", "[::1]") or name.startswith("127.")
    return f"{'http' if loopback else 'https'}://{host}"


class Manifest(Frozen):
    """A manifest as the registry stored it: exact bytes, media type and digest."""

    media_type: str
    digest: str
    body: bytes

    def json(self) -> dict:  # type: ignore[override]
        return server_json(self.body, source=f"manifest {self.digest}")


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
_FILE_CHUNK = 1 << 20
BLOB_ATTEMPTS = 3
BLOB_READ_S = 600.0


class _FileBody:
    """A request body read from a file in chunks; iterable again for every retry."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as handle:
            while chunk := handle.read(_FILE_CHUNK):
                yield chunk


class RegistryClient:
    """An OCI distribution (v2) registry: tags, digests, manifests, blobs; push by digest.

    `url` is the registry's base URL or host (`http://127.0.0.1:5000`, `ghcr.io`); repositories
    are passed per call (`"skupin/cpu-x86_64"`). Credentials default to the host's login in the
    Docker config (a credential helper, or `auths`), read only when the registry asks for one;
    anonymous access otherwise. Token auth follows the Bearer challenge
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
        self._credentials = credentials
        self._docker_config = docker_config
        self._looked_up = credentials is not None  # the Docker config is read (its helper run) on the first challenge
        self.http = Transport(timeout=timeout, retries=retries, ca_bundle=ca_bundle, backoff=backoff, sleep=sleep,
                          what=f"registry {self.host}")
        self._tokens: dict[str, str] = {}

    def __repr__(self) -> str:
        who = f", as {self._credentials.username!r}" if self._credentials else ""
        return f"RegistryClient({self.url!r}{who})"

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- auth

    def _login(self) -> Credentials | None:
        if not self._looked_up:
            self._credentials = docker_credentials(self.host, config=self._docker_config)
            self._looked_up = True
        return self._credentials

    def _basic(self) -> str | None:
        login = self._login()
        if login is None:
            return None
        raw = f"{login.username}:{login.secret.get_secret_value()}".encode()
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
            body = server_json(response.content, source=safe_url(realm))
            return body.get("token") or body["access_token"]
        except (ValueError, KeyError, AttributeError) as exc:
            raise NetworkError(f"registry {self.host}: token endpoint {safe_url(realm)} gave no token") from exc

    def _send(self, method: str, path: str, *, scope: str, ok: tuple[int, ...] = (200,), **kwargs: Any) -> httpx.Response:
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
            raise NetworkError(f"registry {self.host}: {method} {safe_url(url)} needs credentials "
                               f"(docker login {self.host})")
        response = self.http.request(method, url, ok=(*ok, 401, 403), headers=headers, **kwargs)
        if response.status_code in (401, 403):
            raise NetworkError(f"registry {self.host}: {method} {safe_url(url)} refused (HTTP {response.status_code}); "
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
            try:
                tags += server_json(response.content, source=f"registry {self.host} tags of {repo}").get("tags") or []
            except (ValueError, AttributeError, TypeError) as exc:
                raise NetworkError(f"registry {self.host}: the tag list of {repo} is not a JSON object: {exc}") from exc
            link = response.headers.get("Link", "")
            match = re.match(r"<([^>]+)>", link)
            path = urljoin(self.url + "/", match.group(1)) if match else None
        return tuple(tags)

    def resolve(self, repo: str, ref: str) -> str:
        """Tag (or digest) -> the manifest digest the registry reports (HEAD, Docker-Content-Digest)."""
        response = self._send("HEAD", f"/v2/{repo}/manifests/{ref}", scope=self._scope(repo),
                              headers={"Accept": ", ".join(MANIFEST_TYPES)}, ok=(200, 404))
        if response.status_code == 404:
            raise self._absent(repo, ref)
        digest = response.headers.get("Docker-Content-Digest")
        if digest:
            return digest
        return self.get_manifest(repo, ref).digest

    def get_manifest(self, repo: str, ref: str, *, accept: tuple[str, ...] = MANIFEST_TYPES) -> Manifest:
        """The manifest's exact bytes; its digest is checked against Docker-Content-Digest and a digest ref."""
        found = self.find_manifest(repo, ref, accept=accept)
        if found is None:
            raise self._absent(repo, ref)
        return found

    def _absent(self, repo: str, ref: str) -> NotFoundError:
        """The registry answered 404 for a manifest: it was reached, and has no such tag, digest or repository."""
        sep = "@" if ref.startswith("sha256:") else ":"
        return NotFoundError(f"registry {self.host}: no manifest {repo}{sep}{ref} (HTTP 404: the registry answers, "
                             "and holds no such tag, digest or repository)",
                             fix=f"check the name and tag (skupin inspect, or GET /v2/{repo}/tags/list), or publish it")

    def find_manifest(self, repo: str, ref: str, *, accept: tuple[str, ...] = MANIFEST_TYPES,
                      push: bool = False) -> Manifest | None:
        """`get_manifest`, or None when the registry answers 404 (no such tag or digest); NetworkError otherwise.
        `push`: ask with the push scope too, as a publisher (some registries answer 401/403, not 404, for a repository
        that does not exist yet when the token may only pull)."""
        response = self._send("GET", f"/v2/{repo}/manifests/{ref}", scope=self._scope(repo, push=push),
                              headers={"Accept": ", ".join(accept)}, ok=(200, 404))
        if response.status_code == 404:
            return None
        body = response.content
        digest = sha256_digest(body)
        claimed = response.headers.get("Docker-Content-Digest")
        for want in (claimed, ref if ref.startswith("sha256:") else None):
            if want and want != digest:
                raise NetworkError(f"registry {self.host}: manifest {repo}@{ref} has digest {digest}, expected {want}")
        media = response.headers.get("Content-Type", "").split(";")[0]
        if not media:
            try:
                media = str(server_json(body, source=f"manifest {repo}@{ref}").get("mediaType", ""))
            except (ValueError, AttributeError) as exc:
                raise NetworkError(f"registry {self.host}: manifest {repo}@{ref} is not a JSON object: {exc}") from exc
        return Manifest(media_type=media, digest=digest, body=body)

    def has_blob(self, repo: str, digest: str) -> bool:
        response = self._send("HEAD", f"/v2/{repo}/blobs/{digest}", scope=self._scope(repo), ok=(200, 404))
        return response.status_code == 200

    def get_blob(self, repo: str, digest: str, *, max_bytes: int | None = None) -> bytes:
        """A blob's bytes, verified against its digest; with `max_bytes` (the size its manifest declares) streamed and
        bounded, never more than that in memory (NetworkError past it)."""
        if max_bytes is not None:
            with tempfile.TemporaryDirectory(prefix="skupin-blob-") as tmp:
                return self.open_blob(repo, digest, Path(tmp), max_bytes=max_bytes).read_bytes()
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

    def push_blob_file(self, repo: str, path: Path, *, digest: str, size: int) -> bool:
        """Upload a blob from a file (streamed) unless the registry has it already; True when it was sent. The
        registry checks the bytes against `digest` (`?digest=`). An upload session serves one PUT: a failed one is
        started again from a new session (BLOB_ATTEMPTS in all), each reading the file again; the answer to a PUT of
        gigabytes may take minutes (the registry hashes and moves the blob), so it is awaited for BLOB_READ_S."""
        scope = self._scope(repo, push=True)
        if self._send("HEAD", f"/v2/{repo}/blobs/{digest}", scope=scope, ok=(200, 404)).status_code == 200:
            return False
        for attempt in range(BLOB_ATTEMPTS):
            start = self._send("POST", f"/v2/{repo}/blobs/uploads/", scope=scope, ok=(202,))
            location = urljoin(self.url + "/", start.headers["Location"])
            sep = "&" if "?" in location else "?"
            try:
                self._send("PUT", f"{location}{sep}digest={digest}", scope=scope, ok=(201,), content=_FileBody(path),
                           headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                           timeout=httpx.Timeout(self.http.timeout, read=BLOB_READ_S, write=BLOB_READ_S))
                return True
            except NetworkError:
                if attempt == BLOB_ATTEMPTS - 1:
                    raise
        return True  # pragma: no cover

    def open_blob(self, repo: str, digest: str, folder: Path, *, max_bytes: int) -> Path:
        """A blob streamed into a new file in `folder`, checked against its digest (the caller removes the file);
        NetworkError (and no file) when its bytes are not `digest`'s or exceed `max_bytes` (the size its manifest
        declares)."""
        self._send("HEAD", f"/v2/{repo}/blobs/{digest}", scope=self._scope(repo), ok=(200,))  # authenticates the scope
        headers = {"Authorization": token} if (token := self._tokens.get(self._scope(repo))) else None
        path, sha256, _ = self.http.download(f"{self.url}/v2/{repo}/blobs/{digest}", folder, prefix="blob-",
                                             headers=headers, max_bytes=max_bytes)
        if "sha256:" + sha256 != digest:
            path.unlink(missing_ok=True)
            raise NetworkError(f"registry {self.host}: blob {repo}@{digest} does not match its digest")
        return path

    def put_manifest(self, repo: str, ref: str, body: bytes, media_type: str) -> str:
        """Store a manifest under a tag or digest (e.g. `sha256-<hex>.att`); returns its digest."""
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
