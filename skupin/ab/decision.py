"""The decision of a runtime A/B (`skupin ab`): its settings, the noise floor, the KPIs, the decision and the record (ab.json).

The pure half of skupin/ab/runtime.py; the per-level interleaved comparison it builds on is the serve
check's (gates/serving/ab.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from skupin.common.model import Frozen
from skupin.gates.serving.ab import ABResult, safe_ratio
from skupin.gates.serving.perf import CostSummary, LevelResult, PerfResult, PerfSettings

# ---------------------------------------------------------------- runtime A/B across SKUs (`skupin ab`)
# The pure half of skupin/ab/runtime.py: the settings, the noise floor, the KPIs and the decision.

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
                    ratios.append(safe_ratio(metric(lv), metric(other)))
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
