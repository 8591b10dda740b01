"""The decision of a runtime A/B (`skupin ab`): its settings, the noise floor, the KPIs, the decision and the record (ab.json).

The pure half of skupin/ab/runtime.py; the per-level interleaved comparison it builds on is the serve
check's (gates/serving/ab.py)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from skupin.ab.cpus import CpuPlan
from skupin.common.model import Frozen
from skupin.gates.serving.ab import ABResult, safe_ratio
from skupin.gates.serving.perf import CostSummary, LevelResult, PerfResult, PerfSettings

# ---------------------------------------------------------------- runtime A/B across SKUs (`skupin ab`)
# The pure half of skupin/ab/runtime.py: the settings, the noise floor, the KPIs and the decision.

# the capacity block's default daily output volume: 100M tokens/day, a small production service (about 1,160 tok/s
# around the clock); --volume sets the buyer's own
DEFAULT_VOLUME = 1e8
MIN_NOISE_FLOOR = 0.02  # a 2% move is never called an uplift on a shared host, however quiet the rounds were
ABDecision = Literal["promote", "hold", "reject"]


# No round of an A/B starts after this many seconds of rounds, whatever the settings ask (the rounds left are then
# missing, which the decision says): the servers' in-container deadline is set past it (skupin/ab/runtime.py).
MAX_ROUNDS_S = 11 * 3600


class ABSettings(Frozen):
    """How much load `skupin ab` generates: every round runs every prompt length at every concurrency, once per image."""

    runs: int = Field(3, ge=1, le=50, description="Interleaved rounds (B A, A B, ...)")
    concurrency: tuple[int, ...] = Field((1, 2, 4), min_length=1)
    prompt_lengths: tuple[int, ...] = Field((64, 256), min_length=1, description="Prompt tokens per request")
    requests: int = Field(8, ge=1, description="Measured requests per level, round and image")
    max_tokens: int = Field(32, ge=2, description="Output tokens per request")
    warmup: int = Field(2, ge=0, description="Unmeasured requests per image after each boot of its server, before "
                                             "its first round")
    volume: float = Field(DEFAULT_VOLUME, gt=0, le=1e15,
                          description="Output tokens per day the capacity and cost block is sized for (--volume)")
    target_ci: float | None = Field(None, gt=0, lt=1, description="Add rounds past `runs` until the decode ratio's 95% "
                                    "interval lies within +- this fraction of its centre (--target-ci)")
    max_runs: int = Field(50, ge=1, le=200, description="With target_ci: the most rounds (--max-runs)")
    budget_s: float | None = Field(None, gt=0, le=MAX_ROUNDS_S,
                                   description="With target_ci: no round past `runs` starts after this many seconds "
                                               "since the first round (with restart_every: no boot past `runs`; "
                                               "--budget-s; at most MAX_ROUNDS_S, which bounds every A/B's rounds)")
    cpu_plan: CpuPlan | None = Field(None, description="The servers' CPUs and the client's (--server-cpus); None: the gate's "
                                                   "CPU quota, every CPU shared")
    restart_every: int | None = Field(None, ge=2, le=25,
                                      description="Rounds per boot: after this many rounds both servers are stopped and "
                                                  "booted again (--restart-every; even), and every interval is over "
                                                  "boots, not rounds; None: one boot for every round")

    @field_validator("concurrency", "prompt_lengths")
    @classmethod
    def _once_each(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ValueError(f"{', '.join(map(str, twice))} given more than once (each level or length is one slice)")
        return values

    @field_validator("restart_every")
    @classmethod
    def _even(cls, value: int | None) -> int | None:
        if value is not None and value % 2:
            raise ValueError(f"{value} is odd: a boot's rounds alternate B A, A B, so an even count gives each image "
                             "the first turn equally often in every boot")
        return value

    @model_validator(mode="after")
    def _max_runs_covers_runs(self) -> ABSettings:
        if self.max_runs < self.runs:
            raise ValueError(f"max_runs {self.max_runs} is below runs {self.runs}: runs rounds always run, max_runs is "
                             "the most that target_ci may add up to")
        every = self.restart_every
        if every is not None:
            if self.runs < 2 * every or self.runs % every:
                raise ValueError(f"runs {self.runs} with restart_every {every}: give whole boots, two at least (runs "
                                 f"{2 * every}, {3 * every}, ...; an interval over boots needs two, and three or more "
                                 "make it useful)")
            if self.target_ci is not None and self.max_runs % every:
                raise ValueError(f"max_runs {self.max_runs} with restart_every {every}: give whole boots (a multiple of "
                                 f"{every})")
        return self

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
    ci_low: float | None = Field(None, description="95% interval of the ratio, low end (ratio_interval); None with "
                                                   "fewer than two rounds")
    ci_high: float | None = None


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


@functools.lru_cache(maxsize=64)
def t_quantile(df: int, p: float = 0.975) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (no scipy here): its density integrated with Simpson's
    rule and the quantile found by bisection; exact to 1e-4 for df >= 1 (t(1) 0.975 = 12.706, t(2) = 4.303)."""
    if df < 1:
        return float("nan")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        steps = 2000
        h = x / steps
        dens = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(steps + 1)]
        return 0.5 + h / 3 * (dens[0] + dens[-1] + 4 * sum(dens[1:-1:2]) + 2 * sum(dens[2:-1:2]))

    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def ratio_interval(rounds: Sequence[float], boots: Sequence[int] | None = None,
                   level: float = 0.95) -> tuple[float, float] | None:
    """The `level` confidence interval of a candidate/baseline ratio from its per-round ratios; None with fewer than
    two finite positive rounds (or, over boots, two boots).

    `boots[i]` names the boot (the pair of server processes) that measured round i. With rounds from two boots or
    more, the unit is the boot: each boot's mean log ratio, and Student's t over those (df = boots - 1). Whatever a
    start of a server fixes for its whole life (an offset of its speed) is shared by the rounds of one boot, so their
    spread cannot show it and an interval over them covers the truth less often than it says when it exists; over
    boots it is part of the spread (docs/BENCHMARKS.md, "Restarts", measures it). Boots with no finite round count for
    nothing.

    A paired t interval on the log ratios, over rounds: each round measures both images back to back under the same
    host state (B A, A B, ...: the round is the pair, and the unit that is independent of the others), the log makes
    a ratio and its inverse symmetric (0.8x and 1.25x are the same distance from 1), and Student's t pays for having
    few rounds: with 3 rounds the interval is exp(mean +- 4.30 sd / sqrt(3)). Chosen over a bootstrap over rounds,
    whose percentile interval over 3-10 values can never be wider than their range and so covers far less than 95%
    (with 3 rounds it is the min-max, which holds the true median only 75% of the time). Deterministic: no seed."""
    if boots is not None and len(set(boots)) > 1:
        logs = [float(np.mean(v)) for v in logs_by_boot(rounds, boots).values()]
    else:
        logs = [math.log(r) for r in rounds if math.isfinite(r) and r > 0]
    if len(logs) < 2:
        return None
    mean = float(np.mean(logs))
    half = t_quantile(len(logs) - 1, 0.5 + level / 2) * float(np.std(logs, ddof=1)) / math.sqrt(len(logs))
    return math.exp(mean - half), math.exp(mean + half)


def logs_by_boot(rounds: Sequence[float], boots: Sequence[int]) -> dict[int, list[float]]:
    """The log of each finite positive ratio, grouped by the boot that measured it (a boot without one is absent)."""
    out: dict[int, list[float]] = {}
    for r, boot in zip(rounds, boots, strict=True):
        if math.isfinite(r) and r > 0:
            out.setdefault(boot, []).append(math.log(r))
    return out


def interval_half_width(rounds: Sequence[float], boots: Sequence[int] | None = None) -> float | None:
    """The larger distance of ratio_interval's ends from its (geometric) centre, as a fraction; None without one."""
    ci = ratio_interval(rounds, boots)
    if ci is None:
        return None
    centre = math.sqrt(ci[0] * ci[1])
    return max(ci[1] / centre - 1.0, 1.0 - ci[0] / centre)


RoundsStop = Literal["runs", "target_ci", "max_runs", "budget", "cap", "failed"]


def rounds_stop(*, settings: ABSettings, ratios: Sequence[float], elapsed_s: float,
                boots: Sequence[int] | None = None) -> RoundsStop | None:
    """None while the A/B runs another round after len(ratios) (each round's decode ratio, round_ratios); else why the
    rounds end: 'runs' (the `runs` asked, no target_ci), 'target_ci' (the decode ratio's interval is within it),
    'max_runs' or 'budget' (spent before the interval was), 'cap' (MAX_ROUNDS_S of rounds before any of those).
    ('failed', a side's failure, is the runtime's to record: no rule here ends rounds for it.)

    Always up to `runs`; past it only with a `target_ci`, while the interval is wider than it, below `max_runs` and
    within `budget_s`. With `restart_every` the interval is over `boots` (each ratio's boot; boot_numbers by default)
    and the rounds end only after whole boots (runs and max_runs are whole boots; the budget is looked at between
    boots), so every boot ran all its rounds; only the cap cuts a boot short.
    Rounds sized by the noise the host shows, not a fixed count: a quiet host stops early, a noisy
    one runs until the interval is tight enough or the budget is spent. Stopping on the interval's width (not on
    whether it excludes 1) keeps the rule blind to the answer; what optional stopping still does to coverage is for
    the calibration bench to measure (docs/SERVE.md)."""
    done = len(ratios)
    if done >= settings.runs:
        if settings.target_ci is None:
            return "runs"
        every = settings.restart_every
        if every is None or done % every == 0:  # with restarts: only after whole boots (runs >= 2 boots)
            half = interval_half_width(ratios, boot_numbers(settings, done) if boots is None else boots)
            if half is not None and half <= settings.target_ci:
                return "target_ci"
            if done >= settings.max_runs:
                return "max_runs"
            if settings.budget_s is not None and elapsed_s >= settings.budget_s:
                return "budget"
    return "cap" if elapsed_s >= MAX_ROUNDS_S else None


def boot_numbers(settings: ABSettings, count: int) -> list[int]:
    """The boot (1-based) of each of the first `count` rounds: all 1 without restart_every."""
    every = settings.restart_every or max(count, 1)
    return [1 + r // every for r in range(count)]


def stop_text(stop: RoundsStop, settings: ABSettings, rounds: int) -> str:
    """A buyer's words for why `rounds` rounds were run (rounds_stop's answer, or 'failed')."""
    target = f"+-{100 * settings.target_ci:g}%" if settings.target_ci is not None else ""
    return {
        "failed": f"ended after {rounds} rounds by a side that failed",
        "runs": f"{rounds} rounds, as asked by --runs {settings.runs}",
        "target_ci": f"stopped after {rounds} rounds: the decode ratio's 95% interval was within {target}",
        "max_runs": f"stopped at --max-runs {settings.max_runs} before the decode ratio's interval was within {target}",
        "budget": f"stopped after {rounds} rounds: the --budget-s {settings.budget_s:g} s was spent before the decode "
                  f"ratio's interval was within {target}" if settings.budget_s is not None else "",
        "cap": f"stopped after {rounds} rounds at the {MAX_ROUNDS_S / 3600:g} h every A/B's rounds are held to "
               "(MAX_ROUNDS_S), before what was asked",
    }[stop]


def kpi(*, name: str, unit: str, higher_is_better: bool, candidate: Sequence[Sequence[PerfResult]],
        baseline: Sequence[Sequence[PerfResult]], metric: Callable[[LevelResult], float],
        pooled: Callable[[Sequence[LevelResult]], float], scale: float = 1.0, boots: Sequence[int] | None = None) -> KPI:
    """The KPI from paired rounds: per-round ratios (times `scale`, e.g. the ratio of the hourly rates for a cost), their
    95% interval (ratio_interval, over `boots` when the rounds came from several), and each side's pooled value over
    every level it measured."""
    rounds = [scale * r for r in round_ratios(candidate=candidate, baseline=baseline, metric=metric)]
    finite = _finite(rounds)
    ci = ratio_interval(rounds, boots)

    def levels(runs: Sequence[Sequence[PerfResult]]) -> list[LevelResult]:
        return [lv for r in runs for perf in r for lv in perf.levels]

    return KPI(name=name, unit=unit, higher_is_better=higher_is_better,
               ratio=float(np.median(finite)) if finite else float("nan"), rounds=tuple(rounds),
               baseline=pooled(levels(baseline)), candidate=pooled(levels(candidate)),
               ci_low=ci[0] if ci else None, ci_high=ci[1] if ci else None)


# ---------------------------------------------------------------- decisions per slice (prompt length x concurrency)

PrimaryKPI = Literal["decode", "prefill", "aggregate", "ttft_p50"]
# the primary KPI's per-level metric and whether higher is better
PRIMARY_METRICS: dict[str, tuple[Callable[[LevelResult], float], bool]] = {
    "decode": (lambda lv: lv.decode_tok_s_per_request, True),
    "prefill": (lambda lv: lv.prefill_tok_s, True),
    "aggregate": (lambda lv: lv.aggregate_tok_s, True),
    "ttft_p50": (lambda lv: lv.ttft_p50_s, False),
}


class SliceAB(Frozen):
    """The primary KPI at one prompt length and concurrency level: per-round ratio candidate / baseline, its interval, and
    whether the candidate is better, worse or not distinguishable there."""

    prompt_tokens: int
    concurrency: int
    kpi: str
    ratio: float = Field(description="Median over rounds of candidate / baseline at this slice")
    rounds: tuple[float, ...]
    ci_low: float | None
    ci_high: float | None
    move: Literal["better", "worse", "same", "not measured"] = Field(
        description="worse: the whole 95% interval on the losing side of 1 (below for higher-is-better)")


def slice_decisions(*, candidate: Sequence[Sequence[PerfResult]], baseline: Sequence[Sequence[PerfResult]],
           prompt_lengths: Sequence[int], primary: str = "decode",
           boots: Sequence[int] | None = None) -> tuple[SliceAB, ...]:
    """The primary KPI per (prompt length, concurrency): one ratio per round (candidate[r][i] against baseline[r][i]) and
    its ratio_interval (over `boots`, the boot of each round, when there are several).
    A slice is worse when its interval lies wholly on the losing side of 1, better in the mirror
    case, else the same: a per-slice regression is not hidden by a headline median over slices."""
    metric, higher = PRIMARY_METRICS[primary]
    out = []
    for i, length in enumerate(prompt_lengths):
        if not candidate or not baseline:
            break
        for lv in candidate[0][i].levels:
            rounds = []
            for cand_round, base_round in zip(candidate, baseline, strict=True):
                c, b = cand_round[i].level(lv.concurrency), base_round[i].level(lv.concurrency)
                rounds.append(safe_ratio(metric(c), metric(b)) if c is not None and b is not None else float("nan"))
            finite = _finite(rounds)
            ci = ratio_interval(rounds, boots)
            move: Literal["better", "worse", "same", "not measured"] = "not measured" if ci is None else "same"
            if ci is not None and (ci[1] < 1.0 if higher else ci[0] > 1.0):
                move = "worse"
            elif ci is not None and (ci[0] > 1.0 if higher else ci[1] < 1.0):
                move = "better"
            out.append(SliceAB(prompt_tokens=length, concurrency=lv.concurrency, kpi=primary,
                               ratio=float(np.median(finite)) if finite else float("nan"), rounds=tuple(rounds),
                               ci_low=ci[0] if ci else None, ci_high=ci[1] if ci else None, move=move))
    return tuple(out)


def slice_name(s: SliceAB) -> str:
    return f"{s.prompt_tokens} tok x c{s.concurrency}"


# ---------------------------------------------------------------- capacity and cost (seed 001's cost model)

HOURS_PER_MONTH = 730.0


class CapacitySide(Frozen):
    """What one side needs to serve the daily volume, from its measured throughput and its SKU's cost block."""

    tok_s_per_server: float = Field(description="Best-level aggregate output tok/s of one server, median over prompt "
                                                "lengths")
    devices_per_server: int
    hourly_usd: float = Field(description="Per device-hour")
    utilisation: float
    servers: int = Field(description="ceil(volume / (tok/s x 86400 x utilisation)): whole servers are rented")
    devices: int
    monthly_usd: float = Field(description="devices x hourly_usd x 730 h")
    usd_per_1m_output_tokens: float


class Capacity(Frozen):
    """Seed 001's cost model at the asked daily volume, for both sides, and the candidate's saving."""

    volume_tokens_per_day: float
    baseline: CapacitySide | None
    candidate: CapacitySide | None
    monthly_saving_usd: float | None = Field(description="baseline monthly - candidate monthly (negative: it costs more)")
    formula: str = ("servers = ceil(volume / (tok/s x 86400 x utilisation)); monthly = servers x devices per server x "
                    "hourly_usd x 730 h; $/1M = hourly_usd x devices / (tok/s x 3600 x utilisation) x 1e6")
    missing: str = Field("", description="Why a side has no capacity (no cost block, nothing measured)")


def capacity_side(*, tok_s: float, devices: int, hourly_usd: float | None, utilisation: float | None,
                  volume: float) -> CapacitySide | None:
    """One side's servers, devices and monthly cost for `volume` output tokens a day; None without a rate or speed."""
    if hourly_usd is None or not math.isfinite(tok_s) or tok_s <= 0:
        return None
    util = utilisation if utilisation is not None else 0.6
    servers = max(1, math.ceil(volume / (tok_s * 86400.0 * util)))
    return CapacitySide(tok_s_per_server=tok_s, devices_per_server=devices, hourly_usd=hourly_usd, utilisation=util,
                        servers=servers, devices=servers * devices,
                        monthly_usd=servers * devices * hourly_usd * HOURS_PER_MONTH,
                        usd_per_1m_output_tokens=hourly_usd * devices / (tok_s * 3600.0 * util) * 1e6)


def capacity(*, volume: float, baseline: CapacitySide | None, candidate: CapacitySide | None) -> Capacity:
    missing = [role for role, side in (("baseline", baseline), ("candidate", candidate)) if side is None]
    saving = baseline.monthly_usd - candidate.monthly_usd if baseline is not None and candidate is not None else None
    return Capacity(volume_tokens_per_day=volume, baseline=baseline, candidate=candidate, monthly_saving_usd=saving,
                    missing=(f"{' and '.join(missing)}: no cost block or nothing measured" if missing else ""))


MIN_ROUNDS = 3  # with fewer, "every round faster" happens by chance too often (two rounds: one in four)
# share of the candidate's completions equal to the baseline's on the same prompt, whitespace aside (same weights,
# greedy). Measured on this CPU under load (32-token completions of 64- and 256-token prompts): honest transformers vs
# vLLM agreed on 100% this way and on 62.5% as exact text; llama.cpp's streamed pieces place spaces differently again.
# A guard against a runtime that answers the A/B's load with other text, not a quality check (the gate is).
MIN_AGREEMENT = 0.8
MAX_FAILED = 0.05  # share of a side's requests that may stream nothing
# A completion is short when the host's count of its streamed text (gates/serving/perf.py tokenizer_counter) is below
# max_tokens by more than this share of it (at least 2 tokens): every engine's requests forbid an EOS stop (ignore_eos,
# min_tokens, min_new_tokens: skupin/engines/), so an honest server streams max_tokens, and the host count of honest
# text falls short of the generated count only through the tokenizer round trip. Measured on tiny-llama's greedy
# continuations of 96 prompts (16, 64 and 256 tokens): at 32 output tokens 1 of 96 counted below 32, by 6 (19%; a
# continuation that repeats two-letter pieces the tokenizer merges back), at 8-64 tokens never by more than 6 either.
# Against a real `transformers serve` 5.24.0 (min_new_tokens set, 32 tokens asked, 32 prompts each of 64 and 256
# tokens): 63 of 64 completions counted 32 or more; one counted 26 (its 32 generated tokens streamed as 26 text pieces,
# usage saying 32). 25% covers that with margin; a server that streams 8 tokens of 32 is 75% short.
HOST_COUNT_SLACK = 0.25
MAX_SHORT = 0.05  # share of a side's completions that may be short (a rare degenerate round trip) before it is named


def min_host_tokens(max_tokens: int) -> int:
    """The fewest host-counted tokens an honest completion of `max_tokens` streams (HOST_COUNT_SLACK)."""
    return max_tokens - max(2, math.ceil(HOST_COUNT_SLACK * max_tokens))


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


def _serving_decision(*, agreement: float | None, failed: dict[str, float], errors: dict[str, str],
                      short: dict[str, float] | None = None) -> tuple[ABDecision, str, str] | None:
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
    short = short or {}
    if short.get("candidate", 0.0) > MAX_SHORT:
        return "reject", "reject: candidate under-generates", (
            f"{100 * short['candidate']:.0f}% of the candidate's completions streamed fewer tokens than asked (counted "
            f"on the host from the streamed text with the model's tokenizer, not from the server's usage; at most "
            f"{100 * MAX_SHORT:.0f}% may fall more than {100 * HOST_COUNT_SLACK:.0f}% short): its tok/s is not for the "
            "work asked of it")
    if short.get("baseline", 0.0) > MAX_SHORT:
        return "hold", "hold: baseline under-generates", (
            f"{100 * short['baseline']:.0f}% of the baseline's completions streamed fewer tokens than asked (host count): "
            "an A/B against it proves nothing")
    if agreement is not None and agreement < MIN_AGREEMENT:
        return "reject", "reject: outputs differ from the baseline's", (
            f"only {100 * agreement:.0f}% of the candidate's greedy completions in the rounds equal the baseline's on the "
            f"same prompts (at least {100 * MIN_AGREEMENT:.0f}% for the same weights): its speed was not measured on "
            "the answers the gate checked")
    return None


def decide(*, candidate_gate: str, candidate_failure: str, baseline_gate: str, baseline_failure: str,
           decode: KPI | None, prefill: KPI | None, floor: float, aggregate: KPI | None = None,
           agreement: float | None = None,
           failed: dict[str, float] | None = None, errors: dict[str, str] | None = None,
           short: dict[str, float] | None = None, slices: Sequence[SliceAB] = (), rounds_asked: int = 0,
           rounds_note: str = "") -> tuple[ABDecision, str, str]:
    """(decision, decision line, reason). The candidate's quality gate comes first: a candidate that did not pass is
    rejected however fast it is. Then what the rounds showed of each side's serving: a side that failed during them, or
    streamed nothing for more than MAX_FAILED of its requests, or (candidate) whose completions mostly differ from the
    baseline's on the same prompts, or that streamed fewer tokens than asked (`short`: share of completions the host
    counted short, min_host_tokens). Speed, with at least MIN_ROUNDS rounds, over three KPIs kept apart (decode tok/s
    per request, prefill tok/s, aggregate tok/s): each is faster (median ratio at least 1 + floor and every round above
    1), slower (the mirror) or the same. Promote when at least one is faster, none slower **and no slice** (prompt
    length x concurrency) is worse on the primary KPI beyond its 95% interval (`slices`); such a slice turns a promote
    into a trade-off naming it. Reject when some KPIs are slower and none faster; a trade-off (some of each) or nothing
    beyond the floor holds. A promote also needs a decode ratio in each of the `rounds_asked` rounds (else 'hold: rounds
    missing'); `rounds_note` (rounds_note: rounds that failed or measured one side only) ends every reason it
    concerns, so no decision rests on fewer rounds than asked without saying so."""
    decision, line, reason = _decide(
        candidate_gate=candidate_gate, candidate_failure=candidate_failure, baseline_gate=baseline_gate,
        baseline_failure=baseline_failure, decode=decode, prefill=prefill, floor=floor, aggregate=aggregate,
        agreement=agreement, failed=failed, errors=errors, short=short, slices=slices, rounds_asked=rounds_asked)
    return decision, line, f"{reason} ({rounds_note})" if rounds_note else reason


def _decide(*, candidate_gate: str, candidate_failure: str, baseline_gate: str, baseline_failure: str,
            decode: KPI | None, prefill: KPI | None, floor: float, aggregate: KPI | None, agreement: float | None,
            failed: dict[str, float] | None, errors: dict[str, str] | None, short: dict[str, float] | None,
            slices: Sequence[SliceAB], rounds_asked: int) -> tuple[ABDecision, str, str]:
    gated = _gate_decision(candidate_gate=candidate_gate, candidate_failure=candidate_failure,
                           baseline_gate=baseline_gate, baseline_failure=baseline_failure, decode=decode)
    served = _serving_decision(agreement=agreement, failed=failed or {}, errors=errors or {}, short=short)
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
    worse = [sl for sl in slices if sl.move == "worse"]
    if faster and worse:
        named = ", ".join(slice_name(sl) for sl in worse)
        return "hold", f"hold: trade-off ({', '.join(faster)} faster; slices {named} worse)", (
            f"{text}: {' and '.join(faster)} faster, but {SPEED_KPIS.get(worse[0].kpi, worse[0].kpi)} is worse beyond its "
            f"95% interval at {named} (" + "; ".join(f"{slice_name(sl)} {sl.ratio:.3f}x, {_ci(sl.ci_low, sl.ci_high)}"
                                                     for sl in worse) + "): a trade-off for the workload to decide")
    if faster and len(rounds) < rounds_asked:
        return "hold", "hold: rounds missing", (
            f"{text}: {' and '.join(faster)} faster, but only {len(rounds)} of the {rounds_asked} asked rounds have a "
            "decode ratio of both sides: a promote rests on every round asked for")
    if faster:
        return "promote", "promote", (f"{text}: {' and '.join(faster)} faster beyond the noise floor in every round, "
                                      "nothing slower, no slice worse beyond its interval; quality gates passed")
    return "hold", "hold: within noise", f"{text}: nothing beyond the noise floor in every round"


DECISION_RULE = (
    "In order: a candidate that fails its quality gate is rejected however fast it is; an uncalibrated or unrun gate, "
    "or a baseline that is not verified, holds. A side whose server fails, that streams nothing for more than "
    f"{100 * MAX_FAILED:.0f}% of its requests, or streams fewer tokens than asked in more than {100 * MAX_SHORT:.0f}% "
    "(counted on the host from the streamed text with the model's tokenizer, more than "
    f"{100 * HOST_COUNT_SLACK:.0f}% short) rejects the candidate or holds on the baseline; so does a candidate whose "
    f"greedy completions equal the baseline's in fewer than {100 * MIN_AGREEMENT:.0f}% of requests. Speed needs at "
    f"least {MIN_ROUNDS} interleaved rounds. Per KPI (decode tok/s per request, prefill tok/s, aggregate tok/s) the "
    "ratio candidate / baseline is faster when its median over rounds is at least 1 + the noise floor and every round "
    "is above 1, slower in the mirror case. Promote: some KPI faster, none slower, and no slice (prompt length x "
    "concurrency) worse on the primary KPI, i.e. no slice whose 95% interval (paired t on the log ratio over rounds, "
    "or over boots of the servers with --restart-every) lies wholly on the losing side of 1; a worse slice makes it a "
    "trade-off (hold) naming the slices, and fewer "
    "rounds with a decode ratio of both sides than --runs asked for make it 'hold: rounds missing'. Reject: some "
    "slower, none faster. Otherwise hold (trade-off, or within noise). Every round run is kept in the record (a failed "
    "one too, with its reason); a decision on fewer rounds than asked says so. Exit 0 promote, 12 hold, 13 reject.")

SPEED_KPIS = {"decode": "decode tok/s per request", "prefill": "prefill tok/s", "aggregate": "aggregate tok/s",
              "ttft_p50": "TTFT p50"}


def _ci(low: float | None, high: float | None) -> str:
    return "95% CI -" if low is None or high is None else f"95% CI {low:.3f}-{high:.3f}"


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
    return f"{SPEED_KPIS.get(k.name, k.name)} {k.ratio:.3f}x{spread}, {_ci(k.ci_low, k.ci_high)}"


# ---------------------------------------------------------------- the record of a runtime A/B (ab.json)

AB_FORMAT: Literal["skupin-ab/1"] = "skupin-ab/1"
Role = Literal["baseline", "candidate"]


class CpuCost(Frozen):
    """A side's CPU-seconds per 1M output tokens from its container's cgroup accounting, over the rounds both sides
    have it for (the same rounds on both sides)."""

    cpu_s: float = Field(description="CPU seconds the container used while it was measured, summed over rounds")
    output_tokens: int = Field(description="Host-counted output tokens it streamed in those rounds")
    cpu_s_per_1m_output_tokens: float
    rounds: tuple[float, ...] = Field(description="Per round: CPU-seconds per 1M output tokens")
    round_numbers: tuple[int, ...] = Field((), description="The round (ABRound.number) of each of `rounds`")


RoundStatus = Literal["ok", "failed", "not run"]


class ABRound(Frozen):
    """One interleaved round as it went, a failed one included: which side ran first and how each side's half ended."""

    number: int = Field(description="1-based, in the order the rounds ran")
    order: str = Field(description="'BA' (baseline first) or 'AB' (candidate first)")
    baseline: RoundStatus = Field(description="ok: measured; failed: its server or container failed (reason); not run: "
                                              "the round ended before its turn")
    candidate: RoundStatus
    reason: str = Field("", description="Why a side failed in this round")
    boot: int = Field(1, ge=1, description="Which boot of the two servers ran it (1-based; a new boot every "
                                           "restart_every rounds)")
    requests: dict[str, int] = Field(default_factory=dict, description="Per side: requests sent in this round")
    failed_requests: dict[str, int] = Field(default_factory=dict, description="Per side: of those, streamed nothing")

    @property
    def paired(self) -> bool:
        """Both sides measured: a round the KPIs pair (by this round, never by position in a list)."""
        return self.baseline == "ok" and self.candidate == "ok"


def rounds_note(*, rounds: Sequence[ABRound], asked: int, decided: int | None = None) -> str:
    """'' when every asked round measured both sides (and, given `decided`, that many rounds had a decode ratio);
    else how many rounds were asked, run, measured on both sides and why the others were not, per side."""
    paired = sum(r.paired for r in rounds)
    failed = [r for r in rounds if not r.paired]
    if not failed and paired >= asked and (decided is None or decided >= paired):
        return ""
    text = f"rounds: {asked} asked, {len(rounds)} run, {paired} measured on both sides"
    if decided is not None and decided < paired:
        text += f", {paired - decided} of those without a decode ratio of both sides"
    for r in failed:
        sides = ", ".join(f"{role} {status}" for role, status in (("baseline", r.baseline), ("candidate", r.candidate))
                          if status != "ok")
        text += f"; round {r.number}: {sides}" + (f": {r.reason[:300]}" if r.reason else "")
    return text


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
    perf: tuple[PerfResult, ...] = Field(description="Per prompt length (settings order), every round measured on "
                                                     "both sides merged")
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
    order: tuple[str, ...] = Field(description="Per round measured on both sides (the rounds every KPI pairs), which "
                                               "image ran first: 'BA' or 'AB'")
    lengths: tuple[LengthAB, ...]
    kpis: tuple[KPI, ...]
    noise_floor: float
    noise_floor_basis: str
    isolation: str = Field("", description="How one side was kept from slowing the other while it was measured")
    requests: dict[str, int] = Field(default_factory=dict, description="Requests sent per side in the rounds, those of a "
                                                                     "failed round included")
    failed_requests: dict[str, int] = Field(default_factory=dict, description="Requests that streamed nothing")
    output_agreement: float | None = Field(None, description="Share of the candidate's completions equal to the "
                                                             "baseline's on the same prompts")
    errors: dict[str, str] = Field(default_factory=dict, description="A side whose server failed during the A/B")
    short_completions: dict[str, int] = Field(default_factory=dict, description="Completions the host counted more "
                                              "than HOST_COUNT_SLACK below max_tokens (under-generation)")
    output_tokens: dict[str, dict[str, int]] = Field(default_factory=dict, description="Per side: tokens asked, counted "
                                                     "on the host, claimed in the server's usage")
    primary_kpi: str = Field("decode", description="The KPI the per-slice rule judges (the SKU's gate.serve.primary_kpi)")
    slices: tuple[SliceAB, ...] = ()
    rounds: tuple[ABRound, ...] = Field((), description="Every round run, a failed one included, in order")
    rounds_note: str = Field("", description="How many rounds were asked, run and measured on both sides, and why "
                                             "not, when fewer than asked decided (rounds_note); '' otherwise")
    rounds_stop: RoundsStop | None = Field(None, description="Why the rounds ended where they did (rounds_stop, or "
                                                             "'failed'); None when no round ran")
    capacity: Capacity | None = None
    cpu: dict[str, CpuCost] = Field(default_factory=dict, description="Per side: the container's CPU accounting")
    decision_rule: str = ""
    model_parameters: int | None = Field(None, description="Parameters of the fixture model both sides served")
    decision: ABDecision
    decision_line: str
    reason: str
    host: str
    created: str
    tool_version: str
    wall_s: float

    @property
    def rounds_stopped(self) -> str:
        """Why the rounds ended, in words (stop_text); '' when no round ran."""
        return stop_text(self.rounds_stop, self.settings, len(self.rounds)) if self.rounds_stop else ""

    @property
    def boots(self) -> tuple[int, ...]:
        """Per round measured on both sides (as `order`), the boot that measured it."""
        return tuple(r.boot for r in self.rounds if r.paired)

    def kpi(self, name: str) -> KPI | None:
        return next((k for k in self.kpis if k.name == name), None)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.decision]


# `skupin ab` exits with these (README, `skupin ab --help`): promote 0, hold 12, reject 13.
EXIT_CODES: dict[str, int] = {"promote": 0, "hold": 12, "reject": 13}
