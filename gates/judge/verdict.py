"""The gate's verdict: the GateVerdict record and the pure rules that turn measurements into check results.

Every check result carries a status (pass, fail, error = could not run, skipped, uncalibrated = only
its calibration-free part ran, for want of a calibrated tolerance, and passed) and a one-line reason a
person can act on. The model decision, per calibrated statistic: count the prompts whose
value exceeds the per-prompt threshold and run a one-sided binomial test against the calibrated
honest exceedance rate (prompts are the independent unit; positions inside a prompt are
correlated), and compare the mean over prompts with the aggregate threshold at the run's prompt count (it narrows
as 1/sqrt(prompts) about the honest centre, so more prompts never weaken the test: ModelThresholds.mean_bound).
Hard bounds (NaN/Inf, mean KL > 0.5, top-1 agreement < 80%) need no calibration and are checked first, calibrated or not: with no
calibrated entry the gate runs every check it can and ends `uncalibrated` (exit 14), never pass.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field

from skupin.builder.catalog.manifest import SkuManifest
from skupin.common.errors import GateCouldNotRun, GateFailed, GateUncalibrated
from skupin.common.model import Frozen
from skupin.gates.integrity.binaries import MAX_LISTED, BinariesReport
from skupin.gates.integrity.static import IntegrityReport
from skupin.gates.integrity.static import summary as integrity_summary
from skupin.gates.judge.compare import DECISION_STATS, STATISTICS, KernelResult, ModelStatistics
from skupin.gates.judge.tolerance import HardBounds, ToleranceEntry

VERDICT_FORMAT: Literal["skupin-verdict/1"] = "skupin-verdict/1"
Status = Literal["pass", "fail", "error", "skipped", "uncalibrated"]
Decision = Literal["pass", "fail", "could_not_run", "uncalibrated"]
# What each check can do without a calibrated tolerance entry (the verdict's `calibration_free`, docs/GATE.md).
CALIBRATION_FREE = {
    "kernels": "hard bounds only: every op's output finite, the float32 elementwise ops (SiLU, softmax, RMSNorm, "
               "4-bit dequantize) within the hard bound; the per-op calibrated tolerances were not applied",
    "ops": "hard bounds only: every engine op's output present, finite, of its shape, routed to the exact experts and "
           "within its dtype-derived rms/max/bias bound; the class's calibrated op bounds were not applied",
    "model": "hard bounds only: no NaN/Inf, mean KL (top-k and full vocabulary) within the hard bound, top-1 agreement "
             "at or above the hard bound, and at float32 the mean logprob L2 within its hard bound; the per-statistic "
             "binomial tests and mean bounds were not applied",
    "float32": "hard bounds only, at float32 against the float32 bundle: no NaN/Inf, mean KL, top-1 agreement and the "
               "float32 mean logprob L2 bound (which alone catches a kernel 1% off); the per-statistic binomial tests "
               "and mean bounds were not applied",
    "serve": "not run: its near-tie threshold (2 x the calibrated per-prompt max |logprob delta|) and its logprob "
             "comparison both come from the calibrated entry, and without them an honest near-tie divergence and a "
             "wrong token cannot be told apart",
}


class CheckResult(Frozen):
    """One check's outcome."""

    name: str
    status: Status
    reason: str
    details: dict[str, Any] = Field(default_factory=dict)


class StatDecision(Frozen):
    """The model decision for one statistic over all prompts."""

    stat: str
    threshold: float
    exceedances: int
    prompts: int
    honest_rate: float
    p_value: float
    alpha: float
    mean: float
    mean_threshold: float = Field(description="The mean bound at this run's prompt count (ModelThresholds.mean_bound)")
    failed_by: tuple[str, ...] = Field(description="'binomial' and/or 'mean' when this statistic failed the model")


class PromptResult(Frozen):
    """One prompt's statistics and which thresholds it exceeded."""

    index: int
    stats: dict[str, float | None]
    exceeds: tuple[str, ...] = ()


class ReferenceInfo(Frozen):
    """The reference bundle the candidate was compared with."""

    path: str
    sha256: str = Field(description="sha256 of the bundle's SHA256SUMS (names every file)")
    gpu: str | None = None
    driver: str | None = None
    torch: str | None = None
    engine: str | None = None
    model: str | None = None
    model_sha256: str | None = None
    prompts_sha256: str | None = None
    dtype: str | None = None


class ToleranceInfo(Frozen):
    """The tolerance entry used, with its provenance."""

    key: str
    source: str
    entry: dict[str, Any] | None = None
    hard_bounds: dict[str, float]


class GateVerdict(Frozen):
    """Everything one gate run decided, and why (schema: docs/GATE.md)."""

    format: Literal["skupin-verdict/1"] = VERDICT_FORMAT
    sku: str
    hardware_class: str
    image: str = Field(description="The image reference the gate was asked to check")
    image_id: str | None = Field(description="sha256:... id of the image that ran (None when it was not found)")
    lock_hash: str | None = Field(description="Content hash of the SKU's lock the pins were checked against")
    image_lock_label: str | None = Field(None, description="io.skupin.lock-sha256 label of the image")
    reference: ReferenceInfo | None
    tolerance: ToleranceInfo | None
    checks: tuple[CheckResult, ...]
    model_decision: tuple[StatDecision, ...] = ()
    prompts: tuple[PromptResult, ...] = ()
    decision: Decision
    reason: str
    calibration_free: dict[str, str] = Field(
        default_factory=dict, description="Check -> what of it ran without a calibrated tolerance (only when the "
        "SKU's tolerance key has no entry for this reference bundle; the decision is then at best 'uncalibrated')")
    timings: dict[str, float]
    probe: dict[str, Any] = Field(default_factory=dict, description="Probe settings and the environment it reported")
    tool_version: str
    created: str

    def check(self, name: str) -> CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    def failing_check(self) -> CheckResult | None:
        """The first check that failed or could not run."""
        return next((c for c in self.checks if c.status in ("fail", "error")), None)

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": GateFailed.exit_code, "could_not_run": GateCouldNotRun.exit_code,
                "uncalibrated": GateUncalibrated.exit_code}[self.decision]


def raise_for_verdict(verdict: GateVerdict) -> None:
    """GateFailed (10), GateCouldNotRun (11) or GateUncalibrated (14) for a verdict that did not pass."""
    if verdict.decision == "fail":
        raise GateFailed(f"gate failed: {verdict.reason}")
    if verdict.decision == "could_not_run":
        raise GateCouldNotRun(f"gate could not run: {verdict.reason}")
    if verdict.decision == "uncalibrated":
        raise GateUncalibrated(f"gate uncalibrated (never a pass): {verdict.reason}")


def decide(checks: tuple[CheckResult, ...]) -> tuple[Decision, str]:
    """The decision of a run: the first check that failed or errored decides; else `uncalibrated` when a check could
    run only its calibration-free part; otherwise pass."""
    for check in checks:
        if check.status == "error":
            return "could_not_run", f"{check.name}: {check.reason}"
        if check.status == "fail":
            return "fail", f"{check.name}: {check.reason}"
    ran = [c.name for c in checks if c.status == "pass"]
    partial = [c for c in checks if c.status == "uncalibrated"]
    if partial:
        why = next((str(c.details["why"]) for c in partial if c.details.get("why")), partial[0].reason)
        passed = ran + [f"{c.name} (hard bounds only)" for c in partial if c.details.get("ran", True)]
        unrun = [c.name for c in partial if not c.details.get("ran", True)]
        return "uncalibrated", (f"{why}; calibration-free checks passed: {', '.join(passed) or 'none'}"
                                + (f"; not run without calibration: {', '.join(unrun)}" if unrun else "")
                                + "; never a pass until calibrated")
    return "pass", f"passed {', '.join(ran)}"


# ---------------------------------------------------------------- statistics helpers


def binomial_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exactly."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    try:
        return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))
    except OverflowError:  # C(n, i) past a float (n above ~1030 prompts, e.g. 24 calibration runs): in log space
        if p <= 0.0 or p >= 1.0:
            return 1.0 if p >= 1.0 else 0.0
        lp, lq, top = math.log(p), math.log1p(-p), math.lgamma(n + 1)
        terms = [top - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k, n + 1)]
        peak = max(terms)
        return min(1.0, math.exp(peak) * math.fsum(math.exp(t - peak) for t in terms))


def clopper_pearson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided upper confidence bound of a binomial rate after k successes in n trials."""
    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    target = 1 - confidence
    for _ in range(100):  # P(X <= k | p) decreases in p: bisect for = target
        mid = (lo + hi) / 2
        cdf = 1.0 - binomial_sf(k + 1, n, mid)
        lo, hi = (mid, hi) if cdf > target else (lo, mid)
    return hi


# ---------------------------------------------------------------- pins


def driver_series(version: str) -> str:
    """The series of a driver version: its first component (580.95.05 -> 580)."""
    return version.split(".", 1)[0]


def judge_pins(*, report: IntegrityReport, manifest: SkuManifest, host_driver: dict[str, Any] | None,
               gpu_host: bool) -> CheckResult:
    """The image's files against its lock (gates/integrity/static.py), and on a GPU host the host driver's series."""
    kinds: dict[str, int] = {}
    for finding in report.findings:
        kinds[finding.kind] = kinds.get(finding.kind, 0) + 1
    details: dict[str, Any] = {"counts": report.counts, "interpreter": report.interpreter,
                               "finding_kinds": kinds, "findings": [f.line() for f in report.findings[:50]],
                               "unverifiable": list(report.unverifiable), "unowned_data": list(report.unowned_data),
                               "omitted": list(report.omitted)}
    problems = [f.line() for f in report.findings]
    driver_pin = manifest.stack.driver
    if driver_pin.name != "none" and gpu_host:
        host = (host_driver or {}).get("version")
        details["host_driver"] = host
        if not host:
            return CheckResult(name="pins", status="error", reason="the host reports no accelerator driver",
                               details=details)
        if driver_series(host) != driver_series(driver_pin.version):
            problems.insert(0, f"host driver {host} is not in the pinned series {driver_series(driver_pin.version)} "
                               f"({driver_pin.name} {driver_pin.version})")
    elif driver_pin.name != "none":
        details["host_driver"] = "not checked: not a GPU host"
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(name="pins", status="fail", reason=f"the image is not its lock: {problems[0]}{more}",
                           details=details)
    if report.unverifiable:
        return CheckResult(name="pins", status="error", reason=report.unverifiable[0], details=details)
    return CheckResult(name="pins", status="pass", reason=f"the image's files are the lock: {integrity_summary(report)}",
                       details=details)


def judge_binaries(report: BinariesReport) -> CheckResult:
    """The image's native binaries (gates/integrity/binaries.py): any finding fails, naming the first failing file;
    a file that could not be read makes the check unable to run (it fails closed, as pins does)."""
    kinds: dict[str, int] = {}
    for finding in report.findings:
        kinds[finding.kind] = kinds.get(finding.kind, 0) + 1
    details: dict[str, Any] = {
        "checked": report.checked, "needed_resolved": report.needed, "finding_kinds": kinds,
        "findings": [f.line() for f in report.findings[:MAX_LISTED]], "unverifiable": list(report.unverifiable[:MAX_LISTED]),
        "archs": {f"/{p}": list(a) for p, a in sorted(report.archs.items())[:200]}, "host_libraries": list(report.host),
        "preloaded": report.preloaded_count, "preloaded_first": list(report.preloaded[:MAX_LISTED]),
        "declared": list(report.declared), "declared_count": report.declared_count, "skipped": report.skipped,
        "seconds": report.seconds}
    summary = (f"{report.checked} ELF files above the base, {report.needed} NEEDED resolved "
               f"({report.preloaded_count} by a library loaded earlier), {len(report.archs)} with device code")
    if report.findings:
        more = f" (+{len(report.findings) - 1} more)" if len(report.findings) > 1 else ""
        return CheckResult(name="binaries", status="fail", reason=f"{report.findings[0].line()}{more}", details=details)
    if report.unverifiable:
        more = f" (+{len(report.unverifiable) - 1} more)" if len(report.unverifiable) > 1 else ""
        return CheckResult(name="binaries", status="error", reason=f"{report.unverifiable[0]}{more}", details=details)
    declared = f"; {report.declared_count} declared exception(s) applied" if report.declared_count else ""
    return CheckResult(name="binaries", status="pass", reason=f"every binary loads and fits: {summary}{declared}",
                       details=details)


# ---------------------------------------------------------------- kernels


# Ops whose float32 result is fixed up to rounding on any hardware: no calibration needed to judge them.
ELEMENTWISE_FP32 = ("silu.float32", "softmax.float32", "rmsnorm.float32", "int4.dequant")


def kernel_hard_failures(*, results: tuple[KernelResult, ...], hard: HardBounds) -> list[str]:
    """Kernel errors no honest hardware makes: non-finite outputs, float32 elementwise ops far off."""
    out = []
    for r in results:
        if not r.finite:
            out.append(f"{r.op}: NaN/Inf in the output")
        elif r.op in ELEMENTWISE_FP32 and r.rel_err is not None and r.rel_err > hard.max_fp32_elementwise_error:
            out.append(f"{r.op}: max error {r.rel_err:.3g} > hard bound {hard.max_fp32_elementwise_error:.3g} "
                       f"(needs no calibration)")
    return out


def kernels_uncalibrated(*, results: tuple[KernelResult, ...], why: str) -> CheckResult:
    """The kernel check without a calibrated entry, after its hard bounds passed: `uncalibrated`, each op's error shown."""
    if not results:
        return CheckResult(name="kernels", status="error", reason="the reference holds no kernel battery")
    rows = {r.op: {"rel_err": r.rel_err, "tolerance": None, "problem": r.problem} for r in results}
    return CheckResult(name="kernels", status="uncalibrated",
                       reason=f"{why} (hard bounds passed for all {len(results)} ops)",
                       details={"ops": rows, "calibration_free": CALIBRATION_FREE["kernels"], "why": why})


def serve_uncalibrated(why: str) -> CheckResult:
    """The serve check without a calibrated entry: not run (CALIBRATION_FREE['serve'] says why), never a pass."""
    return CheckResult(name="serve", status="uncalibrated", reason=f"not run: {why}; {CALIBRATION_FREE['serve'][9:]}",
                       details={"calibration_free": CALIBRATION_FREE["serve"], "why": why, "ran": False})


def judge_kernels(*, results: tuple[KernelResult, ...], entry: ToleranceEntry) -> CheckResult:
    """Every op within its calibrated max error; an op missing, misshaped or non-finite fails."""
    rows, ranked = {}, []
    for r in results:
        tol = entry.kernels.get(r.op)
        rows[r.op] = {"rel_err": r.rel_err, "tolerance": tol, "problem": r.problem}
        if r.problem:
            ranked.append((math.inf, f"{r.op}: {r.problem}"))
        elif tol is None:
            ranked.append((math.inf, f"{r.op}: no calibrated tolerance in {entry.key.label()}"))
        elif r.rel_err is not None and r.rel_err > tol:
            ranked.append((r.rel_err / tol, f"{r.op}: max error {r.rel_err:.3g} (of the reference's max |value|) > "
                                            f"tolerance {tol:.3g} ({r.rel_err / tol:.3g}x)"))
    failures = [text for _, text in sorted(ranked, key=lambda x: -x[0])]  # the worst offender first
    if not results:
        return CheckResult(name="kernels", status="error", reason="the reference holds no kernel battery")
    if failures:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(name="kernels", status="fail", reason=failures[0] + more,
                           details={"ops": rows, "failures": failures})
    worst = max(((r.rel_err or 0.0) / entry.kernels[r.op], r.op) for r in results if entry.kernels[r.op] > 0)
    return CheckResult(name="kernels", status="pass",
                       reason=f"{len(results)} ops within tolerance (closest: {worst[1]} at {worst[0]:.2f}x its bound)",
                       details={"ops": rows})


# ---------------------------------------------------------------- model


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def hard_bound_failures(stats: ModelStatistics, hard: HardBounds, *, dtype: str, tf32: bool = False) -> list[str]:
    """Reasons the candidate breaks a bound that needs no calibration (run at `dtype`: float32 has one of its own,
    its mean logprob L2 bound, which a SKU that declares TF32 (`tf32`) does not get: TF32 products move float32
    logprobs past it by design, and the class's float32 entry, calibrated with TF32 on, judges instead)."""
    out = []
    if stats.nonfinite:
        out.append(f"NaN/Inf in {', '.join(stats.nonfinite)}")
    kls = [v for v in (stats.mean("kl_full"), stats.mean("kl")) if v is not None]
    if kls and max(kls) > hard.max_mean_kl:
        out.append(f"mean KL {_fmt(max(kls))} > hard bound {hard.max_mean_kl}")
    top1 = stats.mean("top1_agree")
    if top1 is not None and top1 < hard.min_top1_agree:
        out.append(f"top-1 agreement {top1:.1%} < hard bound {hard.min_top1_agree:.0%}")
    l2 = stats.mean("logprob_l2")
    if dtype == "float32" and not tf32 and l2 is not None and l2 > hard.max_fp32_mean_logprob_l2:
        out.append(f"float32 mean logprob L2 {_fmt(l2)} > hard bound {hard.max_fp32_mean_logprob_l2:.3g} "
                   f"({l2 / hard.max_fp32_mean_logprob_l2:.3g}x; honest float32 runs measured stay 5x below it)")
    return out


def judge_model(*, stats: ModelStatistics, entry: ToleranceEntry | None, hard: HardBounds, dtype: str, why: str = "",
                name: str = "model", tf32: bool = False
                ) -> tuple[CheckResult, tuple[StatDecision, ...], tuple[PromptResult, ...]]:
    """Hard bounds first, then per statistic a binomial test on per-prompt exceedances and an aggregate bound.

    With no entry (`why` says why there is none) only the hard bounds run: `fail` when one breaks, else `uncalibrated`.
    `dtype` is what the candidate ran at (float32 adds its own hard bound, except with `tf32`: the SKU declares TF32);
    `name` names the result (`model`, or `float32` for the float32 pass).
    """
    n = stats.num_prompts
    decision_stats = [s for s in DECISION_STATS if s in stats.available
                      and (entry is None or (s in entry.model.per_prompt and s in entry.model.mean))]
    not_judged = _not_judged(stats, entry)
    hard_fail = hard_bound_failures(stats, hard, dtype=dtype, tf32=tf32)
    decisions: list[StatDecision] = []
    exceeds: dict[int, list[str]] = {i: [] for i in range(n)}
    if entry is not None:
        alpha = entry.model.alpha / max(1, len(decision_stats))  # Bonferroni over the statistics
        for s in decision_stats:
            values = stats.per_prompt[s]
            thr = entry.model.per_prompt[s]
            over = np.where(~np.isfinite(values) | (values > thr))[0]
            for i in over:
                exceeds[int(i)].append(s)
            p = binomial_sf(len(over), n, entry.model.honest_rate)
            mean = stats.mean(s)
            mean = float("inf") if mean is None else mean
            bound = entry.model.mean_bound(s, prompts=n, calibrated_prompts=entry.provenance.prompts_per_run,
                                           floor=STATISTICS[s].floors.get(entry.key.dtype, 0.0))
            by = tuple(x for x, bad in (("binomial", p < alpha), ("mean", mean > bound)) if bad)
            decisions.append(StatDecision(stat=s, threshold=thr, exceedances=len(over), prompts=n,
                                          honest_rate=entry.model.honest_rate, p_value=p, alpha=alpha, mean=mean,
                                          mean_threshold=bound, failed_by=by))
    prompts = tuple(PromptResult(index=i, stats={k: _num(stats.per_prompt[k][i]) for k in stats.per_prompt},
                                 exceeds=tuple(exceeds[i])) for i in range(n))
    summary = {"prompts": n, "statistics": list(stats.available), "means": {k: stats.mean(k) for k in stats.per_prompt},
               "greedy_same": stats.greedy_same, "notes": list(stats.notes),
               **({"not_judged": not_judged} if not_judged else {})}
    if hard_fail:
        return (CheckResult(name=name, status="fail", reason="hard bound: " + "; ".join(hard_fail),
                            details={**summary, "hard_bounds": hard_fail}), tuple(decisions), prompts)
    if entry is None:
        return (CheckResult(name=name, status="uncalibrated",
                            reason=f"{why or 'no calibrated tolerance'} (only the hard bounds were checked, and they passed)",
                            details={**summary, "calibration_free": CALIBRATION_FREE.get(name, CALIBRATION_FREE["model"]),
                                     **({"why": why} if why else {})}),
                tuple(decisions), prompts)
    if not decision_stats:
        return (CheckResult(name=name, status="error", reason="no calibrated statistic is available on both sides",
                            details=summary), tuple(decisions), prompts)
    failed = [d for d in decisions if d.failed_by]
    if failed:
        d = max(failed, key=lambda x: (x.exceedances, x.mean / x.mean_threshold if x.mean_threshold else 0))
        why = (f"{d.stat}: {d.exceedances}/{n} prompts exceed {_fmt(d.threshold)} "
               f"(binomial p={d.p_value:.2g} < {d.alpha:.2g} at honest rate {d.honest_rate:.3g}); "
               f"mean {_fmt(d.mean)} vs bound {_fmt(d.mean_threshold)} ({d.mean / d.mean_threshold:.3g}x)")
        others = [x.stat for x in failed if x is not d]
        if others:
            why += f"; also {', '.join(others)}"
        return CheckResult(name=name, status="fail", reason=why, details=summary), tuple(decisions), prompts
    closest = max(decisions, key=lambda x: x.mean / x.mean_threshold if x.mean_threshold else 0)
    ratio = closest.mean / closest.mean_threshold if closest.mean_threshold else 0.0
    unjudged = f"; not judged: {'; '.join(f'{k} ({v})' for k, v in not_judged.items())}" if not_judged else ""
    return (CheckResult(name=name, status="pass",
                        reason=f"{len(decisions)} statistics within tolerance over {n} prompts "
                               f"(closest: mean {closest.stat} at {ratio:.2g}x its bound){unjudged}", details=summary),
            tuple(decisions), prompts)


def _not_judged(stats: ModelStatistics, entry: ToleranceEntry | None) -> dict[str, str]:
    """Each decision statistic (gates/judge/compare.py: STATISTICS) a calibrated decision leaves out, and why: the
    entry omits it (its reason), has no threshold for it (tolerance.statistics_problems names that entry invalid), or
    the pair has no value of it. Nothing is skipped unseen."""
    if entry is None:
        return {}
    out = {}
    for s in DECISION_STATS:
        if s in entry.model.omitted:
            out[s] = f"the tolerance entry omits it: {entry.model.omitted[s]}"
        elif s not in entry.model.per_prompt or s not in entry.model.mean:
            out[s] = f"the tolerance entry {entry.key.label()} has no threshold for it and says not why"
        elif s not in stats.available:
            out[s] = f"not computed: {STATISTICS[s].why_unavailable}"
    return out


def _num(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x
