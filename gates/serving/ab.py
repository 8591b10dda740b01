"""Interleaved A/B of two images' servers on the same host: per-level ratios with their spread, and the regression bound.

Both servers are booted side by side (an idle server costs no CPU); the load then alternates
between them round by round in the order B A, A B, B A, ... (B = baseline, A = candidate), so a
slow drift of the host (thermal, noisy neighbours) hits both equally. Each round runs the full
set of concurrency levels once per image. Per round and level the ratio is candidate / baseline
of the median per-request decode tok/s (and of aggregate tok/s and TTFT p50). The headline decode
ratio is, per round, the median over levels (robust to one level disturbed by a noisy neighbour);
the verdict reports its median over rounds
and the spread (min-max over rounds). With a bound `max_decode_regression` the A/B fails when the
median decode ratio is below 1 - bound and no round reached parity (max over rounds < 1); a median
below the bound with a round at or above 1 is reported as inconclusive (host noise), not failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from common.model import Frozen
from gates.serving.perf import CostSummary, LevelResult, PerfResult, PerfSettings, merge_perf


class ABLevel(Frozen):
    """Candidate vs baseline at one concurrency level, over rounds."""

    concurrency: int
    decode_ratio: float = Field(description="Median over rounds of candidate/baseline per-request decode tok/s")
    decode_ratio_min: float
    decode_ratio_max: float
    aggregate_ratio: float = Field(description="Median over rounds of candidate/baseline aggregate tok/s")
    ttft_ratio: float = Field(description="Median over rounds of candidate/baseline TTFT p50 (above 1 = slower)")
    candidate_decode_tok_s: float
    baseline_decode_tok_s: float
    candidate_aggregate_tok_s: float
    baseline_aggregate_tok_s: float
    candidate_ttft_p50_s: float
    baseline_ttft_p50_s: float


class ABResult(Frozen):
    """The A/B of a candidate image against a baseline image."""

    candidate_image: str
    baseline_image: str
    rounds: int
    order: tuple[str, ...] = Field(description="Per round, which image ran first: 'BA' or 'AB'")
    levels: tuple[ABLevel, ...]
    decode_ratio: float = Field(description="Median over rounds of the per-round median (over levels) decode ratio")
    decode_ratio_spread: tuple[float, float] = Field(description="(min, max) over rounds of that per-round ratio")
    bound: float | None = Field(description="max_decode_regression of the SKU (None: report only)")
    status: Literal["pass", "fail", "report"]
    summary: str
    candidate: PerfResult
    baseline: PerfResult


def _ratio(a: float, b: float) -> float:
    """a / b; NaN when either is 0 (perf reports 0 for a figure it could not measure, e.g. prefill with no prompt count)."""
    return a / b if a > 0 and b > 0 else float("nan")


def ab_from_runs(*, candidate_runs: Sequence[PerfResult], baseline_runs: Sequence[PerfResult], bound: float | None,
                 candidate_image: str, baseline_image: str, order: Sequence[str]) -> ABResult:
    """The A/B result from paired rounds (candidate_runs[i] and baseline_runs[i] ran in the same round)."""
    per_round: list[float] = []
    per_level: dict[int, dict[str, list[float]]] = {}
    for cand, base in zip(candidate_runs, baseline_runs, strict=True):
        ratios = []
        for lv in cand.levels:
            other = base.level(lv.concurrency)
            if other is None:
                continue
            d = per_level.setdefault(lv.concurrency, {"decode": [], "aggregate": [], "ttft": []})
            r = _ratio(lv.decode_tok_s_per_request, other.decode_tok_s_per_request)
            d["decode"].append(r)
            d["aggregate"].append(_ratio(lv.aggregate_tok_s, other.aggregate_tok_s))
            d["ttft"].append(_ratio(lv.ttft_p50_s, other.ttft_p50_s))
            ratios.append(r)
        per_round.append(float(np.median(ratios)) if ratios else float("nan"))
    cand_all, base_all = merge_perf(candidate_runs), merge_perf(baseline_runs)
    levels = []
    for c, d in sorted(per_level.items()):
        cl, bl = cand_all.level(c), base_all.level(c)
        if cl is None or bl is None:  # a level both sides measured in some round, merged from their runs
            continue
        levels.append(
            ABLevel(
                concurrency=c,
                decode_ratio=float(np.nanmedian(d["decode"])),
                decode_ratio_min=float(np.nanmin(d["decode"])),
                decode_ratio_max=float(np.nanmax(d["decode"])),
                aggregate_ratio=float(np.nanmedian(d["aggregate"])),
                ttft_ratio=float(np.nanmedian(d["ttft"])),
                candidate_decode_tok_s=cl.decode_tok_s_per_request,
                baseline_decode_tok_s=bl.decode_tok_s_per_request,
                candidate_aggregate_tok_s=cl.aggregate_tok_s,
                baseline_aggregate_tok_s=bl.aggregate_tok_s,
                candidate_ttft_p50_s=cl.ttft_p50_s,
                baseline_ttft_p50_s=bl.ttft_p50_s,
            )
        )
    ratio = float(np.nanmedian(per_round)) if per_round else float("nan")
    spread = (float(np.nanmin(per_round)), float(np.nanmax(per_round))) if per_round else (float("nan"),) * 2
    text = (f"decode tok/s ratio candidate/baseline {ratio:.3f} (rounds {spread[0]:.3f}-{spread[1]:.3f}, "
            f"{len(per_round)} interleaved rounds)")
    if bound is None:
        status = "report"
        text += "; no regression bound set (gate.serve.max_decode_regression)"
    elif not math.isfinite(ratio) or (ratio < 1.0 - bound and spread[1] < 1.0):
        status = "fail"
        text += f" is below the bound 1 - {bound:g} = {1 - bound:.3f} and no round reached parity"
    elif ratio < 1.0 - bound:
        status = "pass"
        text += (f" is below the bound 1 - {bound:g} = {1 - bound:.3f} but a round reached parity: inconclusive on "
                 "this host's noise (rerun on a quiet host)")
    else:
        status = "pass"
        text += f" within the bound 1 - {bound:g} = {1 - bound:.3f}"
    return ABResult(candidate_image=candidate_image, baseline_image=baseline_image, rounds=len(per_round),
                    order=tuple(order), levels=tuple(levels), decode_ratio=ratio, decode_ratio_spread=spread,
                    bound=bound, status=status, summary=text, candidate=cand_all, baseline=base_all)


def interleaved_ab(*, candidate: Callable[[PerfSettings], PerfResult], baseline: Callable[[PerfSettings], PerfResult],
                   settings: PerfSettings, rounds: int, bound: float | None, candidate_image: str,
                   baseline_image: str) -> ABResult:
    """Run `rounds` rounds alternating which image goes first (B A, A B, ...), one repetition per level each."""
    per_round = settings.model_copy(update={"repetitions": 1})
    cand_runs: list[PerfResult] = []
    base_runs: list[PerfResult] = []
    order: list[str] = []
    for r in range(max(1, rounds)):
        s = per_round if r else per_round.model_copy(update={"warmup": max(settings.warmup, 1)})
        if r % 2 == 0:
            base_runs.append(baseline(s))
            cand_runs.append(candidate(s))
            order.append("BA")
        else:
            cand_runs.append(candidate(s))
            base_runs.append(baseline(s))
            order.append("AB")
    return ab_from_runs(candidate_runs=cand_runs, baseline_runs=base_runs, bound=bound,
                        candidate_image=candidate_image, baseline_image=baseline_image, order=order)


# ---------------------------------------------------------------- runtime A/B across SKUs (`skupin ab`)
# The pure half of gates/serving/runtime_ab.py: the settings, the noise floor, the KPIs and the decision.

MIN_NOISE_FLOOR = 0.02  # a 2% move is never called an uplift on a shared host, however quiet the rounds were
ABDecision = Literal["promote", "hold", "reject"]


class ABSettings(Frozen):
    """How much load `skupin ab` generates: every round runs every prompt length at every concurrency, once per image."""

    runs: int = Field(3, ge=1, le=50, description="Interleaved rounds (B A, A B, ...)")
    concurrency: tuple[int, ...] = Field((1, 2, 4), min_length=1)
    prompt_lengths: tuple[int, ...] = Field((64, 256), min_length=1, description="Prompt tokens per request")
    requests: int = Field(8, ge=1, description="Measured requests per level, round and image")
    max_tokens: int = Field(32, ge=2, description="Output tokens per request")
    warmup: int = Field(2, ge=0, description="Unmeasured requests per image before the first round")

    def perf(self) -> PerfSettings:
        """The load of one image in one round at one prompt length."""
        return PerfSettings(concurrency=self.concurrency, requests=self.requests, repetitions=1, warmup=0,
                            max_tokens=self.max_tokens, prompts=8)


class KPI(Frozen):
    """One key figure of the A/B: candidate/baseline ratio per round (median over prompt lengths and levels)."""

    name: str
    higher_is_better: bool
    ratio: float = Field(description="Median over rounds of the per-round ratio candidate / baseline")
    rounds: tuple[float, ...] = Field(description="The per-round ratios, in round order")
    baseline: float = Field(description="Baseline's median over every measured request of every round")
    candidate: float
    unit: str


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def round_ratios(*, candidate: Sequence[Sequence[PerfResult]], baseline: Sequence[Sequence[PerfResult]],
                 metric: Callable[[LevelResult], float]) -> list[float]:
    """Per round, the median over (prompt length, concurrency) of candidate/baseline `metric`.

    candidate[r][i] and baseline[r][i] are the runs of round r at prompt length i."""
    out = []
    for cand_round, base_round in zip(candidate, baseline, strict=True):
        ratios = []
        for cand, base in zip(cand_round, base_round, strict=True):
            for lv in cand.levels:
                other = base.level(lv.concurrency)
                if other is not None:
                    ratios.append(_ratio(metric(lv), metric(other)))
        finite = _finite(ratios)
        out.append(float(np.median(finite)) if finite else float("nan"))
    return out


def noise_floor(runs: Sequence[Sequence[PerfResult]], metric: Callable[[LevelResult], float]) -> float:
    """How far one image's own `metric` moved between rounds on this host: per (prompt length, level), the largest
    relative deviation of a round from that image's median over rounds; the median of those (no less than
    MIN_NOISE_FLOOR; NaN with fewer than two rounds, which cannot show noise)."""
    if len(runs) < 2:
        return float("nan")
    devs = []
    for i in range(len(runs[0])):
        for lv in runs[0][i].levels:
            values = _finite([metric(lvl) for r in runs if (lvl := r[i].level(lv.concurrency)) is not None])
            med = float(np.median(values)) if values else 0.0
            if len(values) > 1 and med > 0:
                devs.append(max(abs(v / med - 1.0) for v in values))
    return max(MIN_NOISE_FLOOR, float(np.median(devs))) if devs else MIN_NOISE_FLOOR


def kpi(*, name: str, unit: str, higher_is_better: bool, candidate: Sequence[Sequence[PerfResult]],
        baseline: Sequence[Sequence[PerfResult]], metric: Callable[[LevelResult], float],
        pooled: Callable[[Sequence[LevelResult]], float]) -> KPI:
    """The KPI from paired rounds: per-round ratios, and each side's pooled value over every level it measured."""
    rounds = round_ratios(candidate=candidate, baseline=baseline, metric=metric)
    finite = _finite(rounds)

    def levels(runs: Sequence[Sequence[PerfResult]]) -> list[LevelResult]:
        return [lv for r in runs for perf in r for lv in perf.levels]

    return KPI(name=name, unit=unit, higher_is_better=higher_is_better,
               ratio=float(np.median(finite)) if finite else float("nan"), rounds=tuple(rounds),
               baseline=pooled(levels(baseline)), candidate=pooled(levels(candidate)))


MIN_ROUNDS = 3  # with fewer, "every round faster" happens by chance too often (two rounds: one in four)
# share of the candidate's completions equal to the baseline's on the same prompt, whitespace aside (same weights,
# greedy). Measured on this CPU under load (32-token completions of 64- and 256-token prompts): honest transformers vs
# vLLM agreed on 100% this way and on 62.5% as exact text; llama.cpp's streamed pieces place spaces differently again.
# A guard against a runtime that answers the A/B's load with other text, not a quality check (the gate is).
MIN_AGREEMENT = 0.8
MAX_FAILED = 0.05  # share of a side's requests that may stream nothing


def _gate_decision(*, candidate_gate: str, candidate_failure: str, baseline_gate: str, baseline_failure: str,
                   decode: KPI | None) -> tuple[ABDecision, str, str] | None:
    """The decision the two gates force, if any (decide's first rule)."""
    if candidate_gate == "uncalibrated":
        return "hold", "hold: candidate uncalibrated", (
            "the candidate passed every calibration-free check, but its hardware class has no calibrated tolerance: "
            f"its quality is not established ({candidate_failure}); fix: skupin calibrate on that hardware")
    if candidate_gate == "could_not_run":
        return "hold", "hold: candidate gate could not run", (
            f"the gate reached no verdict on the candidate ({candidate_failure}): not a quality failure; fix it and rerun")
    if candidate_gate != "pass":
        speed = (f"; it ran at {decode.ratio:.2f}x the baseline's decode tok/s per request"
                 if decode is not None and math.isfinite(decode.ratio) else "")
        return "reject", "reject: quality gate failed", f"the candidate did not pass the gate: {candidate_failure}{speed}"
    if baseline_gate != "pass":
        return "hold", "hold: baseline not verified", (f"the baseline's gate ended {baseline_gate} ({baseline_failure}); "
                                                       "an A/B against it proves nothing: fix or replace the baseline")
    return None


def _serving_decision(*, agreement: float | None, failed: dict[str, float], errors: dict[str, str]
                      ) -> tuple[ABDecision, str, str] | None:
    """The decision what the rounds showed of each side's serving forces, if any (decide's second rule)."""
    if "candidate" in errors:
        return "reject", "reject: candidate failed in the A/B", f"the candidate: {errors['candidate']}"
    if "baseline" in errors:
        return "hold", "hold: baseline failed in the A/B", f"the baseline: {errors['baseline']}"
    if failed.get("candidate", 0.0) > MAX_FAILED:
        return "reject", "reject: candidate requests failed", (
            f"{100 * failed['candidate']:.0f}% of the candidate's requests streamed nothing (at most "
            f"{100 * MAX_FAILED:.0f}% allowed)")
    if failed.get("baseline", 0.0) > MAX_FAILED:
        return "hold", "hold: baseline requests failed", (
            f"{100 * failed['baseline']:.0f}% of the baseline's requests streamed nothing")
    if agreement is not None and agreement < MIN_AGREEMENT:
        return "reject", "reject: outputs differ from the baseline's", (
            f"only {100 * agreement:.0f}% of the candidate's greedy completions in the rounds equal the baseline's on the "
            f"same prompts (at least {100 * MIN_AGREEMENT:.0f}% for the same weights): its speed was not measured on "
            "the answers the gate checked")
    return None


def decide(*, candidate_gate: str, candidate_failure: str, baseline_gate: str, baseline_failure: str,
           decode: KPI | None, prefill: KPI | None, floor: float, aggregate: KPI | None = None,
           agreement: float | None = None,
           failed: dict[str, float] | None = None, errors: dict[str, str] | None = None) -> tuple[ABDecision, str, str]:
    """(decision, decision line, reason). The candidate's quality gate comes first: a candidate that did not pass is
    rejected however fast it is. Then what the rounds showed of each side's serving: a side that failed during them, or
    streamed nothing for more than MAX_FAILED of its requests, or (candidate) whose completions mostly differ from the
    baseline's on the same prompts. Speed, with at least MIN_ROUNDS rounds, over three KPIs kept apart (decode tok/s per
    request, prefill tok/s, aggregate tok/s): each is faster (median ratio at least 1 + floor and every round above 1),
    slower (the mirror) or the same. Promote when at least one is faster and none slower; reject when some are slower
    and none faster; a trade-off (some of each) or nothing beyond the floor holds."""
    gated = _gate_decision(candidate_gate=candidate_gate, candidate_failure=candidate_failure,
                           baseline_gate=baseline_gate, baseline_failure=baseline_failure, decode=decode)
    served = _serving_decision(agreement=agreement, failed=failed or {}, errors=errors or {})
    if gated is not None or served is not None:
        return gated or served  # type: ignore[return-value]
    if decode is None or not math.isfinite(decode.ratio):
        return "hold", "hold: not measured", "decode speed could not be measured on both images"
    rounds = _finite(decode.rounds)
    if len(rounds) < MIN_ROUNDS:
        return "hold", "hold: too few rounds", (f"decode tok/s per request {decode.ratio:.3f}x the baseline; {len(rounds)} "
                                                "rounds cannot tell this from noise (--runs 3 or more)")
    moves = {k.name: _direction(k, floor) for k in (decode, prefill, aggregate) if k is not None}
    text = "; ".join(_kpi_text(k) for k in (decode, prefill, aggregate) if k is not None)
    text += f"; noise floor {100 * floor:.1f}%"
    faster = [name for name, move in moves.items() if move == "faster"]
    slower = [name for name, move in moves.items() if move == "slower"]
    if slower and not faster:
        return "reject", "reject: slower", f"{text}: {' and '.join(slower)} slower beyond the noise floor in every round"
    if slower:
        return "hold", f"hold: trade-off ({', '.join(faster)} faster, {', '.join(slower)} slower)", (
            f"{text}: a trade-off for the workload to decide, not an uplift")
    if faster:
        return "promote", "promote", (f"{text}: {' and '.join(faster)} faster beyond the noise floor in every round, "
                                      "nothing slower; quality gates passed")
    return "hold", "hold: within noise", f"{text}: nothing beyond the noise floor in every round"


SPEED_KPIS = {"decode": "decode tok/s per request", "prefill": "prefill tok/s", "aggregate": "aggregate tok/s"}


def _direction(k: KPI, floor: float) -> str:
    """'faster' (median ratio at least 1 + floor and every round above 1), 'slower' (the mirror), or 'same'."""
    rounds = _finite(k.rounds)
    if not rounds or not math.isfinite(k.ratio):
        return "same"
    if k.ratio >= 1.0 + floor and min(rounds) > 1.0:
        return "faster"
    if k.ratio <= 1.0 - floor and max(rounds) < 1.0:
        return "slower"
    return "same"


def _kpi_text(k: KPI) -> str:
    rounds = _finite(k.rounds)
    spread = f" (rounds {min(rounds):.3f}-{max(rounds):.3f})" if rounds else ""
    return f"{SPEED_KPIS.get(k.name, k.name)} {k.ratio:.3f}x{spread}"


# ---------------------------------------------------------------- the record of a runtime A/B (ab.json)

AB_FORMAT: Literal["skupin-ab/1"] = "skupin-ab/1"
Role = Literal["baseline", "candidate"]


class ABSide(Frozen):
    """What one side was and did."""

    role: Role
    sku: str
    image: str = Field(description="The image as named on the command line")
    image_id: str
    served_by: tuple[str, ...] = Field(description="Image id of every server container that produced a number")
    engine: str
    engine_path: dict[str, str] = Field(description="What the probe said computed the model check (shown, not trusted)")
    launch: tuple[str, ...]
    weights: str
    gate: str = Field(description="The gate's decision: pass, fail, could_not_run, uncalibrated")
    gate_reason: str
    failing_check: str | None
    verdict_path: str | None = Field(description="The verdict's path under the A/B's folder; '(given)' when reused")
    verdict_reused: bool
    measured: bool
    not_measured: str = ""
    hourly_usd: float | None
    utilisation: float | None
    perf: tuple[PerfResult, ...] = Field(description="Per prompt length (settings order), all rounds merged")
    cost: tuple[CostSummary | None, ...] = Field(description="Per prompt length: $/1M output tokens at the best level")


class LengthAB(Frozen):
    """The A/B at one prompt length, per concurrency level."""

    prompt_tokens: int
    ab: ABResult


class RuntimeAB(Frozen):
    """The whole runtime A/B: both sides, the per-length tables, the KPIs, the noise floor and the decision."""

    format: Literal["skupin-ab/1"] = AB_FORMAT
    baseline: ABSide
    candidate: ABSide
    same: dict[str, str] = Field(description="What both SKUs share: hardware class, model, dtype, reference")
    settings: ABSettings
    order: tuple[str, ...] = Field(description="Per round, which image ran first: 'BA' or 'AB'")
    lengths: tuple[LengthAB, ...]
    kpis: tuple[KPI, ...]
    noise_floor: float
    noise_floor_basis: str
    isolation: str = Field("", description="How one side was kept from slowing the other while it was measured")
    requests: dict[str, int] = Field(default_factory=dict, description="Measured requests per side")
    failed_requests: dict[str, int] = Field(default_factory=dict, description="Requests that streamed nothing")
    output_agreement: float | None = Field(None, description="Share of the candidate's completions equal to the "
                                                             "baseline's on the same prompts")
    errors: dict[str, str] = Field(default_factory=dict, description="A side whose server failed during the A/B")
    decision: ABDecision
    decision_line: str
    reason: str
    host: str
    created: str
    tool_version: str
    wall_s: float

    def kpi(self, name: str) -> KPI | None:
        return next((k for k in self.kpis if k.name == name), None)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.decision]


# `skupin ab` exits with these (README, `skupin ab --help`): promote 0, hold 12, reject 13.
EXIT_CODES: dict[str, int] = {"promote": 0, "hold": 12, "reject": 13}


__all__ = ["ABLevel", "ABResult", "ab_from_runs", "interleaved_ab", "ABSettings", "KPI", "MIN_NOISE_FLOOR",
           "round_ratios", "noise_floor", "kpi", "decide", "ABSide", "LengthAB", "RuntimeAB", "EXIT_CODES",
           "MIN_ROUNDS", "MIN_AGREEMENT", "MAX_FAILED"]


# ---------------------------------------------------------------- report pieces (used by gates/report.py)


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{1000 * x:.1f}"


def serve_markdown(details: dict, *, plot_name: str | None = None) -> list[str]:
    """Markdown lines for the serve check's details: greedy comparison, speed table, cost, and the A/B table."""
    if not details:
        return []
    lines = ["", "## Serve check", ""]
    if details.get("launch"):
        lines += [f"Server: `{' '.join(details['launch'])}` (ready in {details.get('ready_s', 0):.1f} s, no network; "
                  "the client runs in its network namespace)."]
    greedy = details.get("greedy") or {}
    if greedy:
        lines += ["", f"Greedy continuations: {greedy.get('match')}/{greedy.get('prompts')} equal the reference, "
                  f"{greedy.get('near_tie')} accepted near ties, {greedy.get('diverged')} divergences; near-tie threshold "
                  f"{greedy.get('near_tie_threshold', 0):.3g} ({greedy.get('near_tie_threshold_source', '')}); "
                  f"compared by {', '.join(greedy.get('compared_by') or [])}."]
    logprobs = details.get("logprobs")
    lines += ["", f"Logprobs: {logprobs if isinstance(logprobs, str) else 'compared: ' + str(logprobs)}."]
    perf = details.get("perf") or {}
    if perf.get("levels"):
        lines += ["", "| concurrency | TTFT p50 (ms) | TTFT p99 (ms) | prefill tok/s | decode tok/s per request | "
                  "aggregate tok/s (reps) | spread |", "|---|---|---|---|---|---|---|"]
        for lv in perf["levels"]:
            reps = ", ".join(f"{a:.0f}" for a in lv.get("aggregate_tok_s_reps") or ())
            lines.append(
                f"| {lv['concurrency']} | {_ms(lv['ttft_p50_s'])} | {_ms(lv['ttft_p99_s'])} | "
                f"{lv['prefill_tok_s']:.0f} | {lv['decode_tok_s_per_request']:.1f} | "
                f"{lv['aggregate_tok_s']:.1f} ({reps}) | {100 * lv['spread']:.0f}% |"
            )
    cost = details.get("cost")
    if cost:
        lines += ["", f"Cost: **${cost['usd_per_1m_output_tokens']:.3g} per 1M output tokens** at ${cost['hourly_usd']:g}/h, "
                  f"utilisation {cost['utilisation']:.0%}, {cost['aggregate_tok_s']:.1f} tok/s (concurrency "
                  f"{cost['concurrency']}); {cost['formula']}."]
    ab = details.get("ab")
    if ab:
        lines += ["", f"### A/B vs `{ab['baseline_image'][:71]}`", "", f"{ab['summary']} (status {ab['status']}, "
                  f"order per round {' '.join(ab['order'])}).", "",
                  "| concurrency | decode tok/s cand / base | ratio (min-max) | aggregate ratio | TTFT p50 ms cand / base "
                  "| TTFT ratio |",
                  "|---|---|---|---|---|---|"]
        for lv in ab["levels"]:
            lines.append(f"| {lv['concurrency']} | {lv['candidate_decode_tok_s']:.1f} / {lv['baseline_decode_tok_s']:.1f} | "
                         f"{lv['decode_ratio']:.3f} ({lv['decode_ratio_min']:.3f}-{lv['decode_ratio_max']:.3f}) | "
                         f"{lv['aggregate_ratio']:.3f} | {_ms(lv['candidate_ttft_p50_s'])} / {_ms(lv['baseline_ttft_p50_s'])} | "
                         f"{lv['ttft_ratio']:.3f} |")
    if plot_name:
        lines += ["", f"![serve speed: tok/s and TTFT per concurrency]({plot_name})"]
    return lines


def plot_serve(details: dict, path) -> bool:
    """serve.png: decode and aggregate tok/s and TTFT p50 per concurrency (candidate, and baseline when A/B). False if no data."""
    perf = (details or {}).get("perf") or {}
    if not perf.get("levels"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"candidate": perf["levels"]}
    ab = details.get("ab")
    if ab:
        series["baseline"] = ab["baseline"]["levels"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for (name, levels), color in zip(series.items(), ("tab:blue", "tab:orange"), strict=False):
        xs = [lv["concurrency"] for lv in levels]
        axes[0].plot(xs, [lv["aggregate_tok_s"] for lv in levels], "o-", color=color, label=f"{name} aggregate")
        axes[0].plot(xs, [lv["decode_tok_s_per_request"] for lv in levels], "s--", color=color, label=f"{name} per request")
        for lv in levels:
            reps = lv.get("aggregate_tok_s_reps") or ()
            axes[0].scatter([lv["concurrency"]] * len(reps), reps, s=8, color=color, alpha=0.5)
        axes[1].plot(xs, [1000 * lv["ttft_p50_s"] for lv in levels], "o-", color=color, label=f"{name} p50")
        axes[1].plot(xs, [1000 * lv["ttft_p99_s"] for lv in levels], "^:", color=color, label=f"{name} p99")
    axes[0].set_title("output tok/s (dots: repetitions)", fontsize=10)
    axes[1].set_title("time to first token (ms)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    title = ab["summary"] if ab else "serve speed"
    fig.suptitle(title[:120], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
