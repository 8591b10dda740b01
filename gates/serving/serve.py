"""The serve check: boot the image's own server in the gate's sandbox and compare its greedy completions with the reference.

Flow (``serve_check``): render the engine's production launch command (``launch_command``:
`transformers serve` for the CPU SKU, `vllm serve`, SGLang's `python -m sglang.launch_server`),
run it in a sandboxed container with **no network** (``server_spec``: `--network none`, no
capabilities, read-only root, limits), and talk to it from the host **inside the container's
network namespace**: the client's worker threads call setns(2) on /proc/PID/ns/net (the
in-process equivalent of `nsenter -t PID -n`), so every socket they open lives in the
container's namespace and reaches its 127.0.0.1. Nothing is published, no bridge or internal
network is created, and the client is this repository's own code, not the image's.

Then, over the OpenAI-compatible API (skupin/clients/openai.py, streaming /v1/completions): wait for readiness with a
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
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field

from skupin.builder.catalog.manifest import ServeGate, SkuManifest
from skupin.clients.openai import Completion, ServeClient, exchange_errors, wait_ready
from skupin.common.errors import DockerError, GateCouldNotRun, SkupinError
from skupin.common.model import Frozen
from skupin.dockerd import BindMount, ContainerSpec, Docker
from skupin.engines import ALL_ENGINES, MODEL_MOUNT, SERVE_PORT, ServerLaunch, serve_launch
from skupin.gates.judge.tolerance import ToleranceEntry
from skupin.gates.judge.verdict import CheckResult, binomial_sf
from skupin.gates.refdata.bundle import model_folder
from skupin.gates.refdata.fixture import load_prompts
from skupin.gates.sandbox import sandbox_spec
from skupin.gates.serving.ab import interleaved_ab
from skupin.gates.serving.perf import PerfSettings, cost_summary, run_perf

OnEvent = Callable[[str], None]


class Decoder(Protocol):
    """What the comparison needs of a tokenizer (tokenizers.Tokenizer): token ids back to text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
NOT_PROVIDED = "not provided by engine"


def _quiet(_: str) -> None:
    return None


# ---------------------------------------------------------------- launch commands


def launch_command(*, manifest: SkuManifest, port: int = SERVE_PORT, model_dir: str = MODEL_MOUNT) -> ServerLaunch:
    """The image's own server command (skupin/engines/<engine>.py: its Dockerfile CMD), or GateCouldNotRun."""
    launch = serve_launch(manifest=manifest, port=port, model_dir=model_dir)
    if launch is None:
        raise GateCouldNotRun(f"{manifest.name}: no serve launch command for engine {manifest.stack.engine.name!r} "
                              f"(known: {', '.join(ALL_ENGINES)})")
    return launch


def server_spec(*, manifest: SkuManifest, image: str, model_dir: Path, launch: ServerLaunch, role: str = "gate-serve",
                cpuset: str | None = None, lifetime_s: float | None = None) -> ContainerSpec:
    """The sandboxed server container (gates.sandbox.sandbox_spec): no network, no capabilities, read-only root and
    model, the SKU's limits; on the CPUs `cpuset` lists when given (the A/B's --server-cpus); killed in the container
    after `lifetime_s` (default the SKU's gate.deadline_s: a gate's serve check is shorter, an A/B's rounds may not be)."""

    return sandbox_spec(
        manifest=manifest, image=image, entrypoint=(launch.argv[0],), command=launch.argv[1:],
        mounts=(BindMount(source=Path(model_dir).resolve(), target=MODEL_MOUNT, read_only=True),),
        labels={"io.skupin.role": role, "io.skupin.sku": manifest.name}, cpuset=cpuset, lifetime_s=lifetime_s,
    )


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


def near_tie_threshold(entry: ToleranceEntry | None) -> tuple[float, str]:
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


def reference_pieces(*, tokenizer: Decoder, ids: Sequence[int], prompt_ids: Sequence[int]) -> list[tuple[str, ...]]:
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
                   tokenizer: Decoder, threshold: float, indices: Sequence[int], eos_id: int | None = None
                   ) -> tuple[PromptServe, ...]:
    """Each completion vs the reference's greedy continuation of the same prompt (see the module docstring)."""
    results = []
    for index, completion in zip(indices, completions, strict=True):
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
def running_server(*, manifest: SkuManifest, image: str, docker: Docker, model_dir: Path, deadline_s: float,
                   workers: int = 4, role: str = "gate-serve", cpuset: str | None = None,
                   lifetime_s: float | None = None) -> Iterator[RunningServer]:
    """Boot the image's server in the sandbox and wait until it is ready; the container is always removed.

    Raises TimeoutError (with the server log tail) when it does not become ready within `deadline_s`.
    """
    launch = launch_command(manifest=manifest)
    spec = server_spec(manifest=manifest, image=image, model_dir=model_dir, launch=launch, role=role, cpuset=cpuset,
                       lifetime_s=lifetime_s)
    with docker.container(spec) as container:
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
    """What a reference prompt is sent as: its token ids, or its text to a server that takes no ids (`transformers serve`)."""
    return prompt["text"] if launch.prompt == "text" else prompt["ids"]


def greedy_completions(*, server: RunningServer, prompts: Sequence[dict], indices: Sequence[int],
                       max_tokens: int) -> list[Completion]:
    """Greedy completions of the chosen prompts, one at a time (the comparison needs no load)."""
    logprobs = 2 if server.launch.returns_logprobs else None
    out = []
    for i in indices:
        out.append(server.client.call(server.client.complete, prompt=prompt_input(server.launch, prompts[i]),
                                      max_tokens=max_tokens, logprobs=logprobs))
    return out


def serve_check(*, manifest: SkuManifest, image: str, docker: Docker, ref: dict[str, np.ndarray],
                entry: ToleranceEntry | None, baseline: str | None = None, model_dir: Path | None = None,
                perf: PerfSettings | None = None, ab_rounds: int = 3, ready_deadline_s: float = 180.0,
                on_event: OnEvent = _quiet) -> CheckResult:
    """Run the serve check of `image` (optionally A/B against `baseline`): a CheckResult named 'serve'.

    `model_dir` is the model folder from gates.refdata.bundle.model_folder (the gate resolves it once);
    without it the SKU's fixture is resolved and checked here.
    """


    started = time.monotonic()
    settings = serve_settings(manifest)
    perf = perf or PerfSettings(concurrency=settings.concurrency)
    try:
        threshold, provenance = near_tie_threshold(entry)
    except GateCouldNotRun as exc:
        return CheckResult(name="serve", status="error", reason=str(exc))
    assert entry is not None  # near_tie_threshold refuses None
    with contextlib.ExitStack() as scope:
        folder = model_dir
        if folder is None:
            scratch = scope.enter_context(tempfile.TemporaryDirectory(prefix="skupin-serve-"))
            folder = model_folder(manifest=manifest, scratch=Path(scratch))
        folder = Path(folder)
        prompt_set = load_prompts(folder / "prompts.json")
        failed_request: tuple[type[Exception], ...] = (DockerError, ValueError, *exchange_errors())
        try:
            return _serve(manifest=manifest, image=image, docker=docker, ref=ref, entry=entry, baseline=baseline,
                          folder=folder, prompt_set=prompt_set, perf=perf, settings=settings, threshold=threshold,
                          provenance=provenance, ab_rounds=ab_rounds, ready_deadline_s=ready_deadline_s,
                          on_event=on_event, started=started)
        except TimeoutError as exc:
            return CheckResult(name="serve", status="fail", reason=f"the engine's server did not serve: {exc}"[:1500],
                               details={"launch": list(launch_command(manifest=manifest).argv)})
        except failed_request as exc:
            return CheckResult(name="serve", status="fail",
                               reason=f"the engine's server failed a request: {type(exc).__name__}: {exc}"[:1500],
                               details={"launch": list(launch_command(manifest=manifest).argv)})
        except SkupinError as exc:  # e.g. GateCouldNotRun: the namespace could not be entered
            return CheckResult(name="serve", status="error", reason=f"the serve check could not run: {exc}"[:1500])


def _serve(*, manifest: SkuManifest, image: str, docker: Docker, ref: dict[str, np.ndarray], entry: ToleranceEntry,
           baseline: str | None, folder: Path, prompt_set: dict[str, Any], perf: PerfSettings, settings: ServeGate,
           threshold: float, provenance: str, ab_rounds: int, ready_deadline_s: float, on_event: OnEvent,
           started: float) -> CheckResult:
    from tokenizers import Tokenizer


    prompts = prompt_set["prompts"]
    indices = list(range(min(len(prompts), int(ref["model.greedy_ids"].shape[0]))))
    new_tokens = int(ref["model.greedy_ids"].shape[1])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    workers = max(perf.concurrency)
    with contextlib.ExitStack() as stack:
        cand = stack.enter_context(running_server(manifest=manifest, image=image, docker=docker, model_dir=folder,
                                                  deadline_s=ready_deadline_s, workers=workers))
        shown = cand.launch.argv[:3] if cand.launch.argv[1:2] == ("-m",) else cand.launch.argv[:2]
        on_event(f"serve: {' '.join(shown)} ready in {cand.ready_s:.1f} s")
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
            base = stack.enter_context(running_server(manifest=manifest, image=baseline, docker=docker,
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
