"""`skupin ab BASELINE CANDIDATE`: swap the runtime on the same weights, gate both, measure them in interleaved rounds.

The flow (``runtime_ab``), for two SKUs that share hardware class, model fixture, dtype and
reference bundle ("same weights"; refused otherwise, naming what differs):

1. Gate both images against the NVIDIA reference (gates/gate.py: every check, serve included). A
   candidate that does not pass is rejected whatever its speed; it is still measured when it booted
   and served (its model or serve check failed), so the annex shows how fast the wrong answer was.
   An image that failed before booting (pins, boot) is not started again.
2. Boot both engines' servers side by side in the gate's sandbox, the same fixture folder mounted
   in each, and warm both up.
3. For each of `runs` rounds, in the order B A, A B, B A, ... (so a drift of the host hits both
   alike): each image serves every prompt length at every concurrency level (gates/serving/perf.py).
4. KPIs kept apart (gates/serving/ab.py): decode tok/s per request, prefill tok/s, TTFT p50 and
   p99, aggregate tok/s, $/1M output tokens from each SKU's own cost block; per-round ratios, a
   noise floor from each image's own round-to-round movement, and the decision line.

The annex (skupin/ab/annex.py) is written next to the JSON. Both servers are the images'
own CMD launches; every number records which container (and so which image id) produced it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from skupin.ab.cpus import CpuPlan, client_pinned, cpus_of
from skupin.ab.decision import (
    DECISION_RULE,
    KPI,
    MAX_ROUNDS_S,
    ABRound,
    ABSettings,
    ABSide,
    CapacitySide,
    CpuCost,
    LengthAB,
    Role,
    RoundsStop,
    RuntimeAB,
    capacity,
    capacity_side,
    decide,
    kpi,
    min_host_tokens,
    noise_floor,
    ratio_interval,
    round_ratios,
    rounds_note,
    rounds_stop,
    slice_decisions,
)
from skupin.builder.catalog.manifest import SkuManifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.clients.openai import exchange_errors
from skupin.common import __version__
from skupin.common.errors import BundleError, DockerError, ManifestError
from skupin.dockerd import Docker
from skupin.gates.gate import gate_image, resolve_image
from skupin.gates.judge.verdict import GateVerdict
from skupin.gates.refdata.bundle import fixture_folder, model_folder
from skupin.gates.refdata.fixture import spec_for, weight_shapes
from skupin.gates.serving.ab import ab_from_runs, safe_ratio
from skupin.gates.serving.perf import (
    LevelResult,
    PerfResult,
    PerfSettings,
    cost_summary,
    measure_level,
    merge_perf,
    percentile,
    run_perf,
    tokenizer_counter,
)
from skupin.gates.serving.serve import RunningServer, load_prompts, running_server

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from skupin.engines import ServerLaunch

OnEvent = Callable[[str], None]
# Checks that run after the image booted in the gate's sandbox (its numbers judged, not its start): a failure there
# still allows measuring it, so a buyer sees the speed of what was rejected.
BOOTED_FAILURES = ("kernels", "ops", "model", "float32", "serve")
ISOLATION = ("while one side is measured, the other side's container is paused (cgroup freezer): it gets no CPU, "
             "whatever it runs when idle")


def _isolation(settings: ABSettings) -> str:
    return ISOLATION + (f"; {settings.cpu_plan.describe()}" if settings.cpu_plan else
                        "; both servers under the gate's CPU quota, every CPU shared with the measuring client")


# How long an A/B's servers may serve rounds after their boot deadline: their in-container deadline is the SKU's
# gate.deadline_s (which bounds a gate's serve check) plus this, so long --target-ci A/Bs are not cut off (a 619 s A/B
# lost its baseline to the 600 s deadline) while a server whose host process died still ends. No round starts after
# MAX_ROUNDS_S of rounds; the hour past it covers the other side's boot, the warm-ups and the last round.
SERVER_EXTRA_LIFETIME_S = MAX_ROUNDS_S + 3600

# The noise floor when the rounds cannot show one (a single round, or nothing measured).
DEFAULT_FLOOR = 0.10


def _quiet(_: str) -> None:
    return None


class NotTheSameWeights(ManifestError):
    """The two SKUs of an A/B do not run the same weights (hardware class, model, dtype or reference differ)."""


@dataclass(frozen=True)
class ABInput:
    """One side of an A/B: the SKU's resolved stack, the local image to run, and optionally its gate verdict already
    made (used only when it is for this very image id and lock)."""

    stack: ResolvedStack
    image: str
    verdict: GateVerdict | None = None


# ---------------------------------------------------------------- same weights


def same_weights(baseline: SkuManifest, candidate: SkuManifest) -> dict[str, str]:
    """What both SKUs share (hardware class, model fixture, dtype, reference bundle); NotTheSameWeights naming every
    field that differs. A quantized variant of the same fixture is the same weights on paper: the gate judges it."""
    fields = {
        "accelerator.hardware_class": (baseline.accelerator.hardware_class, candidate.accelerator.hardware_class),
        "gate.model": (baseline.gate.model, candidate.gate.model),
        "gate.dtype": (baseline.gate.dtype, candidate.gate.dtype),
        "gate.reference": (baseline.gate.reference, candidate.gate.reference),
    }
    differ = [f"{name}: {b!r} (baseline {baseline.name}) vs {c!r} (candidate {candidate.name})"
              for name, (b, c) in fields.items() if b != c]
    if differ:
        raise NotTheSameWeights(
            f"{baseline.name} and {candidate.name} do not run the same weights on the same hardware, so an A/B "
            f"would compare more than the runtime: {'; '.join(differ)}")
    return {name.split(".")[-1]: str(b) for name, (b, _) in fields.items()}


def weights_label(manifest: SkuManifest) -> str:
    """The weights a SKU runs, as the annex names them: model, dtype, and a quantized file type when it sets one."""
    quant = getattr(manifest.gate, "weights", "full")
    return f"{manifest.gate.model} {manifest.gate.dtype}" + ("" if quant in (None, "full") else f" ({quant})")


# ---------------------------------------------------------------- prompts of a given length


def prompt_ids_of_length(prompts: Sequence[dict], length: int, count: int) -> list[list[int]]:
    """`count` token-id prompts of exactly `length` tokens made from the fixture's prompts: a prompt cut to length,
    or consecutive prompts joined (each after the first without its leading <s>) until long enough."""
    if length < 2:
        raise ManifestError(f"--prompt-lengths: {length} is too short (at least 2 tokens)")
    out = []
    n = len(prompts)
    for k in range(count):
        ids: list[int] = []
        j = k
        while len(ids) < length:
            more = [int(t) for t in prompts[j % n]["ids"]]
            ids += more if not ids else more[1:]
            j += 1
            if j - k > 4 * n + length:  # pragma: no cover - fixture prompts are never empty
                raise ManifestError("the fixture's prompts are too short to build the asked prompt lengths")
        out.append(ids[:length])
    return out


def check_lengths(settings: ABSettings, *, model: str) -> None:
    """ManifestError when a prompt length plus the output tokens does not fit the fixture's positions."""
    short = [n for n in settings.prompt_lengths if n < 2]
    if short:
        raise ManifestError(f"--prompt-lengths {','.join(map(str, short))}: a prompt needs at least 2 tokens")
    limit = spec_for(model).max_positions
    too_long = [n for n in settings.prompt_lengths if n + settings.max_tokens > limit]
    if too_long:
        raise ManifestError(f"--prompt-lengths {','.join(map(str, too_long))}: with --max-tokens {settings.max_tokens} "
                            f"longer than the {model} fixture's {limit} positions")


def prompt_inputs(*, prompts: Sequence[dict], tokenizer: Tokenizer, length: int, count: int,
                  launch: ServerLaunch) -> list[str | list[int]]:
    """What each request sends at this length, the same tokens for every engine: the prompt's text to a server that
    takes text, else the fixture tokenizer's ids of that very text after <s> (a joined prompt's ids, decoded and
    encoded again, can differ at the join: an engine given the original ids would see another prompt)."""
    bos = tokenizer.token_to_id("<s>")
    assert bos is not None  # the fixture tokenizer's <s> is id 1 (gates/refdata/fixture.py: SPECIALS)
    texts = [tokenizer.decode([t for t in p if t != bos], skip_special_tokens=False)
             for p in prompt_ids_of_length(prompts, length, count)]
    if launch.prompt == "text":
        return list(texts)
    return [[bos, *tokenizer.encode(text, add_special_tokens=False).ids] for text in texts]


# ---------------------------------------------------------------- the flow


def _gate_side(*, side: ABInput, image_id: str, role: Role, docker: Docker, out: Path, tolerances_path: Path | None,
               wheelhouse: Path | None, serve_perf: PerfSettings | None, on_event: OnEvent) -> tuple[GateVerdict, str, bool]:
    """(verdict, where it lies, reused?): the given verdict when it is for this image id and lock, else a fresh gate
    of the image id (a tag moved meanwhile changes nothing)."""
    lock_hash = side.stack.lock.content_hash() if side.stack.lock is not None else None
    given = side.verdict
    if given is not None and given.image_id == image_id and given.lock_hash == lock_hash:
        on_event(f"ab: {role}: reusing the gate verdict for {image_id[:19]} ({given.decision})")
        return given, "(given)", True
    folder = out / f"gate-{role}"
    on_event(f"ab: {role}: gating {side.image} ({side.stack.manifest.name}) -> {folder}")
    verdict = gate_image(stack=side.stack, image=image_id, display=side.image, docker=docker, out=folder,
                         tolerances_path=tolerances_path, wheelhouse=wheelhouse, serve_perf=serve_perf,
                         on_event=lambda line: on_event(f"  {role}: {line}"))
    on_event(f"ab: {role}: gate {verdict.decision}: {verdict.reason[:160]}")
    return verdict, f"{folder.name}/verdict.json", False


def _measurable(verdict: GateVerdict) -> tuple[bool, str]:
    failing = verdict.failing_check()
    if verdict.decision in ("pass", "uncalibrated") or (failing is not None and failing.name in BOOTED_FAILURES):
        return True, ""
    name = failing.name if failing is not None else "the gate"
    return False, f"not started again: it failed {name} before serving ({verdict.reason[:200]})"


def runtime_ab(*, baseline: ABInput, candidate: ABInput, docker: Docker, out: Path,
               settings: ABSettings | None = None, tolerances_path: Path | None = None, wheelhouse: Path | None = None,
               gate_serve_perf: PerfSettings | None = None, on_event: OnEvent = _quiet) -> RuntimeAB:
    """Gate both sides, measure them in interleaved rounds, decide; writes ab.json, annex.md and annex.png to `out`.

    `gate_serve_perf` sets the load of the gates' own serve checks (default: the SKU's); the A/B's load is `settings`."""
    from skupin.ab.annex import write_annex

    started = time.monotonic()
    settings = settings or ABSettings()
    bm, cm = baseline.stack.manifest, candidate.stack.manifest
    same = same_weights(bm, cm)
    check_lengths(settings, model=bm.gate.model)
    ids: dict[Role, str] = {"baseline": resolve_image(docker=docker, image=baseline.image).id,
                            "candidate": resolve_image(docker=docker, image=candidate.image).id}
    if ids["baseline"] == ids["candidate"]:
        raise ManifestError(f"baseline and candidate are the same image ({ids['baseline'][:19]}): an A/B would "
                            "measure one image twice; give two images (--baseline-image / --candidate-image)")
    out.mkdir(parents=True, exist_ok=True)
    pairs = _sides(baseline, candidate)
    gates = {role: _gate_side(side=side, image_id=ids[role], role=role, docker=docker, out=out, tolerances_path=tolerances_path,
                              wheelhouse=wheelhouse, serve_perf=gate_serve_perf, on_event=on_event)
             for role, side in pairs}
    measurable = {role: _measurable(v) for role, (v, _, _) in gates.items()}
    measured = _Measured()
    if all(ok for ok, _ in measurable.values()):
        measured = _measure(baseline=baseline, candidate=candidate, ids=ids, docker=docker, settings=settings,
                            on_event=on_event)
    # only rounds measured on both sides, paired by the round they ran in (a failed half-round pairs with nothing)
    runs, order = measured.paired_runs(), [measured.order[r] for r in measured.paired()]
    boots = measured.paired_boots()
    sides = {role: _side(role=role, given=side, verdict=gates[role][0], verdict_path=gates[role][1],
                         reused=gates[role][2], image_id=ids[role], measurable=measurable[role], runs=runs[role],
                         served=measured.served[role], launch=measured.launches.get(role), settings=settings,
                         other_failed=not all(ok for ok, _ in measurable.values()), errors=measured.errors)
             for role, side in pairs}
    lengths: list[LengthAB] = []
    kpis: list[KPI] = []
    floor = DEFAULT_FLOOR
    basis = "not measured: the fixed floor"
    if order:
        for i, length in enumerate(settings.prompt_lengths):
            lengths.append(LengthAB(prompt_tokens=length, ab=ab_from_runs(
                candidate_runs=[r[i] for r in runs["candidate"]], baseline_runs=[r[i] for r in runs["baseline"]],
                bound=None, candidate_image=candidate.image, baseline_image=baseline.image, order=order)))
        kpis = _kpis(runs, boots)
        # a ratio carries the noise of both images: sqrt(2) x the larger image's own movement
        floor = math.sqrt(2) * max(noise_floor(runs["baseline"], _decode), noise_floor(runs["candidate"], _decode))
        basis = (f"sqrt(2) x the larger of the two images' own round-to-round movement of decode tok/s per request "
                 f"(per prompt length and level, the largest deviation of a round from that image's median; the median "
                 f"of those; a ratio carries both images' noise), at least 2% per image; {len(order)} rounds")
        if len(order) < 2:
            floor, basis = DEFAULT_FLOOR, "one round shows no noise: the fixed 10% floor (run --runs 3 or more)"
    decode_kpi = next((k for k in kpis if k.name == "decode"), None)
    prefill_kpi = next((k for k in kpis if k.name == "prefill"), None)
    aggregate_kpi = next((k for k in kpis if k.name == "aggregate"), None)

    def failure(role: Role) -> str:
        v = gates[role][0]
        failing = v.failing_check()
        return f"{failing.name}: {failing.reason}" if failing is not None else v.reason

    failed = {role: measured.failed[role] / measured.requests[role] for role in measured.requests
              if measured.requests[role]}
    short = {role: measured.short[role] / measured.requests[role] for role in measured.requests
             if measured.requests[role]}
    primary = _primary(cm)
    per_slice = slice_decisions(candidate=runs["candidate"], baseline=runs["baseline"],
                                prompt_lengths=settings.prompt_lengths, primary=primary, boots=boots) if order else ()
    cost_kpi = _cost_kpi(runs, boots, bm, cm) if order else None
    kpis += [k for k in (cost_kpi, _cpu_kpi(measured)) if k is not None]
    agreement = measured.agreement()
    asked = settings.runs if all(ok for ok, _ in measurable.values()) else 0
    note = rounds_note(rounds=measured.rounds, asked=asked,
                       decided=len([r for r in decode_kpi.rounds if math.isfinite(r)]) if decode_kpi else 0) if asked else ""
    decision, line, reason = decide(candidate_gate=gates["candidate"][0].decision, candidate_failure=failure("candidate"),
                                    baseline_gate=gates["baseline"][0].decision, baseline_failure=failure("baseline"),
                                    decode=decode_kpi, prefill=prefill_kpi, aggregate=aggregate_kpi, floor=floor,
                                    agreement=agreement,
                                    failed={str(k): v for k, v in failed.items()},
                                    errors={str(k): v for k, v in measured.errors.items()},
                                    short={str(k): v for k, v in short.items()}, slices=per_slice,
                                    rounds_asked=asked, rounds_note=note)
    result = RuntimeAB(baseline=sides["baseline"], candidate=sides["candidate"], same=same, settings=settings,
                       order=tuple(order), lengths=tuple(lengths), kpis=tuple(kpis), noise_floor=floor,
                       noise_floor_basis=basis, isolation=_isolation(settings) if order else "",
                       requests={str(k): v for k, v in measured.requests.items()},
                       failed_requests={str(k): v for k, v in measured.failed.items()}, output_agreement=agreement,
                       errors={str(k): v for k, v in measured.errors.items()},
                       short_completions={str(k): v for k, v in measured.short.items()},
                       output_tokens={str(k): dict(v) for k, v in measured.tokens.items()},
                       primary_kpi=primary, slices=per_slice, rounds=tuple(measured.rounds), rounds_note=note,
                       rounds_stop=measured.stopped if measured.order else None,
                       capacity=capacity(volume=settings.volume, baseline=_capacity(sides["baseline"], bm, settings),
                                         candidate=_capacity(sides["candidate"], cm, settings)),
                       cpu={str(role): c for role in ("baseline", "candidate")
                            if (c := measured.cpu_cost(role)) is not None},
                       decision_rule=DECISION_RULE, model_parameters=_parameters(bm.gate.model),
                       decision=decision, decision_line=line, reason=reason,
                       host=_host(), created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                       tool_version=__version__, wall_s=round(time.monotonic() - started, 1))
    result.write_json(out / "ab.json")
    write_annex(result, out)
    on_event(f"ab: {line}: {reason}")
    return result


def _decode(lv: LevelResult) -> float:
    return lv.decode_tok_s_per_request


def _parameters(model: str) -> int | None:
    """The fixture model's parameter count (gates/refdata/fixture.py weight_shapes), for the annex's size line."""
    try:
        return sum(math.prod(shape) for shape in weight_shapes(spec_for(model)).values())
    except (KeyError, ValueError, BundleError):
        return None


def _primary(manifest: SkuManifest) -> str:
    """The KPI the per-slice rule judges: the candidate SKU's gate.serve.primary_kpi (decode tok/s per request unless
    it says otherwise)."""
    serve = manifest.gate.serve
    return serve.primary_kpi if serve is not None else "decode"


def _rate(manifest: SkuManifest) -> float | None:
    """USD per server-hour at the SKU's utilisation (hourly_usd x devices / utilisation); None without a cost block."""
    if manifest.cost is None:
        return None
    return manifest.cost.hourly_usd * manifest.accelerator.count / manifest.cost.utilisation


def _cost_kpi(runs: dict[Role, list[list[PerfResult]]], boots: Sequence[int], bm: SkuManifest,
              cm: SkuManifest) -> KPI | None:
    """$ per 1M output tokens as a paired KPI: per round and slice, the ratio of the server-hour rates over the ratio
    of aggregate tok/s (the cost of a token is the rate over the throughput); None unless both SKUs state a cost."""
    rb, rc = _rate(bm), _rate(cm)
    if rb is None or rc is None:
        return None

    def usd(rate: float) -> Callable[[Sequence[LevelResult]], float]:
        def pooled(levels: Sequence[LevelResult]) -> float:
            best = max((lv.aggregate_tok_s for lv in levels), default=0.0)
            return rate / (best * 3600.0) * 1e6 if best > 0 else float("nan")
        return pooled

    c, b = runs["candidate"], runs["baseline"]
    # cost ratio = (rc / rb) x (aggregate_b / aggregate_c): the inverse throughput ratio, scaled by the rates
    k = kpi(name="cost", unit="USD per 1M output tokens, best level", higher_is_better=False, candidate=c, baseline=b,
            metric=lambda lv: 1.0 / lv.aggregate_tok_s if lv.aggregate_tok_s > 0 else float("nan"),
            pooled=usd(rb), scale=rc / rb, boots=boots)
    return k.model_copy(update={"candidate": usd(rc)([lv for r in runs["candidate"] for p in r for lv in p.levels])})


def _cpu_kpi(measured: _Measured) -> KPI | None:
    """CPU-seconds per 1M output tokens as a paired KPI: per round, the candidate's over the baseline's (each from its
    container's cgroup while it alone ran), paired by the round both were measured in (a round one side has no
    accounting for is left out, not shifted onto the next); None when no round has both sides' accounting."""
    b, c = measured.cpu["baseline"], measured.cpu["candidate"]
    base, cand = measured.cpu_cost("baseline"), measured.cpu_cost("candidate")
    keys = measured.cpu_rounds()
    if base is None or cand is None or not keys:
        return None
    rounds = [safe_ratio(c[r][0] / c[r][1], b[r][0] / b[r][1]) if b[r][1] and c[r][1] and b[r][0] > 0 else float("nan")
              for r in keys]
    finite = [r for r in rounds if math.isfinite(r)]
    ci = ratio_interval(rounds, [measured.boot[r] for r in keys])
    return KPI(name="cpu", unit="CPU-s per 1M output tokens", higher_is_better=False,
               ratio=percentile(finite, 50),
               rounds=tuple(rounds), baseline=base.cpu_s_per_1m_output_tokens,
               candidate=cand.cpu_s_per_1m_output_tokens, ci_low=ci[0] if ci else None, ci_high=ci[1] if ci else None)


def _capacity(side: ABSide, manifest: SkuManifest, settings: ABSettings) -> CapacitySide | None:
    """One side's servers and monthly cost for the daily volume, from the median over prompt lengths of its best-level
    aggregate tok/s (None without a cost block or a measurement)."""
    best = [p.headline().aggregate_tok_s for p in side.perf]
    tok_s = percentile(best, 50)
    return capacity_side(tok_s=tok_s, devices=manifest.accelerator.count,
                         hourly_usd=manifest.cost.hourly_usd if manifest.cost else None,
                         utilisation=manifest.cost.utilisation if manifest.cost else None, volume=settings.volume)


def _kpis(runs: dict[Role, list[list[PerfResult]]], boots: Sequence[int]) -> list[KPI]:
    def median_of(attr: str) -> Callable[[Sequence[LevelResult]], float]:
        def pooled(levels: Sequence[LevelResult]) -> float:
            values = [v for lv in levels for v in getattr(lv, attr)]
            return percentile(values, 50)
        return pooled

    def ttft_pooled(q: float) -> Callable[[Sequence[LevelResult]], float]:
        return lambda levels: percentile([t for lv in levels for t in lv.ttft_s], q)

    def prefill_pooled(levels: Sequence[LevelResult]) -> float:
        return percentile([lv.prefill_tok_s for lv in levels], 50)

    def aggregate_pooled(levels: Sequence[LevelResult]) -> float:
        return max((lv.aggregate_tok_s for lv in levels), default=float("nan"))

    c, b = runs["candidate"], runs["baseline"]
    return [
        kpi(name="decode", unit="tok/s per request", higher_is_better=True, candidate=c, baseline=b,
            metric=_decode,
            pooled=median_of("decode_tok_s"), boots=boots),
        kpi(name="prefill", unit="prompt tok/s", higher_is_better=True, candidate=c, baseline=b,
            metric=lambda lv: lv.prefill_tok_s,
            pooled=prefill_pooled, boots=boots),
        kpi(name="ttft_p50", unit="s", higher_is_better=False, candidate=c, baseline=b, metric=lambda lv: lv.ttft_p50_s,
            pooled=ttft_pooled(50), boots=boots),
        kpi(name="ttft_p99", unit="s", higher_is_better=False, candidate=c, baseline=b, metric=lambda lv: lv.ttft_p99_s,
            pooled=ttft_pooled(99), boots=boots),
        kpi(name="aggregate", unit="tok/s, best level", higher_is_better=True, candidate=c, baseline=b,
            metric=lambda lv: lv.aggregate_tok_s, pooled=aggregate_pooled, boots=boots),
    ]


@dataclass
class _Measured:
    """What the interleaved rounds produced, side by side (filled as they run; `errors` says which side ended them)."""

    # per side: round index (0-based, as in `order`) -> its runs per prompt length; a side that failed or did not run in
    # a round has no entry for it, so pairs are made by round, never by position
    runs: dict[Role, dict[int, list[PerfResult]]] = field(default_factory=lambda: {"baseline": {}, "candidate": {}})
    served: dict[Role, set[str]] = field(default_factory=lambda: {"baseline": set(), "candidate": set()})
    launches: dict[Role, tuple[str, ...]] = field(default_factory=dict)
    # every round started, a failed one included: "BA" or "AB", and the boot (1-based) of the servers that ran it
    order: list[str] = field(default_factory=list)
    boot: list[int] = field(default_factory=list)
    # time.monotonic() when the first round began: --budget-s and the cap count from it (boots after it included)
    first_round: float | None = None
    rounds: list[ABRound] = field(default_factory=list)
    # (prompt length index, prompt index) -> every text the side streamed for it
    texts: dict[Role, dict[tuple[int, int], list[str]]] = field(default_factory=lambda: {"baseline": {}, "candidate": {}})
    requests: dict[Role, int] = field(default_factory=lambda: {"baseline": 0, "candidate": 0})
    failed: dict[Role, int] = field(default_factory=lambda: {"baseline": 0, "candidate": 0})
    # completions whose host-counted tokens fall below min_host_tokens(max_tokens): the side under-generates
    short: dict[Role, int] = field(default_factory=lambda: {"baseline": 0, "candidate": 0})
    # per side: tokens asked (max_tokens x streamed requests), counted on the host, claimed in the server's usage
    tokens: dict[Role, dict[str, int]] = field(default_factory=lambda: {
        role: {"asked": 0, "host": 0, "claimed": 0} for role in ("baseline", "candidate")})
    # per side: round index -> (CPU seconds of its container while measured, host-counted output tokens); no entry
    # when the daemon gave no CPU accounting for that round
    cpu: dict[Role, dict[int, tuple[float, int]]] = field(default_factory=lambda: {"baseline": {}, "candidate": {}})
    errors: dict[Role, str] = field(default_factory=dict)
    # why the rounds ended (rounds_stop's answer, or 'failed' when a side's failure ended them)
    stopped: RoundsStop = "failed"
    count_tokens: Callable[[str], int] | None = None
    max_tokens: int = 0

    def paired(self) -> list[int]:
        """The rounds (indices into `order`) measured on both sides: the rounds every KPI pairs."""
        return [r for r in range(len(self.order)) if r in self.runs["baseline"] and r in self.runs["candidate"]]

    def paired_boots(self) -> list[int]:
        """The boot of each paired round, in round order (the unit every interval is over when there are several)."""
        return [self.boot[r] for r in self.paired()]

    def paired_runs(self) -> dict[Role, list[list[PerfResult]]]:
        """Each side's runs of the paired rounds, in round order: [r][i] of both sides ran in one round."""
        keys = self.paired()
        return {role: [self.runs[role][r] for r in keys] for role in ("baseline", "candidate")}

    def cpu_rounds(self) -> list[int]:
        """The rounds both sides have CPU accounting for (each side's is taken only in a round it was measured in)."""
        return sorted(set(self.cpu["baseline"]) & set(self.cpu["candidate"]))

    def cpu_cost(self, role: Role) -> CpuCost | None:
        """CPU-seconds per 1M host-counted output tokens of the side's container over cpu_rounds (the same rounds for
        both sides); None unmeasured."""
        keys = [r for r in self.cpu_rounds() if self.cpu[role][r][1] > 0]
        if not keys:
            return None
        rounds = [self.cpu[role][r] for r in keys]
        cpu_s, tokens = sum(c for c, _ in rounds), sum(n for _, n in rounds)
        return CpuCost(cpu_s=round(cpu_s, 3), output_tokens=tokens, cpu_s_per_1m_output_tokens=cpu_s / tokens * 1e6,
                       rounds=tuple(c / n * 1e6 for c, n in rounds), round_numbers=tuple(r + 1 for r in keys))

    def record(self, role: Role, length: int) -> Callable[[int, Any], None]:
        def seen(index: int, completion: Any) -> None:
            self.requests[role] += 1
            if completion.ttft_s is None or not completion.pieces:
                self.failed[role] += 1
                return
            if self.count_tokens is not None and self.max_tokens:
                host = self.count_tokens(completion.text)
                self.tokens[role]["asked"] += self.max_tokens
                self.tokens[role]["host"] += min(host, self.max_tokens)
                self.tokens[role]["claimed"] += int(completion.completion_tokens or 0)
                if host < min_host_tokens(self.max_tokens):
                    self.short[role] += 1
            # letters only: engines' streamed pieces differ in where spaces go (the first piece's leading space, a
            # SentencePiece word boundary decoded alone or in context; docs/SERVE.md, greedy comparison)
            self.texts[role].setdefault((length, index), []).append("".join(completion.text[:4096].split()))
        return seen

    def agreement(self) -> float | None:
        """Share of the candidate's completions whose letters equal the baseline's first completion for the same prompt
        (same weights, greedy: an honest runtime agrees but for near ties); None when nothing can be paired."""
        pairs = [(text, self.texts["baseline"][key][0]) for key, texts in self.texts["candidate"].items()
                 if self.texts["baseline"].get(key) for text in texts]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _measure(*, baseline: ABInput, candidate: ABInput, ids: dict[Role, str], docker: Docker, settings: ABSettings,
             on_event: OnEvent) -> _Measured:
    """Boot both servers, warm them up, run the interleaved rounds with the other side's container paused. A side
    whose server fails to start, answers with an error or runs another image than the one gated ends the rounds:
    `errors` says which side and why."""
    measured = _Measured()
    try:
        _rounds(baseline=baseline, candidate=candidate, ids=ids, docker=docker, settings=settings, on_event=on_event,
                measured=measured)
    except _SideFailed as exc:
        measured.errors[exc.role] = exc.reason
        on_event(f"ab: {exc.role}: {exc.reason}")
    return measured


class _SideFailed(Exception):
    def __init__(self, role: Role, reason: str) -> None:
        super().__init__(reason)
        self.role, self.reason = role, reason


def _rounds(*, baseline: ABInput, candidate: ABInput, ids: dict[Role, str], docker: Docker, settings: ABSettings,
            on_event: OnEvent, measured: _Measured) -> None:
    """Boot after boot of both servers (one, or a new one every settings.restart_every rounds), each warmed up and then
    measured in interleaved rounds, until rounds_stop names why the rounds end (`measured.stopped`)."""
    from tokenizers import Tokenizer

    failures: tuple[type[Exception], ...] = (TimeoutError, DockerError, ValueError, *exchange_errors())
    with tempfile.TemporaryDirectory(prefix="skupin-ab-") as scratch:
        folder = fixture_folder(name=baseline.stack.manifest.gate.model, model_dir=None, scratch=Path(scratch))
        # each engine's own view of the same weights (the fixture, plus a checked GGUF for an engine that loads one)
        mounts = {role: model_folder(manifest=side.stack.manifest, scratch=Path(scratch), fixture_dir=folder)
                  for role, side in _sides(baseline, candidate)}
        prompt_set = load_prompts(folder / "prompts.json")
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # output tokens as the host counts the streamed text, never the server's usage (a side that streams fewer than
        # asked is named: decision.min_host_tokens)
        measured.count_tokens, measured.max_tokens = tokenizer_counter(tokenizer), settings.max_tokens
        measured.stopped = until_stopped(lambda number: _boot(
            number=number, baseline=baseline, candidate=candidate, ids=ids, docker=docker, settings=settings,
            mounts=mounts, prompt_set=prompt_set, tokenizer=tokenizer, measured=measured, on_event=on_event,
            failures=failures))


def until_stopped(boot: Callable[[int], RoundsStop | None]) -> RoundsStop:
    """Boot 1, 2, ... (`boot(number)` runs one and returns why the rounds ended, or None for another) until one ends them."""
    number = 1
    while (stop := boot(number)) is None:
        number += 1
    return stop


def _boot(*, number: int, baseline: ABInput, candidate: ABInput, ids: dict[Role, str], docker: Docker,
          settings: ABSettings, mounts: Mapping[Role, Path], prompt_set: Mapping[str, Any], tokenizer: Tokenizer,
          measured: _Measured, on_event: OnEvent, failures: tuple[type[Exception], ...]) -> RoundsStop | None:
    """Boot `number`: both servers started, warmed up and measured in interleaved rounds, then stopped; why the rounds
    end (rounds_stop), or None when the boot ran its settings.restart_every rounds and another boot follows."""
    if number > 1:
        on_event(f"ab: boot {number}: both servers started again (--restart-every {settings.restart_every})")
    # odd boots start the baseline first, even ones the candidate: neither side is always the one warmed up last
    sides = _sides(baseline, candidate)[::1 if number % 2 else -1]
    with contextlib.ExitStack() as scope:
        try:
            servers = {role: _booted(role=role, side=side, image_id=ids[role], docker=docker, settings=settings,
                                     model_dir=mounts[role], prompt_set=prompt_set, tokenizer=tokenizer,
                                     measured=measured, scope=scope, on_event=on_event, failures=failures)
                       for role, side in sides}
        except _SideFailed as exc:
            if measured.order:  # a boot after the first: kept as the round it was started for, failed
                r = len(measured.order)
                measured.order.append(_order(r, number))
                measured.boot.append(number)
                status: dict[Role, Literal["ok", "failed", "not run"]] = {"baseline": "not run", "candidate": "not run"}
                status[exc.role] = "failed"
                measured.rounds.append(_round_kept(measured, r, status, {}, exc.reason))
            raise
        perf = settings.perf()

        def measure(role: Role) -> list[PerfResult]:
            server, inputs, counts = servers[role]
            return [run_perf(client=server.client, prompts=inputs[i], settings=perf,
                             on_completion=measured.record(role, i), prompt_tokens=counts[i],
                             count_tokens=measured.count_tokens)
                    for i in range(len(settings.prompt_lengths))]

        with client_pinned(settings.cpu_plan.client if settings.cpu_plan else None):
            stop = _interleave(servers={role: server for role, (server, _, _) in servers.items()}, measure=measure,
                               settings=settings, measured=measured, on_event=on_event, failures=failures,
                               boot=number)
        for role, (server, _, _) in servers.items():  # the container still runs the image it was created from
            _check_served(server, role, ids[role], measured)
    return stop


def _sides(baseline: ABInput, candidate: ABInput) -> tuple[tuple[Role, ABInput], ...]:
    return ("baseline", baseline), ("candidate", candidate)


def _booted(*, role: Role, side: ABInput, image_id: str, docker: Docker, settings: ABSettings, model_dir: Path,
            prompt_set: Mapping[str, Any], tokenizer: Tokenizer, measured: _Measured, scope: contextlib.ExitStack,
            on_event: OnEvent, failures: tuple[type[Exception], ...],
            ) -> tuple[RunningServer, list[list[Any]], list[list[int]]]:
    """One side's server started in `scope` (stopped when it closes), checked to run the gated image and warmed up; with
    its inputs per prompt length (in the form its launch takes) and their host-counted prompt tokens. _SideFailed when
    it does not start or serve."""
    manifest = side.stack.manifest
    try:
        server = scope.enter_context(running_server(
            manifest=manifest, image=image_id, docker=docker, model_dir=model_dir,
            deadline_s=float(manifest.gate.deadline_s), workers=max(settings.concurrency), role=f"ab-{role}",
            cpuset=settings.cpu_plan.cpuset() if settings.cpu_plan else None,
            lifetime_s=manifest.gate.deadline_s + SERVER_EXTRA_LIFETIME_S))
        _check_served(server, role, image_id, measured)
        measured.launches[role] = tuple(server.launch.argv)
        inputs = [prompt_inputs(prompts=prompt_set["prompts"], tokenizer=tokenizer, length=n, count=8,
                                launch=server.launch) for n in settings.prompt_lengths]
        # prompt tokens as the host counts them (a server's own count is its word, and some send none)
        counts = [[len(p) if isinstance(p, list) else 1 + len(tokenizer.encode(p, add_special_tokens=False))
                   for p in per_length] for per_length in inputs]
        on_event(f"ab: {role}: {' '.join(server.launch.argv[:3])} ready in {server.ready_s:.1f} s")
        if settings.warmup:
            measure_level(client=server.client, prompts=inputs[0], concurrency=1, requests=settings.warmup,
                          max_tokens=settings.max_tokens)
    except failures as exc:
        when = "before the rounds" if not measured.order else f"when started again after round {len(measured.order)}"
        raise _SideFailed(role, f"its server failed {when}: {type(exc).__name__}: {exc}"[:600]) from exc
    if settings.cpu_plan is not None:
        _check_placement(server, role, settings.cpu_plan)
    return server, inputs, counts


def _interleave(*, servers: Mapping[Role, RunningServer], measure: Callable[[Role], list[PerfResult]],
                settings: ABSettings, measured: _Measured, on_event: OnEvent,
                failures: tuple[type[Exception], ...], boot: int) -> RoundsStop | None:
    """The rounds of one boot, B A, A B, ..., each side measured (`measure`) while the other's container is paused,
    until rounds_stop names why the rounds end (returned; its time counts from `measured.first_round`) or the boot
    has run settings.restart_every rounds (None: boot again). Each round is kept in `measured.rounds` as it went, a
    failed one too; a side's runs and CPU accounting are stored under the round's index. A side that fails ends the
    rounds (_SideFailed): the decision it forces (decide's serving rule) cannot change with more rounds against a
    failing server."""
    r, in_boot = len(measured.order), 0
    planned = str(settings.runs) if settings.target_ci is None else f"{settings.runs}-{settings.max_runs}"
    while True:
        # a boot after the first was started because the rounds go on: it runs its first round before any stop
        if in_boot or boot == 1:
            elapsed = time.monotonic() - measured.first_round if measured.first_round is not None else 0.0
            stop = rounds_stop(settings=settings, elapsed_s=elapsed,
                               ratios=round_ratios(**measured.paired_runs(), metric=_decode),
                               boots=measured.paired_boots())
            if stop is not None:
                return stop
        if in_boot == settings.restart_every:
            return None
        if measured.first_round is None:
            measured.first_round = time.monotonic()
        measured.order.append(_order(r, boot))
        measured.boot.append(boot)
        first: tuple[Role, Role] = ("baseline", "candidate") if measured.order[-1] == "BA" else ("candidate", "baseline")
        status: dict[Role, Literal["ok", "failed", "not run"]] = {"baseline": "not run", "candidate": "not run"}
        before = {role: (measured.requests[role], measured.failed[role]) for role in first}
        try:
            for role in first:
                other: Role = "candidate" if role == "baseline" else "baseline"
                server = servers[role]
                with _paused(servers[other], other):  # the idle side gets no CPU, whatever it runs
                    try:
                        cpu_before = _cpu_seconds(server)
                        result = measure(role)
                        cpu_after = _cpu_seconds(server)
                    except failures as exc:
                        raise _SideFailed(role, f"its server failed in round {r + 1}: {type(exc).__name__}: "
                                                f"{exc}"[:600]) from exc
                    measured.runs[role][r] = result
                    status[role] = "ok"
                    if cpu_before is not None and cpu_after is not None:
                        measured.cpu[role][r] = (cpu_after - cpu_before,
                                                 sum(lv.output_tokens for p in result for lv in p.levels))
        except _SideFailed as exc:
            status[exc.role] = "failed"
            measured.rounds.append(_round_kept(measured, r, status, before, exc.reason))
            raise
        measured.rounds.append(_round_kept(measured, r, status, before))
        b, c = measured.runs["baseline"][r][0].levels[0], measured.runs["candidate"][r][0].levels[0]
        on_event(f"ab: round {r + 1}/{planned} ({measured.order[-1]}{f', boot {boot}' if settings.restart_every else ''}): "
                 f"decode tok/s per request at concurrency "
                 f"{b.concurrency}, {settings.prompt_lengths[0]} prompt tokens: baseline "
                 f"{b.decode_tok_s_per_request:.1f}, candidate {c.decode_tok_s_per_request:.1f}")
        r, in_boot = r + 1, in_boot + 1


def _order(r: int, boot: int) -> str:
    """Round r's order in boot `boot`: B A, A B, ... from BA in odd boots and from AB in even ones (a boot has an even
    number of rounds), so neither side always runs first after a boot."""
    return "BA" if (r + boot - 1) % 2 == 0 else "AB"


def _check_placement(server: RunningServer, role: Role, plan: CpuPlan) -> None:
    """DockerError (the A/B cannot run as asked; not the side's failure) when the server's process does not run on the
    plan's CPUs: a daemon without the cpuset controller drops --server-cpus with a warning docker-py does not pass on.
    Nothing to check where /proc does not show the process (a daemon on another host)."""
    try:
        pid = int(server.container.pid())
    except (DockerError, TypeError, ValueError):
        return
    found = cpus_of(pid)
    if found is not None and found != plan.server:
        raise DockerError(f"--server-cpus: the {role}'s server runs on CPUs {','.join(map(str, found))}, not "
                          f"{plan.cpuset()}: this Docker daemon did not apply the cpuset (no cpuset cgroup controller?); "
                          "give --server-cpus shared")


def _round_kept(measured: _Measured, r: int, status: Mapping[Role, Literal["ok", "failed", "not run"]],
                before: Mapping[Role, tuple[int, int]], reason: str = "") -> ABRound:
    """Round r as it went: each side's status, the requests it sent and how many streamed nothing."""
    return ABRound(number=r + 1, order=measured.order[r], boot=measured.boot[r], baseline=status["baseline"],
                   candidate=status["candidate"],
                   reason=reason, requests={role: measured.requests[role] - n for role, (n, _) in before.items()},
                   failed_requests={role: measured.failed[role] - f for role, (_, f) in before.items()})


def _cpu_seconds(server: RunningServer) -> float | None:
    """The server container's CPU seconds so far (its cgroup's accounting, through skupin/dockerd), or None when the
    daemon gives none: the CPU cost is then not reported, the A/B goes on."""
    try:
        return float(server.container.cpu_seconds())
    except (DockerError, AttributeError, TypeError, ValueError):
        return None


@contextlib.contextmanager
def _paused(server: RunningServer, role: Role) -> Iterator[None]:
    """The side `role`'s container paused for the block; a pause or unpause that fails is that side's failure."""
    try:
        pause = server.container.paused()
        pause.__enter__()
    except DockerError as exc:
        raise _SideFailed(role, f"its idle container could not be paused: {exc}"[:600]) from exc
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            pause.__exit__(None, None, None)
        except DockerError as exc:
            if not failed:  # an error of the measured side wins over this one
                raise _SideFailed(role, f"its container could not be unpaused: {exc}"[:600]) from exc


def _check_served(server: RunningServer, role: Role, image_id: str, measured: _Measured) -> None:
    """Record the image the daemon says the server's container runs; _SideFailed when it is not the gated one."""
    running = server.container.image_id()
    measured.served[role].add(running)
    if running != image_id:
        raise _SideFailed(role, f"its server container runs {running[:19]}, not the gated image {image_id[:19]}")


def _side(*, role: Role, given: ABInput, verdict: GateVerdict, verdict_path: str, reused: bool, image_id: str,
          measurable: tuple[bool, str], runs: list[list[PerfResult]], served: set[str], launch: tuple[str, ...] | None,
          settings: ABSettings, other_failed: bool, errors: Mapping[Role, str] | None = None) -> ABSide:
    from skupin.engines import serve_launch

    manifest = given.stack.manifest
    failing = verdict.failing_check()
    merged = tuple(merge_perf([r[i] for r in runs]) for i in range(len(settings.prompt_lengths))) if runs else ()
    cost = tuple(cost_summary(perf=p, hourly_usd=manifest.cost.hourly_usd if manifest.cost else None,
                              utilisation=manifest.cost.utilisation if manifest.cost else None) for p in merged)
    ok, why = measurable
    if ok and not runs:
        failed = "; ".join(f"the {r}: {e[:300]}" for r, e in (errors or {}).items())
        why = ("not measured: the other side could not be started again" if other_failed else
               f"not measured: no round finished on both sides ({failed})" if failed else "not measured")
    planned = serve_launch(manifest=manifest)
    return ABSide(role=role, sku=manifest.name, image=given.image, image_id=image_id, served_by=tuple(sorted(served)),
                  engine=manifest.stack.engine.name, engine_path=_engine_path(verdict),
                  launch=launch or (tuple(planned.argv) if planned else ()), weights=weights_label(manifest),
                  gate=verdict.decision, gate_reason=verdict.reason[:600],
                  failing_check=failing.name if failing is not None else None,
                  verdict_path=verdict_path, verdict_reused=reused, measured=bool(runs), not_measured="" if runs else why,
                  hourly_usd=manifest.cost.hourly_usd if manifest.cost else None,
                  utilisation=manifest.cost.utilisation if manifest.cost else None, perf=merged, cost=cost)


def _engine_path(verdict: GateVerdict) -> dict[str, str]:
    """The model check's engine path (gates/gate.py engine_path: the probe's words, already made short and printable)."""
    model = verdict.check("model")
    path = model.details.get("engine_path") if model is not None else None
    return {str(k): str(v)[:200] for k, v in path.items()} if isinstance(path, dict) else {}


def _host() -> str:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu or platform.processor() or 'unknown CPU'}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


__all__ = ["ABInput", "NotTheSameWeights", "check_lengths", "prompt_ids_of_length", "runtime_ab", "same_weights"]
