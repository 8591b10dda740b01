"""Turn measured runs into detection power: calibrate on one split, decide on the held-out split, count with CIs.

Input: run records (bench/detection/runs.py), one per honest or swapped run, holding per prompt
every statistic of gates/judge/compare.py and every kernel op's error against the reference.

- `split`: the calibration set is what `skupin calibrate` runs (honest, boot 1, sdpa attention,
  batch 8 and 1, every thread count of that boot); everything else honest is held out (batch
  2/4/16/64, eager attention, the second boot). Swaps are never used for calibration.
- `calibrate`: skupin.calibration.calibrate.derive_entry_from_measurements on the calibration runs (the
  project's own method: margin x largest honest value, dtype floors, Clopper-Pearson honest rate).
- `decide`: the gate's own rules (gates.judge.verdict.judge_kernels, then judge_model with the hard
  bounds) on a subset of a run's prompts.
- `evaluate`: every held-out run cut into disjoint blocks of N prompts (a seeded permutation per
  run), one gate decision per block; counts of rejected/caught with two-sided 95% Clopper-Pearson
  intervals (blocks of one run share the run's systematic offset, so the intervals assume more
  independence than the data has; the per-run counts at N = 64 are reported too).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from skupin.calibration.calibrate import Measurement, derive_entry_from_measurements
from skupin.gates.judge.compare import ALL_STATS, DECISION_STATS, KernelResult, ModelStatistics
from skupin.gates.judge.tolerance import HardBounds, ToleranceEntry, ToleranceKey
from skupin.gates.judge.verdict import judge_kernels, judge_model, kernel_hard_failures

CALIBRATION_BATCHES = (1, 8)
DEFAULT_HARD = HardBounds()  # the gate's own calibration-free bounds


def load_records(paths: Iterable[Path]) -> list[dict]:
    """Every record of the given JSON-lines files (gzip-compressed when the name ends in .gz)."""
    out = []
    for path in paths:
        raw = Path(path).read_bytes()
        for line in (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode("utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def key_of(record: dict) -> tuple[str, str, str]:
    return record["class"], record["model"], record["dtype"]


def to_stats(record: dict) -> ModelStatistics:
    """The record's per-prompt statistics as gates.judge.compare.ModelStatistics."""
    per_prompt = {s: np.array([np.nan if v is None else v for v in record["stats"][s]], dtype=np.float64) for s in ALL_STATS}
    return ModelStatistics(per_prompt=per_prompt, available=tuple(record["available"]),
                           nonfinite=tuple(record.get("nonfinite", ())))


def to_kernels(record: dict) -> tuple[KernelResult, ...]:
    problems = record.get("kernel_problems", {})
    return tuple(KernelResult(op, v, op not in problems or "NaN" not in problems[op], problems.get(op, ""))
                 for op, v in sorted(record["kernels"].items()))


def subset(stats: ModelStatistics, idx: np.ndarray) -> ModelStatistics:
    """The statistics of the prompts `idx` only."""
    return ModelStatistics(
        per_prompt={s: v[idx] for s, v in stats.per_prompt.items()},
        available=tuple(s for s in stats.available if s != "kl_full" or np.isfinite(stats.per_prompt[s][idx]).any()),
        nonfinite=stats.nonfinite,
    )


def is_calibration(record: dict) -> bool:
    """The `skupin calibrate` recipe: honest, first boot, sdpa, batch 8 or 1 (any thread count)."""
    return (record["role"] == "honest" and record["boot"] == 1 and record["attn"] == "sdpa"
            and record["batch"] in CALIBRATION_BATCHES)


def split(records: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(calibration honest runs, held-out honest runs, swap runs)."""
    calib = [r for r in records if is_calibration(r)]
    held = [r for r in records if r["role"] == "honest" and not is_calibration(r)]
    swapped = [r for r in records if r["role"] == "swap"]
    return calib, held, swapped


def label(record: dict) -> str:
    t = f", threads {record['threads']}" if record.get("threads") else ""
    return f"boot {record['boot']}, batch {record['batch']}, {record['attn']}{t}"


def calibrate(*, records: list[dict], key: ToleranceKey, margin: float = 4.0, reference_sha256: str = "0" * 64,
              image: str = "in-process", date: str | None = None) -> ToleranceEntry:
    """The tolerance entry the project's calibration derives from these honest runs."""
    measured = [Measurement(label=label(r), stats=to_stats(r), kernels=to_kernels(r), env={}) for r in records]
    return derive_entry_from_measurements(key=key, measurements=measured, reference_sha256=reference_sha256,
                                          margin=margin, image=image, date=date)


def decide(*, stats: ModelStatistics, kernels: tuple[KernelResult, ...], entry: ToleranceEntry,
           hard: HardBounds = DEFAULT_HARD) -> str:
    """The gate's decision: 'pass', or what failed first ('hard' bounds, calibrated 'kernels', 'calibrated' model).

    In the gate's order: the kernel battery's hard bounds (no calibration), its calibrated
    tolerances, then the model check (hard bounds first, then the calibrated decision).
    """
    if kernel_hard_failures(results=kernels, hard=hard):
        return "hard"
    if judge_kernels(results=kernels, entry=entry).status != "pass":
        return "kernels"
    check, _, _ = judge_model(stats=stats, entry=entry, hard=hard, dtype=entry.key.dtype)
    if check.status == "pass":
        return "pass"
    return "hard" if check.reason.startswith("hard bound") else "calibrated"


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (no overflow for large n)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    terms = [base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided exact (Clopper-Pearson) confidence interval of a binomial rate after k of n."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"{k} successes out of {n} trials")
    if 2 * k > n:  # symmetry keeps the sums short
        lo, hi = clopper_pearson(n - k, n, confidence)
        return 1.0 - hi, 1.0 - lo
    tail = (1 - confidence) / 2

    def bisect(f):
        lo, hi = 0.0, 1.0
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else bisect(lambda p: 1.0 - binom_cdf(k - 1, n, p) < tail)
    upper = bisect(lambda p: binom_cdf(k, n, p) > tail)
    return lower, upper


def blocks(num_prompts: int, size: int, *, seed: int) -> list[np.ndarray]:
    """Disjoint blocks of `size` prompts from a seeded permutation (the remainder is dropped)."""
    perm = np.random.default_rng(seed).permutation(num_prompts)
    return [perm[i:i + size] for i in range(0, num_prompts - size + 1, size)]


def count(outcomes: list[str], *, positive: bool) -> dict:
    """{caught|rejected, total, rate, ci95, by} of a list of decisions."""
    k = sum(o != "pass" for o in outcomes)
    n = len(outcomes)
    lo, hi = clopper_pearson(k, n)
    by = {o: outcomes.count(o) for o in sorted(set(outcomes)) if o != "pass"}
    return {("caught" if positive else "rejected"): k, "total": n, "rate": k / n if n else None,
            "ci95": [round(lo, 6), round(hi, 6)], "by": by}


def decisions(*, records: list[dict], entry: ToleranceEntry, size: int, seed: int = 0) -> list[str]:
    """One gate decision per disjoint block of `size` prompts of every run."""
    out = []
    for i, r in enumerate(records):
        stats, kernels = to_stats(r), to_kernels(r)
        for idx in blocks(stats.num_prompts, size, seed=seed + i):
            out.append(decide(stats=subset(stats, np.sort(idx)), kernels=kernels, entry=entry))
    return out


def per_prompt_exceed(records: list[dict], entry: ToleranceEntry) -> dict:
    """Prompts above the per-prompt threshold of any decision statistic (a 'per sample' rate, as Gonka reports)."""
    k = n = 0
    for r in records:
        stats = to_stats(r)
        over = np.zeros(stats.num_prompts, dtype=bool)
        for s in DECISION_STATS:
            if s in stats.available and s in entry.model.per_prompt:
                v = stats.per_prompt[s]
                over |= ~np.isfinite(v) | (v > entry.model.per_prompt[s])
        k += int(over.sum())
        n += int(over.size)
    lo, hi = clopper_pearson(k, n)
    return {"above": k, "prompts": n, "rate": k / n if n else None, "ci95": [round(lo, 6), round(hi, 6)]}


def margins(records: list[dict], entry: ToleranceEntry, *, block: int = 8) -> dict:
    """Per statistic: min over prompts of value / per-prompt threshold, and min over 8-prompt blocks of mean / mean bound."""
    out = {}
    for s in DECISION_STATS:
        if s not in entry.model.per_prompt:
            continue
        values = [to_stats(r).per_prompt[s] for r in records if s in r["available"]]
        if not values:
            continue
        per_prompt = min(float(np.nanmin(v)) for v in values) / entry.model.per_prompt[s]
        means = [float(np.mean(v[idx])) for i, v in enumerate(values) for idx in blocks(len(v), block, seed=i)]
        out[s] = {"per_prompt": _sig(per_prompt), f"mean_of_{block}": _sig(min(means) / entry.model.mean[s])}
    return out


def honest_max_ratio(records: list[dict], entry: ToleranceEntry) -> dict:
    """Per statistic: the largest held-out honest value / per-prompt threshold (below 1 = no exceedance)."""
    out = {}
    for s in DECISION_STATS:
        if s in entry.model.per_prompt:
            vals = [float(np.nanmax(to_stats(r).per_prompt[s])) for r in records if s in r["available"]]
            if vals:
                out[s] = _sig(max(vals) / entry.model.per_prompt[s])
    return out


def _sig(x: float) -> float:
    return float(f"{x:.4g}") if math.isfinite(x) else x
