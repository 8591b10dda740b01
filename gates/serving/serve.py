"""The serve check: boot the image's own inference server in the gate's sandbox and compare its greedy completions with the reference.

Flow (``serve_check``): render the engine's production launch command (``launch_command``:
`transformers serve` for the CPU SKU, `vllm serve`, SGLang's `python -m sglang.launch_server`),
run it in a sandboxed container with **no network** (``server_spec``: `--network none`, no
capabilities, read-only root, limits), and talk to it from the host **inside the container's
network namespace**: the client's worker threads call setns(2) on /proc/PID/ns/net (the
in-process equivalent of `nsenter -t PID -n`), so every socket they open lives in the
container's namespace and reaches its 127.0.0.1. Nothing is published, no bridge or internal
network is created, and the client is this repository's own code, not the image's.

Then, over the OpenAI-compatible API (httpx, streaming /v1/completions): wait for readiness with a
deadline (/health and /v1/models), request greedy continuations (temperature 0, max_tokens = the
reference continuation length) of the reference prompts and compare them token by token with the
reference's `model.greedy_ids` (``compare_greedy``). A divergence at step t is accepted only when
the reference's own top-1 minus top-2 logprob margin at t is below the near-tie threshold
2 x the calibrated per-prompt max |logprob delta| (``near_tie_threshold``); any other divergence fails.
Logprobs returned by the engine are compared with `model.greedy_logprob`; an engine that does not
return them is reported as such.

The server is hostile input like the probe: its container gets the probe's caps and in-container
deadline, and every response is read bounded (``bounded_lines``: line length, total bytes and time
per response; JSON depth) and type-checked (``parse_stream``); a malformed answer ends the check
with a failure naming it (``StreamError``), never an uncaught exception.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import Field

from common.errors import EngineError, GateCouldNotRun, SkupinError
from builder.manifest import ServeGate, SkuManifest
from common.model import Frozen
from engines import MODEL_MOUNT, SERVE_ENGINES, SERVE_PORT, ServerLaunch, serve_launch
from gates.untrusted import json_depth, printable

OnEvent = Callable[[str], None]
CLONE_NEWNET = 0x40000000
NOT_PROVIDED = "not provided by engine"
# Bounds on what the server under test may send per response.
MAX_LINE_BYTES = 1024**2
MAX_RESPONSE_BYTES = 64 * 1024**2
MAX_SMALL_RESPONSE_BYTES = 1024**2
MAX_EVENT_DEPTH = 8
_TOKEN_ID = re.compile(r"token_id:([0-9]{1,12})")


def _quiet(_: str) -> None:
    return None


# ---------------------------------------------------------------- launch commands


def launch_command(*, manifest: SkuManifest, port: int = SERVE_PORT, model_dir: str = MODEL_MOUNT) -> ServerLaunch:
    """The image's own server command (engines/__init__.py: its Dockerfile CMD), or GateCouldNotRun."""
    launch = serve_launch(manifest=manifest, port=port, model_dir=model_dir)
    if launch is None:
        raise GateCouldNotRun(f"{manifest.name}: no serve launch command for engine {manifest.stack.engine.name!r} "
                              f"(known: {', '.join(SERVE_ENGINES)})")
    return launch


def server_spec(*, manifest: SkuManifest, image: str, model_dir: Path, launch: ServerLaunch, role: str = "gate-serve"):
    """The sandboxed server container (gates.gate.sandbox_spec): no network, no capabilities, read-only root and
    model, the SKU's limits."""
    from dockerd.client import BindMount
    from gates.gate import sandbox_spec

    return sandbox_spec(
        manifest=manifest, image=image, entrypoint=(launch.argv[0],), command=launch.argv[1:],
        mounts=(BindMount(source=Path(model_dir).resolve(), target=MODEL_MOUNT, read_only=True),),
        labels={"io.skupin.role": role, "io.skupin.sku": manifest.name},
    )


# ---------------------------------------------------------------- the client (inside the container's netns)


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
    return choices


def _logprobs(lp: dict[str, Any]) -> tuple[list[float], list[int | None]]:
    values, tokens = lp["token_logprobs"], lp.get("tokens") or []
    if not isinstance(values, list) or not isinstance(tokens, list):
        raise StreamError("logprobs.token_logprobs and logprobs.tokens must be lists")
    return [_number(x) for x in values], [_token_id(t) for t in tokens]


def parse_stream(lines: Iterable[str], *, sent: float, clock: Callable[[], float] = time.perf_counter) -> Completion:
    """A Completion from the server-sent events of a streamed /v1/completions response (StreamError when malformed)."""
    pieces: list[str] = []
    times: list[float] = []
    ids: list[int | None] = []
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
    token_ids = tuple(ids) if ids and all(i is not None for i in ids) else None  # type: ignore[arg-type]
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
                                        initializer=enter_netns if pid else None, initargs=(pid,) if pid else ())

    def __enter__(self) -> "ServeClient":
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
            client = httpx.Client(base_url=self.base_url, transport=self._transport, timeout=self._timeout,
                                  trust_env=False)
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

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        """Like `call`, without waiting: a Future."""
        return self._pool.submit(lambda: fn(self._http(), *args, **kwargs))

    def ready(self, *, health_path: str = "/health") -> tuple[bool, str]:
        """(True, '') when /health answers 200 and /v1/models lists the model; else (False, why)."""
        def probe(http: httpx.Client) -> tuple[bool, str]:
            try:
                status, _ = _get_small(http, health_path, timeout_s=2.0)
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
                raise EngineError(f"/v1/completions answered {response.status_code}: "
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


# ---------------------------------------------------------------- comparing greedy continuations


class PromptServe(Frozen):
    """One prompt's greedy continuation compared with the reference."""

    index: int
    status: Literal["match", "near_tie", "diverged"]
    step: int | None = Field(None, description="First step where the tokens differ")
    margin: float | None = Field(None, description="Reference top-1 minus top-2 logprob at that step")
    reference: str | None = Field(None, description="Reference token text at that step")
    candidate: str | None = Field(None, description="Candidate token text at that step ('' = the stream ended)")
    compared_by: Literal["token_ids", "pieces", "text"]
    logprob_max_abs: float | None = Field(None, description="max |cand - ref| logprob over the matching steps")


def near_tie_threshold(entry) -> tuple[float, str]:
    """(threshold, provenance): 2 x the calibrated per-prompt max |logprob delta| of the tolerance entry.

    A divergence flips top-1 and top-2, which needs their logprob difference to change sign; honest
    noise moves each logprob by at most the calibrated `max_abs`, so the margin by at most twice it.
    """
    if entry is None or "max_abs" not in entry.model.per_prompt:
        raise GateCouldNotRun("the serve check needs the calibrated per-prompt max_abs threshold of the model check; "
                              "fix: skupin calibrate SKU")
    value = 2.0 * float(entry.model.per_prompt["max_abs"])
    return value, (f"2 x per_prompt.max_abs {entry.model.per_prompt['max_abs']:.3g} of tolerance {entry.key.label()} "
                   f"(calibrated {entry.provenance.date}, {entry.provenance.runs} honest runs)")


def reference_pieces(*, tokenizer, ids: Sequence[int], prompt_ids: Sequence[int]) -> list[tuple[str, ...]]:
    """Per step, the text(s) a server may stream for token ids[t]: incremental decode of the continuation, and in context."""
    out: list[tuple[str, ...]] = []
    for t in range(len(ids)):
        alone = tokenizer.decode(list(ids[: t + 1]))[len(tokenizer.decode(list(ids[:t]))):]
        full_prev = tokenizer.decode(list(prompt_ids) + list(ids[:t]), skip_special_tokens=True)
        in_ctx = tokenizer.decode(list(prompt_ids) + list(ids[: t + 1]), skip_special_tokens=True)[len(full_prev):]
        out.append(tuple(dict.fromkeys((alone, in_ctx))))
    return out


def _first_divergence(*, completion: Completion, ref_ids: Sequence[int], pieces: list[tuple[str, ...]],
                      eos_id: int | None) -> tuple[int | None, str, str, str]:
    """(step or None, how compared, reference text, candidate text) of the first differing token."""
    n = len(ref_ids)
    if completion.token_ids is not None:
        cand = completion.token_ids
        for t in range(n):
            if t >= len(cand):
                return (None, "token_ids", "", "") if ref_ids[t] == eos_id else (t, "token_ids", pieces[t][0], "")
            if cand[t] != ref_ids[t]:
                return t, "token_ids", pieces[t][0], f"token_id:{cand[t]}"
        return None, "token_ids", "", ""
    if len(completion.pieces) == completion.n_tokens:  # one streamed piece per token
        for t in range(n):
            if t >= len(completion.pieces):
                return (None, "pieces", "", "") if ref_ids[t] == eos_id else (t, "pieces", pieces[t][0], "")
            if completion.pieces[t] not in pieces[t]:
                return t, "pieces", pieces[t][0], completion.pieces[t]
        return None, "pieces", "", ""
    rest = completion.text  # pieces were merged by the server: align on the text
    for t in range(n):
        hit = next((p for p in pieces[t] if p and rest.startswith(p)), None)
        if hit is None:
            if not rest and ref_ids[t] == eos_id:
                return None, "text", "", ""
            return t, "text", pieces[t][0], rest[: max(len(pieces[t][0]), 1)]
        rest = rest[len(hit):]
    return None, "text", "", ""


def compare_greedy(*, completions: Sequence[Completion], ref: dict[str, np.ndarray], prompts: Sequence[dict],
                   tokenizer, threshold: float, indices: Sequence[int], eos_id: int | None = None) -> tuple[PromptServe, ...]:
    """Each completion vs the reference's greedy continuation of the same prompt (see the module docstring)."""
    results = []
    for index, completion in zip(indices, completions):
        ref_ids = [int(x) for x in ref["model.greedy_ids"][index]]
        margins = ref["model.greedy_margin"][index]
        pieces = reference_pieces(tokenizer=tokenizer, ids=ref_ids, prompt_ids=prompts[index]["ids"])
        step, how, want, got = _first_divergence(completion=completion, ref_ids=ref_ids, pieces=pieces, eos_id=eos_id)
        lp_err = None
        if completion.logprobs is not None and "model.greedy_logprob" in ref:
            upto = len(ref_ids) if step is None else step
            ref_lp = ref["model.greedy_logprob"][index][:upto]
            cand_lp = np.asarray(completion.logprobs[:upto], dtype=np.float64)
            k = min(len(cand_lp), len(ref_lp))
            lp_err = float(np.max(np.abs(cand_lp[:k] - ref_lp[:k]))) if k else 0.0
        if step is None:
            results.append(PromptServe(index=index, status="match", compared_by=how, logprob_max_abs=lp_err))
            continue
        margin = float(margins[step])
        results.append(PromptServe(index=index, status="near_tie" if margin < threshold else "diverged", step=step,
                                   margin=margin, reference=want, candidate=got, compared_by=how,
                                   logprob_max_abs=lp_err))
    return tuple(results)


def judge_greedy(*, results: Sequence[PromptServe], threshold: float, logprob_threshold: float | None,
                 honest_rate: float, alpha: float, logprobs_provided: bool) -> tuple[bool, str, dict[str, Any]]:
    """(passed, reason, details) of the greedy comparison: no divergence outside near ties; logprobs like the model check."""
    from gates.verdict import binomial_sf

    diverged = [r for r in results if r.status == "diverged"]
    ties = [r for r in results if r.status == "near_tie"]
    details: dict[str, Any] = {"prompts": len(results), "match": sum(r.status == "match" for r in results),
                               "near_tie": len(ties), "diverged": len(diverged), "near_tie_threshold": threshold}
    problems: list[str] = []
    if diverged:
        first = diverged[0]
        problems.append(f"{len(diverged)}/{len(results)} greedy continuations diverge from the reference where it had "
                        f"no near tie (prompt {first.index} step {first.step}: reference {first.reference!r}, "
                        f"server {first.candidate!r}, reference margin {first.margin:.3g} >= {threshold:.3g})")
    if logprobs_provided and logprob_threshold is not None:
        errs = [r.logprob_max_abs for r in results if r.logprob_max_abs is not None]
        over = sum(e > logprob_threshold for e in errs)
        p_value = binomial_sf(over, len(errs), honest_rate) if errs else 1.0
        details["logprobs"] = {"compared_prompts": len(errs), "threshold": logprob_threshold, "exceedances": over,
                               "p_value": p_value, "alpha": alpha, "max": max(errs) if errs else None}
        if errs and p_value < alpha:
            problems.append(f"generated-token logprobs differ from the reference on {over}/{len(errs)} prompts "
                            f"(max |delta| {max(errs):.3g} > {logprob_threshold:.3g}; binomial p {p_value:.2g} < {alpha:g})")
    else:
        details["logprobs"] = NOT_PROVIDED
    if problems:
        return False, "; ".join(problems), details
    tail = f", {len(ties)} accepted near-tie divergences" if ties else ""
    return True, f"{details['match']}/{len(results)} greedy continuations equal the reference{tail}", details


# ---------------------------------------------------------------- running a server


@dataclass
class RunningServer:
    """A booted server container and its namespace-bound client."""

    launch: ServerLaunch
    client: ServeClient
    container: Any
    ready_s: float


@contextlib.contextmanager
def running_server(*, manifest: SkuManifest, image: str, engine, model_dir: Path, deadline_s: float,
                   workers: int = 4, role: str = "gate-serve") -> Iterator[RunningServer]:
    """Boot the image's server in the sandbox and wait until it is ready; the container is always removed.

    Raises TimeoutError (with the server log tail) when it does not become ready within `deadline_s`.
    """
    launch = launch_command(manifest=manifest)
    spec = server_spec(manifest=manifest, image=image, model_dir=model_dir, launch=launch, role=role)
    with engine.container(spec) as container:
        start = time.monotonic()
        with ServeClient(base_url=f"http://127.0.0.1:{launch.port}", model_id=launch.model_id, pid=container.pid(),
                         workers=workers, request_extra=launch.request_extra) as client:
            try:
                wait_ready(client=client, deadline_s=deadline_s, health_path=launch.health_path,
                           alive=container.running)
            except TimeoutError as exc:
                overflow = f"; {container.overflow}" if container.overflow else ""
                raise TimeoutError(f"{exc}{overflow}; server log: {container.logs(tail=30).strip()[-1500:]}") from exc
            yield RunningServer(launch=launch, client=client, container=container, ready_s=time.monotonic() - start)


# ---------------------------------------------------------------- the check


def serve_settings(manifest: SkuManifest) -> ServeGate:
    return manifest.gate.serve or ServeGate()


def prompt_input(launch: ServerLaunch, prompt: dict) -> str | list[int]:
    """What a reference prompt is sent as: its token ids, except to `transformers serve`, which gets the text."""
    return prompt["text"] if launch.engine == "transformers" else prompt["ids"]


def greedy_completions(*, server: RunningServer, prompts: Sequence[dict], indices: Sequence[int],
                       max_tokens: int) -> list[Completion]:
    """Greedy completions of the chosen prompts, one at a time (the comparison needs no load)."""
    logprobs = 2 if server.launch.returns_logprobs else None
    out = []
    for i in indices:
        out.append(server.client.call(server.client.complete, prompt=prompt_input(server.launch, prompts[i]),
                                      max_tokens=max_tokens, logprobs=logprobs))
    return out


def serve_check(*, manifest: SkuManifest, image: str, engine, ref: dict[str, np.ndarray], entry,
                baseline: str | None = None, model_dir: Path | None = None, perf=None, ab_rounds: int = 3,
                ready_deadline_s: float = 180.0, on_event: OnEvent = _quiet):
    """Run the serve check of `image` (optionally A/B against `baseline`): a CheckResult named 'serve'.

    `model_dir` is a fixture folder already checked by gates.bundle.fixture_folder (the gate resolves it once);
    without it the SKU's fixture is resolved and checked here.
    """
    import tempfile

    from gates.bundle import fixture_folder
    from gates.fixture import load_prompts
    from gates.serving.perf import PerfSettings
    from gates.verdict import CheckResult

    started = time.monotonic()
    settings = serve_settings(manifest)
    perf = perf or PerfSettings(concurrency=settings.concurrency)
    try:
        threshold, provenance = near_tie_threshold(entry)
    except GateCouldNotRun as exc:
        return CheckResult(name="serve", status="error", reason=str(exc))
    with contextlib.ExitStack() as scope:
        folder = model_dir
        if folder is None:
            scratch = scope.enter_context(tempfile.TemporaryDirectory(prefix="skupin-serve-"))
            folder = fixture_folder(name=manifest.gate.model, model_dir=None, scratch=Path(scratch))
        folder = Path(folder)
        prompt_set = load_prompts(folder / "prompts.json")
        try:
            return _serve(manifest=manifest, image=image, engine=engine, ref=ref, entry=entry, baseline=baseline,
                          folder=folder, prompt_set=prompt_set, perf=perf, settings=settings, threshold=threshold,
                          provenance=provenance, ab_rounds=ab_rounds, ready_deadline_s=ready_deadline_s,
                          on_event=on_event, started=started)
        except TimeoutError as exc:
            return CheckResult(name="serve", status="fail", reason=f"the engine's server did not serve: {exc}"[:1500],
                               details={"launch": list(launch_command(manifest=manifest).argv)})
        except (EngineError, httpx.HTTPError, ValueError) as exc:
            return CheckResult(name="serve", status="fail",
                               reason=f"the engine's server failed a request: {type(exc).__name__}: {exc}"[:1500],
                               details={"launch": list(launch_command(manifest=manifest).argv)})
        except SkupinError as exc:  # e.g. GateCouldNotRun: the namespace could not be entered
            return CheckResult(name="serve", status="error", reason=f"the serve check could not run: {exc}"[:1500])


def _serve(*, manifest, image, engine, ref, entry, baseline, folder, prompt_set, perf, settings, threshold, provenance,
           ab_rounds, ready_deadline_s, on_event, started):
    from tokenizers import Tokenizer

    from gates.serving.ab import interleaved_ab
    from gates.serving.perf import cost_summary, run_perf
    from gates.verdict import CheckResult

    prompts = prompt_set["prompts"]
    indices = list(range(min(len(prompts), int(ref["model.greedy_ids"].shape[0]))))
    new_tokens = int(ref["model.greedy_ids"].shape[1])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    workers = max(perf.concurrency)
    with contextlib.ExitStack() as stack:
        cand = stack.enter_context(running_server(manifest=manifest, image=image, engine=engine, model_dir=folder,
                                                  deadline_s=ready_deadline_s, workers=workers))
        on_event(f"serve: {' '.join(cand.launch.argv[:2])} ready in {cand.ready_s:.1f} s")
        t0 = time.monotonic()
        completions = greedy_completions(server=cand, prompts=prompts, indices=indices, max_tokens=new_tokens)
        greedy_s = time.monotonic() - t0
        results = compare_greedy(completions=completions, ref=ref, prompts=prompts, tokenizer=tokenizer,
                                 threshold=threshold, indices=indices, eos_id=prompt_set.get("eos_id"))
        provided = all(c.logprobs is not None for c in completions)
        ok, reason, greedy = judge_greedy(results=results, threshold=threshold,
                                          logprob_threshold=float(entry.model.per_prompt["max_abs"]),
                                          honest_rate=entry.model.honest_rate, alpha=entry.model.alpha,
                                          logprobs_provided=provided)
        greedy.update(near_tie_threshold_source=provenance, seconds=round(greedy_s, 3), compared_by=sorted(
            {r.compared_by for r in results}), requested_logprobs=cand.launch.returns_logprobs)
        on_event(f"serve: greedy: {reason}")
        perf_prompts = [prompt_input(cand.launch, prompts[i]) for i in indices[: perf.prompts]]
        details: dict[str, Any] = {"engine": cand.launch.engine, "launch": list(cand.launch.argv),
                                   "ready_s": round(cand.ready_s, 3), "greedy": greedy,
                                   "logprobs": greedy["logprobs"] if provided else NOT_PROVIDED,
                                   "prompts": [r.model_dump() for r in results if r.status != "match"]}
        if not ok:
            details["seconds"] = round(time.monotonic() - started, 3)
            return CheckResult(name="serve", status="fail", reason=reason, details=details)
        ab = None
        if baseline:
            base = stack.enter_context(running_server(manifest=manifest, image=baseline, engine=engine,
                                                      model_dir=folder, deadline_s=ready_deadline_s, workers=workers,
                                                      role="gate-serve-baseline"))
            on_event(f"serve: baseline {baseline} ready in {base.ready_s:.1f} s; interleaved A/B, {ab_rounds} rounds")
            ab = interleaved_ab(candidate=lambda s: run_perf(client=cand.client, prompts=perf_prompts, settings=s),
                                baseline=lambda s: run_perf(client=base.client, prompts=perf_prompts, settings=s),
                                settings=perf, rounds=ab_rounds, bound=settings.max_decode_regression,
                                candidate_image=image, baseline_image=baseline)
            measured = ab.candidate
        else:
            measured = run_perf(client=cand.client, prompts=perf_prompts, settings=perf)
    cost = cost_summary(perf=measured, hourly_usd=manifest.cost.hourly_usd if manifest.cost else None,
                        utilisation=manifest.cost.utilisation if manifest.cost else None)
    details["perf"] = measured.model_dump(mode="json")
    details["cost"] = cost.model_dump(mode="json") if cost else None
    if ab is not None:
        details["ab"] = ab.model_dump(mode="json")
    details["seconds"] = round(time.monotonic() - started, 3)
    head = measured.headline()
    summary = (f"{reason}; decode {head.decode_tok_s_per_request:.0f} tok/s per request, "
               f"{head.aggregate_tok_s:.0f} tok/s aggregate at concurrency {head.concurrency}, "
               f"TTFT p50 {1000 * head.ttft_p50_s:.1f} ms")
    if cost:
        summary += f", ${cost.usd_per_1m_output_tokens:.3g}/1M output tokens"
    if ab is not None:
        summary += f"; A/B vs baseline: {ab.summary}"
        if ab.status == "fail":
            return CheckResult(name="serve", status="fail", reason=f"runtime regression: {ab.summary}", details=details)
    on_event(f"serve: {summary}")
    return CheckResult(name="serve", status="pass", reason=summary, details=details)


__all__ = ["ServerLaunch", "launch_command", "server_spec", "enter_netns", "ServeClient", "Completion", "parse_stream",
           "StreamError", "bounded_lines",
           "wait_ready", "PromptServe", "near_tie_threshold", "reference_pieces", "compare_greedy", "judge_greedy",
           "running_server", "prompt_input", "greedy_completions", "serve_check", "serve_settings", "NOT_PROVIDED"]
