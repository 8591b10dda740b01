"""The serve check's OpenAI-compatible client: it talks to a server under test from inside that server's network namespace.

`ServeClient` runs every HTTP call on worker threads that first call setns(2) on the server
container's /proc/PID/ns/net (the in-process equivalent of `nsenter -t PID -n`), so its sockets
live in the container's namespace and reach its 127.0.0.1 although the container has no network:
nothing is published, no bridge is made, and the client is skupin's code, not the image's.

The server is hostile input: every response is read bounded (``bounded_lines``: line length,
total bytes and time per response; JSON depth) and type-checked (``parse_stream``); a malformed
answer raises ``StreamError`` naming it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from skupin.clients.transport import httpx, new_client
from skupin.common.errors import GateCouldNotRun
from skupin.common.untrusted import json_depth, printable

CLONE_NEWNET = 0x40000000
# Bounds on what the server under test may send per response.
MAX_LINE_BYTES = 1024**2
MAX_RESPONSE_BYTES = 64 * 1024**2
MAX_SMALL_RESPONSE_BYTES = 1024**2
MAX_EVENT_DEPTH = 8
# How long one readiness probe of the health path may take (SGLang's /health generates a token: >= 1 s).
HEALTH_TIMEOUT_S = 10.0
_TOKEN_ID = re.compile(r"token_id:([0-9]{1,12})")


def enter_netns(pid: int) -> None:
    """Move the calling thread into the network namespace of process `pid` (setns(2); needs CAP_SYS_ADMIN)."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the network namespace of pid {pid}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Completion:
    """One streamed completion as the client saw it (times in seconds since the request was sent)."""

    text: str
    pieces: tuple[str, ...]
    token_ids: tuple[int, ...] | None
    logprobs: tuple[float, ...] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str | None
    ttft_s: float | None
    total_s: float
    piece_times: tuple[float, ...]

    @property
    def n_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.pieces)


class StreamError(ValueError):
    """The server's answer broke a bound (size, line length, time, depth) or the OpenAI event format."""


def exchange_errors() -> tuple[type[Exception], ...]:
    """What a failed exchange with the server raises: the HTTP library's transport and protocol errors, and
    StreamError (a malformed answer). For callers outside skupin/clients/, which never name the HTTP library."""
    return (httpx.HTTPError, StreamError)


def _token_id(token: Any) -> int | None:
    match = _TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
    return int(match.group(1)) if match else None


def bounded_lines(chunks: Iterable[bytes], *, max_line_bytes: int = MAX_LINE_BYTES,
                  max_total_bytes: int = MAX_RESPONSE_BYTES, deadline_s: float | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Iterator[str]:
    """Text lines of a byte stream, refusing (StreamError) a line, a total or a duration past its bound."""
    buf, total, start = bytearray(), 0, clock()
    for chunk in chunks:
        total += len(chunk)
        if total > max_total_bytes:
            raise StreamError(f"the response passed {max_total_bytes} bytes")
        if deadline_s is not None and clock() - start > deadline_s:
            raise StreamError(f"the response took longer than {deadline_s:.0f} s")
        buf += chunk
        while (end := buf.find(b"\n")) >= 0:
            if end > max_line_bytes:
                break
            line = bytes(buf[:end])
            del buf[: end + 1]
            yield line.rstrip(b"\r").decode("utf-8", "replace")
        if len(buf) > max_line_bytes:
            raise StreamError(f"the response has a line longer than {max_line_bytes} bytes")
    if buf:
        yield bytes(buf).decode("utf-8", "replace")


def _json(text: str, *, what: str, max_depth: int = MAX_EVENT_DEPTH) -> Any:
    """Parse JSON the server sent, with a depth limit (json's recursive decoder must never see a deep document)."""
    raw = text.encode("utf-8", "replace")
    if json_depth(raw) > max_depth:
        raise StreamError(f"{what} is nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise StreamError(f"{what} is not JSON: {printable(text, 120)!r}") from exc


def _number(value: Any) -> float:
    if value is None:
        return float("nan")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StreamError(f"a logprob is not a number: {printable(repr(value), 80)}")
    return float(value)


def _count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StreamError(f"usage.{name} is not a count: {printable(repr(value), 80)}")
    return value


def _choices(event: Any) -> list[dict[str, Any]]:
    """The event's choices, each checked to be an object with a string text (StreamError otherwise)."""
    if not isinstance(event, dict):
        raise StreamError(f"an event is not a JSON object: {printable(repr(event), 80)}")
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise StreamError(f"an event's choices are not a list of objects: {printable(repr(choices), 80)}")
    for choice in choices:
        if not isinstance(choice.get("text"), (str, type(None))):
            raise StreamError(f"a choice's text is not a string: {printable(repr(choice.get('text')), 80)}")
        if not isinstance(choice.get("logprobs"), (dict, type(None))):
            raise StreamError("a choice's logprobs is not an object")
        ids = choice.get("token_ids")
        if ids is not None and not (isinstance(ids, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise StreamError(f"a choice's token_ids are not a list of token ids: {printable(repr(ids), 80)}")
    return choices


def _logprobs(lp: dict[str, Any]) -> tuple[list[float], list[int | None]]:
    values, tokens = lp["token_logprobs"], lp.get("tokens") or []
    if not isinstance(values, list) or not isinstance(tokens, list):
        raise StreamError("logprobs.token_logprobs and logprobs.tokens must be lists")
    return [_number(x) for x in values], [_token_id(t) for t in tokens]


def parse_stream(lines: Iterable[str], *, sent: float, clock: Callable[[], float] = time.perf_counter) -> Completion:
    """A Completion from the server-sent events of a streamed /v1/completions response (StreamError when malformed).

    Token ids come from a choice's `token_ids` (SGLang with `return_token_ids`: the ids of the chunk's new
    tokens), else from logprobs.tokens written as "token_id:N" (vLLM with `return_tokens_as_token_ids`).
    """
    pieces: list[str] = []
    times: list[float] = []
    ids: list[int | None] = []
    listed: list[int] = []
    saw_listed = False
    logprobs: list[float] = []
    usage: dict[str, Any] = {}
    finish = None
    saw_logprobs = False
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = _json(data, what="a server-sent event")
        choices = _choices(event)
        if isinstance(event.get("usage"), dict):
            usage = event["usage"]
        for choice in choices:
            finish = printable(str(choice.get("finish_reason")), 40) if choice.get("finish_reason") else finish
            if choice.get("token_ids") is not None:
                saw_listed = True
                listed += choice["token_ids"]
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and lp.get("token_logprobs") is not None:
                saw_logprobs = True
                values, tokens = _logprobs(lp)
                logprobs += values
                ids += tokens
            if choice.get("text"):
                pieces.append(choice["text"])
                times.append(clock() - sent)
    total = clock() - sent
    known = [i for i in ids if i is not None]
    token_ids = tuple(listed) if saw_listed else tuple(known) if ids and len(known) == len(ids) else None
    return Completion(text="".join(pieces), pieces=tuple(pieces), token_ids=token_ids,
                      logprobs=tuple(logprobs) if saw_logprobs else None,
                      prompt_tokens=_count(usage.get("prompt_tokens"), "prompt_tokens"),
                      completion_tokens=_count(usage.get("completion_tokens"), "completion_tokens"),
                      finish_reason=finish, ttft_s=times[0] if times else None, total_s=total, piece_times=tuple(times))


def _get_small(http: httpx.Client, path: str, *, timeout_s: float) -> tuple[int, str]:
    """(status, body text) of a GET whose body may not pass MAX_SMALL_RESPONSE_BYTES (StreamError otherwise)."""
    with http.stream("GET", path, timeout=timeout_s, headers={"accept-encoding": "identity"}) as response:
        body = "\n".join(bounded_lines(response.iter_raw(), max_line_bytes=MAX_SMALL_RESPONSE_BYTES,
                                       max_total_bytes=MAX_SMALL_RESPONSE_BYTES, deadline_s=timeout_s))
        return response.status_code, body


class ServeClient:
    """An OpenAI-compatible client whose worker threads live in the server container's network namespace.

    `pid=None` keeps the threads in the host's namespace (tests pass an httpx `transport`). Every
    HTTP call runs on a worker thread; the caller's thread never opens a socket.
    """

    def __init__(self, *, base_url: str, model_id: str, pid: int | None = None, workers: int = 4,
                 transport: httpx.BaseTransport | None = None, timeout_s: float = 120.0,
                 request_extra: dict[str, Any] | None = None) -> None:
        self.base_url, self.model_id, self.pid = base_url, model_id, pid
        self._transport, self._timeout = transport, timeout_s
        self._extra = dict(request_extra or {})
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="skupin-serve",
                                        initializer=functools.partial(enter_netns, pid) if pid else None)

    def __enter__(self) -> ServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for client in self._clients:
            client.close()

    def _http(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = new_client(base_url=self.base_url, transport=self._transport, timeout=self._timeout,
                                follow_redirects=False, trust_env=False)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn(http_client, *args, **kwargs) on a worker thread and return its result."""
        try:
            return self._pool.submit(lambda: fn(self._http(), *args, **kwargs)).result()
        except RuntimeError as exc:  # BrokenThreadPool: setns failed in the initializer
            raise GateCouldNotRun(f"cannot enter the server container's network namespace (pid {self.pid}): {exc}; "
                                  "the gate needs root (CAP_SYS_ADMIN) on the host") from exc

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Like `call`, without waiting: a Future."""
        return self._pool.submit(lambda: fn(self._http(), *args, **kwargs))

    def ready(self, *, health_path: str = "/health") -> tuple[bool, str]:
        """(True, '') when /health answers 200 and /v1/models lists the model; else (False, why)."""
        def probe(http: httpx.Client) -> tuple[bool, str]:
            try:
                status, _ = _get_small(http, health_path, timeout_s=HEALTH_TIMEOUT_S)
                if status != 200:
                    return False, f"{health_path} answered {status}"
                models = _json(_get_small(http, "/v1/models", timeout_s=2.0)[1], what="/v1/models")
            except (httpx.HTTPError, ValueError) as exc:
                return False, f"{type(exc).__name__}: {printable(str(exc), 300)}"
            data = models.get("data") if isinstance(models, dict) else None
            names = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
            listed = self.model_id in names
            return listed, "" if listed else f"/v1/models lists {printable(repr(names), 200)}"
        return self.call(probe)

    def complete(self, http: httpx.Client, *, prompt: str | list[int], max_tokens: int,
                 logprobs: int | None = None) -> Completion:
        """One greedy streamed completion (runs on a worker thread: use via `call`/`submit`)."""
        body: dict[str, Any] = {"model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}, **self._extra}
        if logprobs:
            body["logprobs"] = logprobs
        sent = time.perf_counter()
        with http.stream("POST", "/v1/completions", json=body, headers={"accept-encoding": "identity"}) as response:
            if response.status_code != 200:
                head = b""
                for chunk in response.iter_raw():
                    head += chunk
                    if len(head) >= 4096:
                        break
                raise StreamError(f"/v1/completions answered {response.status_code}: "
                                  f"{printable(head.decode('utf-8', 'replace'), 300)}")
            return parse_stream(bounded_lines(response.iter_raw(), deadline_s=self._timeout), sent=sent)


def wait_ready(*, client: ServeClient, deadline_s: float, health_path: str = "/health",
               alive: Callable[[], bool] = lambda: True, poll_s: float = 0.25) -> float:
    """Poll until the server is ready; seconds waited. GateCouldNotRun-free: raises TimeoutError with the last reason."""
    start = time.monotonic()
    why = "no answer yet"
    while time.monotonic() - start < deadline_s:
        ok, why = client.ready(health_path=health_path)
        if ok:
            return time.monotonic() - start
        if not alive():
            raise TimeoutError(f"the server process exited before it was ready ({why})")
        time.sleep(poll_s)
    raise TimeoutError(f"the server was not ready within {deadline_s:.0f} s (last: {why})")
