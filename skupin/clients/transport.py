"""The one HTTP transport every client shares (httpx): timeouts, retries with backoff, clear errors, streamed downloads.

Every request has a timeout and is retried with exponential backoff on connect/read errors and on
429/5xx answers (honouring Retry-After, capped). Failures raise `NetworkError` (exit code 9) with
the URL (without credentials or query) and what went wrong, chained from the httpx error.
httpx is imported lazily: `skupin --help` and `check` never pay for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse


def lazy_module(name: str) -> types.ModuleType:
    """Import `name` on first attribute access: `skupin --help` and `check` never pay for httpx."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


if TYPE_CHECKING:
    import types

    import httpx
else:
    # httpx's own command line (httpx._main: click, rich, pygments; a sixth of a second) is never used here: its import
    # fails, and httpx then defines a `main` that says how to install it (httpx/__init__.py)
    sys.modules.setdefault("httpx._main", None)
    httpx = lazy_module("httpx")

from skupin.common.errors import NetworkError  # noqa: E402 - after the lazy httpx

DEFAULT_TIMEOUT = 30.0
DEFAULT_RETRIES = 3
MAX_RETRY_AFTER = 30.0
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
Sleep = Callable[[float], None]
USER_AGENT = "skupin (+https://skupin.dev)"


def new_client(*, timeout: float, verify: bool | ssl.SSLContext = True, follow_redirects: bool = True,
               base_url: str = "", transport: httpx.BaseTransport | None = None, trust_env: bool = True) -> httpx.Client:
    """Every httpx client skupin makes comes from here: one user agent, one TLS policy, explicit timeouts."""
    return httpx.Client(timeout=timeout, verify=verify, follow_redirects=follow_redirects, base_url=base_url,
                        transport=transport, trust_env=trust_env, headers={"User-Agent": USER_AGENT})


class Transport:
    """An httpx.Client with retries and backoff; raises NetworkError, never returns a 429/5xx."""

    def __init__(self, *, timeout: float, retries: int, ca_bundle: Path | str | None, backoff: float,
                 sleep: Sleep | None, what: str, transport: httpx.BaseTransport | None = None) -> None:
        verify: bool | ssl.SSLContext = ssl.create_default_context(cafile=str(ca_bundle)) if ca_bundle else True
        self.client = new_client(timeout=timeout, verify=verify, transport=transport)
        self.timeout = timeout
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

    def request(self, method: str, url: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any) -> httpx.Response:
        """Send with retries; return the response when its status is in `ok`, else raise NetworkError."""
        last: str = ""
        for attempt in range(self.retries + 1):
            try:
                response = self.client.request(method, url, **kwargs)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
                if attempt == self.retries:
                    raise NetworkError(f"{self.what}: {method} {safe_url(url)} failed after "
                                       f"{attempt + 1} attempt(s): {last}") from exc
                self.sleep(self._delay(attempt, None))
                continue
            if response.status_code in ok:
                return response
            if response.status_code in RETRY_STATUS and attempt < self.retries:
                last = f"HTTP {response.status_code}"
                self.sleep(self._delay(attempt, response))
                continue
            raise NetworkError(f"{self.what}: {method} {safe_url(url)} answered HTTP {response.status_code}"
                               f"{body_excerpt(response)}" + (f" after {attempt + 1} attempts" if attempt else ""))
        raise NetworkError(f"{self.what}: {method} {safe_url(url)}: {last}")  # pragma: no cover


    def download(self, url: str, folder: Path, *, prefix: str, headers: dict[str, str] | None = None,
                 max_bytes: int | None = None) -> tuple[Path, str, int]:
        """Stream a GET into a new temporary file in `folder`, with the retries of `request` (each
        attempt starts the file again); (that file, its sha256, its size). The caller keeps or
        removes it; on an error nothing is left behind. NetworkError when the body exceeds `max_bytes`."""
        last = ""
        for attempt in range(self.retries + 1):
            fd, name = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".part")
            tmp, digest, size, status = Path(name), hashlib.sha256(), 0, 0
            try:
                with os.fdopen(fd, "wb") as handle, self.client.stream("GET", url, headers=headers) as response:
                    status = response.status_code
                    if status == 200:
                        for chunk in response.iter_bytes(1 << 20):
                            handle.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                            if max_bytes is not None and size > max_bytes:
                                raise NetworkError(f"{self.what}: GET {safe_url(url)} sent more than {max_bytes} bytes")
                        return tmp, digest.hexdigest(), size
                    last = f"HTTP {status}"
                    if status not in RETRY_STATUS or attempt == self.retries:
                        raise NetworkError(f"{self.what}: GET {safe_url(url)} answered {last}")
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
        raise NetworkError(f"{self.what}: GET {safe_url(url)} failed after {self.retries + 1} attempt(s): {last}")


def safe_url(url: str) -> str:
    """A URL without user:password@ and without a query string (tokens live there sometimes)."""
    p = urlparse(url)
    host = p.hostname or ""
    netloc = f"{host}:{p.port}" if p.port else host
    return p._replace(netloc=netloc, query="").geturl()


def body_excerpt(response: httpx.Response) -> str:
    try:
        text = response.text.strip().replace("\n", " ")
    except Exception:  # undecodable body
        return ""
    return f": {text[:200]}" if text and not text.startswith("<") else ""


MAX_SERVER_JSON_BYTES = 32 * 1024**2  # PyPI's largest simple pages are a few MB
MAX_SERVER_JSON_DEPTH = 32  # PEP 691 pages, OCI manifests and token answers nest 5 levels at most


def server_json(body: bytes, *, source: str) -> Any:
    """JSON a server answered, read with size and depth limits (an index or registry is not trusted to be sane):
    ValueError naming `source` when it is too large, too deep or not JSON."""
    from skupin.common.untrusted import UntrustedInputError, load_json

    try:
        return load_json(body, source=source, max_bytes=MAX_SERVER_JSON_BYTES, max_depth=MAX_SERVER_JSON_DEPTH)
    except UntrustedInputError as exc:
        raise ValueError(str(exc)) from exc

