"""Loopback HTTP servers for tests: a PEP 691 index over a recorded folder, and a small OCI registry.

Real sockets and real HTTP (http.server in a thread); nothing is mocked on the client side.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:  # keep test output clean
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


def index_handler(root: Path, state: dict) -> type[BaseHTTPRequestHandler]:
    """/simple/<name>/ -> simple/<name>.json; /files/<f> (Range honoured) and /files/<f>.metadata;
    /pypi/<name>/<version>/json -> pypi/<name>/<version>.json. `state['fail']` answers 503 that many times."""

    class Handler(_Quiet):
        def do_HEAD(self) -> None:
            self.do_GET(head=True)

        def do_GET(self, head: bool = False) -> None:
            state["requests"].append(self.path)
            if state.get("fail", 0) > 0:
                state["fail"] -= 1
                return self._send(503, b"busy", {"Retry-After": "0"})
            path = self.path.split("?")[0]
            if m := re.fullmatch(r"/simple/([a-z0-9._-]+)/", path):
                f = root / "simple" / f"{m.group(1)}.json"
                if f.exists():
                    return self._send(200, f.read_bytes(), {"Content-Type": SIMPLE_JSON}, head)
            elif m := re.fullmatch(r"/files/([^/]+)", path):
                f = root / "files" / m.group(1)
                if f.exists():
                    return self._file(f.read_bytes(), head)
            elif m := re.fullmatch(r"/pypi/([^/]+)/([^/]+)/json", path):
                f = root / "pypi" / m.group(1) / f"{m.group(2)}.json"
                if f.exists():
                    return self._send(200, f.read_bytes(), {"Content-Type": "application/json"}, head)
            self._send(404, b"not found", {"Content-Type": "text/plain"}, head)

        def _file(self, data: bytes, head: bool) -> None:
            rng = self.headers.get("Range")
            if rng and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", rng)):
                start, end = int(m.group(1)), int(m.group(2) or len(data) - 1)
                part = data[start:end + 1]
                return self._send(206, part, {"Content-Range": f"bytes {start}-{start + len(part) - 1}/{len(data)}",
                                              "Accept-Ranges": "bytes"}, head)
            self._send(200, data, {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}, head)

    return Handler


def registry_handler(store: dict, auth: tuple[str, str] | None) -> type[BaseHTTPRequestHandler]:
    """A minimal OCI distribution registry in memory; with `auth`, Bearer tokens from /token (Basic login)."""
    token = "t-" + uuid.uuid4().hex

    class Handler(_Quiet):
        def _authorized(self) -> bool:
            if auth is None:
                return True
            if self.headers.get("Authorization") == f"Bearer {token}":
                return True
            host = self.headers.get("Host")
            self._send(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {
                "WWW-Authenticate": f'Bearer realm="http://{host}/token",service="test-registry"'})
            return False

        def _route(self, method: str) -> None:
            store.setdefault("log", []).append((method, self.path))
            path, _, query = self.path.partition("?")
            if path == "/token":
                want = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode() if auth else None
                if self.headers.get("Authorization") != want:
                    return self._send(401, b"bad login")
                return self._send(200, json.dumps({"token": token}).encode(), {"Content-Type": "application/json"})
            if not self._authorized():
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method in ("PUT", "POST") else b""
            if m := re.fullmatch(r"/v2/(.+)/tags/list", path):
                tags = sorted(store.setdefault("tags", {}).get(m.group(1), {}))
                return self._send(200, json.dumps({"name": m.group(1), "tags": tags}).encode(),
                                  {"Content-Type": "application/json"})
            if m := re.fullmatch(r"/v2/(.+)/manifests/([^/]+)", path):
                repo, ref = m.groups()
                tags = store.setdefault("tags", {}).setdefault(repo, {})
                manifests = store.setdefault("manifests", {})
                if method == "PUT":
                    digest = "sha256:" + hashlib.sha256(body).hexdigest()
                    manifests[digest] = (self.headers.get("Content-Type"), body)
                    if not ref.startswith("sha256:"):
                        tags[ref] = digest
                    return self._send(201, b"", {"Docker-Content-Digest": digest, "Location": f"/v2/{repo}/manifests/{digest}"})
                digest = ref if ref.startswith("sha256:") else tags.get(ref)
                if digest not in manifests:
                    return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', head=method == "HEAD")
                media, data = manifests[digest]
                return self._send(200, data, {"Content-Type": media, "Docker-Content-Digest": digest}, method == "HEAD")
            if m := re.fullmatch(r"/v2/(.+)/blobs/uploads/", path):
                uid = uuid.uuid4().hex
                return self._send(202, b"", {"Location": f"/v2/{m.group(1)}/blobs/uploads/{uid}"})
            if m := re.fullmatch(r"/v2/(.+)/blobs/uploads/([0-9a-f]+)", path):
                digest = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("digest")
                if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
                    return self._send(400, b'{"errors":[{"code":"DIGEST_INVALID"}]}')
                store.setdefault("blobs", {})[digest] = body
                return self._send(201, b"", {"Docker-Content-Digest": digest})
            if m := re.fullmatch(r"/v2/(.+)/blobs/(sha256:[0-9a-f]+)", path):
                data = store.setdefault("blobs", {}).get(m.group(2))
                if data is None:
                    return self._send(404, b"", head=method == "HEAD")
                return self._send(200, data, {"Docker-Content-Digest": m.group(2)}, method == "HEAD")
            self._send(404, b"")

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_PUT(self) -> None:
            self._route("PUT")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler


@contextlib.contextmanager
def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def serve_index(root: Path, state: dict | None = None) -> Iterator[str]:
    """Serve `root` as an index; yields the simple API URL (http://127.0.0.1:PORT/simple)."""
    st = state if state is not None else {}
    st.setdefault("requests", [])
    with _serve(index_handler(root, st)) as url:
        yield f"{url}/simple"


def wheels_handler(files: dict[str, list[tuple[Path, str]]], state: dict) -> type[BaseHTTPRequestHandler]:
    """A PEP 503 (HTML) index of local files: /simple/<normalized name>/ links each (path, sha256) of that project."""
    by_name = {Path(path).name: path for entries in files.values() for path, _sha in entries}

    class Handler(_Quiet):
        def do_HEAD(self) -> None:  # uv asks before it reads a wheel's metadata by ranges
            self.do_GET(head=True)

        def do_GET(self, head: bool = False) -> None:
            state["requests"].append(self.path)
            path = self.path.split("?")[0]
            if (m := re.fullmatch(r"/simple/([a-z0-9._-]+)/", path)) and m.group(1) in files:
                links = "".join(f'<a href="/files/{Path(f).name}#sha256={sha}">{Path(f).name}</a>\n'
                                for f, sha in files[m.group(1)])
                return self._send(200, f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(),
                                  {"Content-Type": "text/html"}, head)
            if (m := re.fullmatch(r"/files/([^/]+)", path)) and m.group(1) in by_name:
                data = Path(by_name[m.group(1)]).read_bytes()
                rng = self.headers.get("Range")
                if rng and (r := re.fullmatch(r"bytes=(\d*)-(\d*)", rng)):
                    if r.group(1):
                        start, end = int(r.group(1)), int(r.group(2) or len(data) - 1)
                    else:  # a suffix range: the last N bytes
                        start, end = max(0, len(data) - int(r.group(2))), len(data) - 1
                    part = data[start:end + 1]
                    return self._send(206, part, {"Content-Range": f"bytes {start}-{start + len(part) - 1}/{len(data)}",
                                                  "Accept-Ranges": "bytes"}, head)
                return self._send(200, data, {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}, head)
            self._send(404, b"not found", {"Content-Type": "text/plain"}, head)

    return Handler


@contextlib.contextmanager
def serve_wheels(files: dict[str, list[tuple[Path, str]]], state: dict | None = None) -> Iterator[str]:
    """Serve local wheels as a PEP 503 index (project name -> [(file, sha256)]); yields the simple API URL."""
    st = state if state is not None else {}
    st.setdefault("requests", [])
    with _serve(wheels_handler(files, st)) as url:
        yield f"{url}/simple"


@contextlib.contextmanager
def serve_registry(store: dict | None = None, auth: tuple[str, str] | None = None) -> Iterator[str]:
    """Serve an in-memory OCI registry; yields its base URL."""
    with _serve(registry_handler(store if store is not None else {}, auth)) as url:
        yield url
