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
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from skupin.common.model import Frozen
from skupin.gates.serving.perf import PerfResult, PerfSettings, merge_perf


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


def safe_ratio(a: float, b: float) -> float:
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
            r = safe_ratio(lv.decode_tok_s_per_request, other.decode_tok_s_per_request)
            d["decode"].append(r)
            d["aggregate"].append(safe_ratio(lv.aggregate_tok_s, other.aggregate_tok_s))
            d["ttft"].append(safe_ratio(lv.ttft_p50_s, other.ttft_p50_s))
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


def plot_serve(details: dict[str, Any], path: Path) -> bool:
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
