"""Interleaved A/B of two images' servers on the same host: per-level ratios with their spread, and the regression bound.

Both servers are booted side by side (an idle server costs no CPU); the load then alternates
between them round by round in the order B A, A B, B A, ... (B = baseline, A = candidate), so a
slow drift of the host (thermal, noisy neighbours) hits both equally. Each round runs the full
set of concurrency levels once per image. Per round and level the ratio is candidate / baseline
of the median per-request decode tok/s (and of aggregate tok/s and TTFT p50). The headline decode
ratio is, per round, the geometric mean over levels; the verdict reports its median over rounds
and the spread (min-max over rounds). With a bound `max_decode_regression` the A/B fails when the
median decode ratio is below 1 - bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from gates.perf import PerfResult, PerfSettings, merge_perf


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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
    decode_ratio: float = Field(description="Median over rounds of the per-round geometric mean decode ratio")
    decode_ratio_spread: tuple[float, float] = Field(description="(min, max) over rounds of that per-round ratio")
    bound: float | None = Field(description="max_decode_regression of the SKU (None: report only)")
    status: Literal["pass", "fail", "report"]
    summary: str
    candidate: PerfResult
    baseline: PerfResult


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _geomean(values: Sequence[float]) -> float:
    good = [v for v in values if v > 0 and math.isfinite(v)]
    return float(math.exp(sum(math.log(v) for v in good) / len(good))) if good else float("nan")


def ab_from_runs(*, candidate_runs: Sequence[PerfResult], baseline_runs: Sequence[PerfResult], bound: float | None,
                 candidate_image: str, baseline_image: str, order: Sequence[str]) -> ABResult:
    """The A/B result from paired rounds (candidate_runs[i] and baseline_runs[i] ran in the same round)."""
    per_round: list[float] = []
    per_level: dict[int, dict[str, list[float]]] = {}
    for cand, base in zip(candidate_runs, baseline_runs):
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
        per_round.append(_geomean(ratios))
    cand_all, base_all = merge_perf(candidate_runs), merge_perf(baseline_runs)
    levels = []
    for c, d in sorted(per_level.items()):
        cl, bl = cand_all.level(c), base_all.level(c)
        levels.append(ABLevel(concurrency=c, decode_ratio=float(np.nanmedian(d["decode"])),
                              decode_ratio_min=float(np.nanmin(d["decode"])), decode_ratio_max=float(np.nanmax(d["decode"])),
                              aggregate_ratio=float(np.nanmedian(d["aggregate"])), ttft_ratio=float(np.nanmedian(d["ttft"])),
                              candidate_decode_tok_s=cl.decode_tok_s_per_request, baseline_decode_tok_s=bl.decode_tok_s_per_request,
                              candidate_aggregate_tok_s=cl.aggregate_tok_s, baseline_aggregate_tok_s=bl.aggregate_tok_s,
                              candidate_ttft_p50_s=cl.ttft_p50_s, baseline_ttft_p50_s=bl.ttft_p50_s))
    ratio = float(np.nanmedian(per_round)) if per_round else float("nan")
    spread = (float(np.nanmin(per_round)), float(np.nanmax(per_round))) if per_round else (float("nan"),) * 2
    text = (f"decode tok/s ratio candidate/baseline {ratio:.3f} (rounds {spread[0]:.3f}-{spread[1]:.3f}, "
            f"{len(per_round)} interleaved rounds)")
    if bound is None:
        status = "report"
        text += "; no regression bound set (gate.serve.max_decode_regression)"
    elif not math.isfinite(ratio) or ratio < 1.0 - bound:
        status = "fail"
        text += f" is below the bound 1 - {bound:g} = {1 - bound:.3f}"
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


__all__ = ["ABLevel", "ABResult", "ab_from_runs", "interleaved_ab"]
