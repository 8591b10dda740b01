"""Derive a hardware class's tolerance entry from honest runs of a SKU's image against the reference bundle.

Method (recorded in every entry's provenance): run the honest image several times (fresh boots,
batch sizes 1 and 8, torch thread counts 1 and 2), compare each run with the reference bundle the
way the gate does, take the largest honest value of every statistic (per prompt, per run mean, per
kernel op) and multiply it by a stated margin; a dtype floor keeps a bit-identical calibration
from turning one rounding difference into a failure. The honest per-prompt exceedance rate the
binomial test assumes is the one-sided 95% Clopper-Pearson upper bound of the exceedances observed
in calibration (0 by construction), never below 0.5%.

A first calibration sets a whole class's thresholds, so `calibrate_image` refuses poison before it derives anything
(issue 30): an image that fails the static `pins` check (its files are not its lock), a SKU whose gate runs quantized
weights (calibration comes from full-precision weights only), honest runs that break a hard bound (which needs no
calibration), and, for a SKU with a float32 pass, an image that fails that pass. Each refusal raises before an entry
exists, so nothing is written.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.builder.render import render
from skupin.common import __version__
from skupin.common.errors import BundleError, DockerError, GateCouldNotRun, GateFailed, ManifestError, SkupinError
from skupin.common.paths import state_dir
from skupin.engines import engine_distributions, engine_float32
from skupin.gates.gate import (
    default_wheelhouse,
    load_reference,
    probe_in_container,
    read_probe_outputs,
    reap_leftovers,
    resolve_image,
)
from skupin.gates.integrity.static import inspect_image_files
from skupin.gates.judge.compare import (
    DECISION_STATS,
    STATISTICS,
    CompareError,
    KernelResult,
    ModelStatistics,
    kernel_errors,
    model_statistics,
)
from skupin.gates.judge.modules import host_model, with_modules
from skupin.gates.judge.ops import Battery, derive_bounds, judge_battery, spec_sha256
from skupin.gates.judge.tolerance import (
    HardBounds,
    ModelThresholds,
    Provenance,
    ToleranceEntry,
    ToleranceKey,
    Tolerances,
    calibration_for,
    captured_ops,
    class_ruler,
)
from skupin.gates.judge.verdict import (
    clopper_pearson_upper,
    hard_bound_failures,
    judge_model,
    judge_pins,
    kernel_hard_failures,
)
from skupin.gates.refdata.bundle import float32_manifest, model_folder
from skupin.imagetools.probe import host_driver

if TYPE_CHECKING:
    from skupin.builder.catalog.manifest import SkuManifest
    from skupin.builder.catalog.stack import ResolvedStack
    from skupin.dockerd import Docker

DEFAULT_MARGIN = 4.0
MIN_HONEST_RATE = 0.005
ALPHA = 1e-3
# The smallest model thresholds per compute dtype are each statistic's floors (gates/judge/compare.py: STATISTICS).
KERNEL_FLOORS = {"float32": 2.0**-22, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# The default variations: (batch size, threads), each in a fresh container.
DEFAULT_VARIATIONS: tuple[tuple[int, int], ...] = ((8, 1), (1, 1), (8, 2), (1, 2))


@dataclass(frozen=True)
class HonestRun:
    """One honest probe run: its tensors, the environment it reported and what was varied."""

    label: str
    tensors: dict[str, np.ndarray]
    env: dict[str, Any]
    ops: dict[str, Any] = field(default_factory=dict)  # the probe's checks.ops report (empty: no op battery ran)
    engine: str = ""  # the engine the probe ran and its version (its checks.model engine, engine_version); "": unknown
    engine_version: str = ""


def op_dtype(op: str) -> str:
    """The output dtype of a battery op from its name (``matmul.bfloat16`` -> bfloat16; no suffix: float32)."""
    last = op.rsplit(".", 1)[-1]
    return last if last in KERNEL_FLOORS else "float32"


@dataclass(frozen=True)
class Measurement:
    """One honest run compared with the reference: its per-prompt statistics and kernel errors."""

    label: str
    stats: ModelStatistics
    kernels: tuple[KernelResult, ...]
    env: dict[str, Any]
    ops: Battery | None = None  # the engine op battery against float64 (None: no op battery ran)
    engine: str = ""  # the engine the run was computed with and its exact version (HonestRun); "": not reported
    engine_version: str = ""


def measure_run(*, reference: dict[str, np.ndarray], run: HonestRun, kernels: bool = True,
                tf32: bool = False, key: ToleranceKey | None = None) -> Measurement:
    """Compare one honest run with the reference the way the gate does (its kernels only with `kernels`: a SKU whose
    gate does not check kernels, such as llama.cpp's without torch, runs no kernel battery), and its op battery with
    float64 (`tf32`: the SKU declares TF32), with its module ops where the run has them and `key` names a fixture."""
    # an engine whose module ops are captured from its own forward (llama.cpp) calibrates them into its own entry only
    # (an engine-keyed one): its inputs are its forward's, not the seeded ones a class's other engines were measured on
    captured = key is not None and captured_ops(key)
    ops = (judge_battery(run.tensors, run.ops, tf32=tf32) if run.ops.get("ops")
           else Battery(results=()) if captured and "modules" in run.ops else None)
    model = host_model(key.model) if key is not None and ops is not None and "modules" in run.ops else None
    if ops is not None and model is not None and key is not None:
        ops = with_modules(ops, run.tensors, run.ops, model, tf32=tf32, captured=captured,
                           dtypes=(key.dtype,) if captured else tuple(dict.fromkeys((key.dtype, "float32"))))
    return Measurement(label=run.label, stats=model_statistics(reference, run.tensors),
                       kernels=kernel_errors(reference, run.tensors) if kernels else (), env=run.env, ops=ops,
                       engine=run.engine, engine_version=run.engine_version)


def derive_entry(*, key: ToleranceKey, reference: dict[str, np.ndarray], reference_sha256: str,
                 runs: list[HonestRun], margin: float, image: str, date: str | None = None,
                 kernels: bool = True, hard: HardBounds | None = None) -> ToleranceEntry:
    """The tolerance entry of `key` from honest runs (see the module docstring for the method); without `kernels`
    it has no kernel thresholds (merge_entry then keeps the class's). With `hard`, a run that breaks a hard bound is
    refused (`refuse_hard_bounds`)."""
    if len(runs) < 2:
        raise GateCouldNotRun("calibration needs at least two honest runs")
    return derive_entry_from_measurements(key=key, measurements=[measure_run(reference=reference, run=r,
                                                                             kernels=kernels, key=key) for r in runs],
                                          reference_sha256=reference_sha256, margin=margin, image=image, date=date,
                                          hard=hard)


def derive_entry_from_measurements(*, key: ToleranceKey, measurements: list[Measurement], reference_sha256: str,
                                   margin: float, image: str, date: str | None = None,
                                   hard: HardBounds | None = None, tf32: bool = False) -> ToleranceEntry:
    """The tolerance entry of `key` from already measured honest runs (what `derive_entry` does after comparing);
    with `hard` (what `skupin calibrate` passes: the tolerance file's hard bounds), GateFailed when a run breaks one."""
    if len(measurements) < 2:
        raise GateCouldNotRun("calibration needs at least two honest runs")
    if hard is not None:
        refuse_hard_bounds(measurements, hard=hard, dtype=key.dtype, tf32=tf32)
    if margin <= 1:
        raise GateCouldNotRun(f"margin {margin} must be > 1")
    unfloored = [s for s in DECISION_STATS if key.dtype not in STATISTICS[s].floors]
    if unfloored:
        raise GateCouldNotRun(f"no calibration floor at {key.dtype} for {', '.join(unfloored)} "
                              f"(gates/judge/compare.py: STATISTICS)")
    floors = {s: STATISTICS[s].floors[key.dtype] for s in DECISION_STATS}
    per_prompt_max: dict[str, float] = {}
    mean_max: dict[str, float] = {}
    kernel_max: dict[str, float] = {}
    collected: dict[str, list[np.ndarray]] = {}
    prompts = 0
    for run in measurements:
        stats = run.stats
        if stats.nonfinite:
            raise GateCouldNotRun(f"honest run {run.label} has NaN/Inf in {', '.join(stats.nonfinite)}")
        prompts = stats.num_prompts
        for s in DECISION_STATS:
            if s not in stats.available:
                continue
            values = stats.per_prompt[s]
            collected.setdefault(s, []).append(values)
            per_prompt_max[s] = max(per_prompt_max.get(s, 0.0), float(values.max()))
            mean_max[s] = max(mean_max.get(s, 0.0), float(values.mean()))
        for k in run.kernels:
            if k.problem:
                raise GateCouldNotRun(f"honest run {run.label}: kernel {k.op}: {k.problem}")
            kernel_max[k.op] = max(kernel_max.get(k.op, 0.0), float(k.rel_err or 0.0))
    per_prompt = {s: max(margin * v, floors[s]) for s, v in per_prompt_max.items()}
    mean = {s: max(margin * v, floors[s]) for s, v in mean_max.items()}
    # the pooled honest mean: the centre the mean bound narrows towards at more prompts (ModelThresholds.mean_bound)
    center = {s: float(np.nanmean(np.concatenate(vals))) for s, vals in collected.items()}
    center = {s: c for s, c in center.items() if 0 <= c < mean.get(s, 0.0) and math.isfinite(c)}
    kernels = {op: max(margin * v, KERNEL_FLOORS[op_dtype(op)]) for op, v in sorted(kernel_max.items())}
    if not collected:
        raise GateCouldNotRun("no decision statistic was available in the honest runs")
    # A decision statistic no honest run could compute (its probe output missing on a side) gets no threshold: the
    # entry says why, and the gate reports that reason instead of skipping it unseen.
    omitted = {s: f"not available in the honest runs ({STATISTICS[s].why_unavailable})"
               for s in DECISION_STATS if s not in collected}
    total = sum(v.size for v in collected[next(iter(collected))])
    exceed = max(int(sum((v > per_prompt[s]).sum() for v in vals)) for s, vals in collected.items())
    honest_rate = max(clopper_pearson_upper(exceed, total), MIN_HONEST_RATE)
    provenance = Provenance(
        runs=len(measurements), prompts_per_run=prompts,
        hosts=tuple(sorted({_host(r.env) for r in measurements})),
        versions=_versions(measurements[0].env),
        engines=engines_used(measurements, key=key),
        variations=tuple(r.label for r in measurements),
        date=date or _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        method=(f"skupin calibrate {__version__}: honest runs of the image vs the reference bundle; threshold = "
                f"max(margin x largest honest value, dtype floor) per statistic (per prompt and mean over prompts) "
                f"and per kernel op; engine ops: gates/judge/ops.py OP_MARGINS x the largest honest error per measure; "
                f"honest rate = 95% Clopper-Pearson upper bound of calibration exceedances "
                f"({exceed}/{total}), floor {MIN_HONEST_RATE}"),
        margin=margin, reference_sha256=reference_sha256, image=image,
        honest_max={**{f"per_prompt.{s}": v for s, v in per_prompt_max.items()},
                    **{f"mean.{s}": v for s, v in mean_max.items()},
                    **{f"kernels.{op}": v for op, v in kernel_max.items()}},
    )
    ops = _op_bounds(measurements)
    return ToleranceEntry(key=key, kernels=kernels, ops=ops, ops_spec=spec_sha256(captured=captured_ops(key)) if ops else "",
                          model=ModelThresholds(per_prompt=per_prompt, mean=mean, honest_rate=honest_rate, alpha=ALPHA,
                                                omitted=omitted, mean_center=center),
                          provenance=provenance)


def _op_bounds(measurements: list[Measurement]) -> dict[str, dict[str, float]]:
    """The calibrated op bounds of honest runs that all ran the op battery (gates/judge/ops.py: derive_bounds), else
    none; GateFailed when an honest run's op breaks a hard bound (such a run is not honest)."""
    batteries = [m.ops for m in measurements if m.ops is not None]
    if not batteries or len(batteries) != len(measurements):
        return {}
    try:
        return derive_bounds(batteries)
    except ValueError as exc:
        raise GateFailed(f"calibration refused: {exc}") from exc


def engines_used(measurements: list[Measurement], *, key: ToleranceKey) -> dict[str, str]:
    """Engine -> exact version, as the honest runs reported them (the entry's `provenance.engines`). On an accelerator
    the entry holds for that engine's release alone (gates/judge/tolerance.py: calibration_for), so there every run
    must report the key's engine, at one version: GateCouldNotRun otherwise, before an entry exists."""
    if key.engine:
        unreported = [m.label for m in measurements if m.engine != key.engine or not m.engine_version]
        if unreported:
            raise GateCouldNotRun(f"calibration refused: {key.label()} holds for {key.engine} alone, and not every "
                                  f"honest run reported it with its version ({', '.join(unreported)}); fix: calibrate an image "
                                  f"whose probe reports checks.model engine {key.engine} and its engine_version (the "
                                  f"engine installed as one of skupin/engines/{key.engine}.py DISTRIBUTIONS)")
    used: dict[str, set[str]] = {}
    for m in measurements:
        if m.engine and m.engine_version:
            used.setdefault(m.engine, set()).add(m.engine_version)
    split = sorted(f"{name} {', '.join(sorted(versions))}" for name, versions in used.items() if len(versions) > 1)
    if split:
        raise GateCouldNotRun(f"calibration refused: the honest runs report several versions of one engine "
                              f"({'; '.join(split)})")
    return {name: next(iter(versions)) for name, versions in sorted(used.items())}


def _engine_used(report: dict[str, Any]) -> tuple[str, str]:
    """(engine, exact version) the probe reports it ran (checks.model's engine and engine_version); empty when not."""
    checks = report.get("checks")
    model = checks.get("model") if isinstance(checks, dict) else None
    if not isinstance(model, dict):
        return "", ""
    return str(model.get("engine") or ""), str(model.get("engine_version") or "")


def _host(env: dict[str, Any]) -> str:
    device = env.get("device") or {}
    return f"{device.get('name') or env.get('cpu_model') or 'unknown'} ({env.get('cpu_capability') or device.get('type')})"


def _versions(env: dict[str, Any]) -> dict[str, str]:
    dists = env.get("distributions") or {}
    out = {"python": str(env.get("python")), "torch": str(env.get("torch"))}
    for name in (*engine_distributions(), "triton", "numpy", "safetensors"):
        if name in dists:
            out[name] = str(dists[name])
    return out


# ---------------------------------------------------------------- orchestration


def refuse_quantized(manifest: SkuManifest) -> None:
    """ManifestError unless the SKU's gate runs full-precision weights: the tolerance key does not name the weights,
    so an entry from quantized weights would set the thresholds of every full-precision SKU of the class."""
    if manifest.gate.weights != "full":
        raise ManifestError(f"{manifest.name}: gate.weights is {manifest.gate.weights}: calibration comes only from "
                            "full-precision weights (the tolerance key does not name the weights, so this entry would "
                            f"set the thresholds of the whole class); calibrate a SKU of {ToleranceKey.of(manifest).label()} "
                            "whose gate.weights is full")


def refuse_unpinned(*, stack: ResolvedStack, image_id: str, docker: Docker, wheelhouse: Path | None = None,
                    on_event: Callable[[str], None] = lambda _: None) -> None:
    """The gate's static `pins` check on the image to calibrate from: GateFailed (exit 10) naming its first finding
    when its files are not its lock, GateCouldNotRun (exit 11) when it cannot be established here."""
    manifest, lock = stack.manifest, stack.current_lock
    if lock is None:
        raise GateCouldNotRun(f"calibration refused: {manifest.name} has no current lock, so the image's files cannot "
                              f"be checked against one; fix: skupin lock {manifest.name}")
    on_event(f"pins: checking the files of {image_id[:19]} against lock {lock.content_hash()[:12]} before calibrating")
    try:
        report = inspect_image_files(docker=docker, image_id=image_id, lock=lock, state=state_dir(),
                                     dockerfile=render(stack).text, wheelhouse=wheelhouse or default_wheelhouse(),
                                     on_event=on_event)
    except SkupinError as exc:
        raise GateCouldNotRun(f"calibration refused: the image's files could not be checked: {exc}") from exc
    gpu_host = ALL_FAMILIES[manifest.base.family].accelerated
    result = judge_pins(report=report, manifest=manifest, host_driver=host_driver() if gpu_host else None,
                        gpu_host=gpu_host)
    if result.status == "fail":
        raise GateFailed(f"calibration refused: pins failed: {result.reason}")
    if result.status != "pass":
        raise GateCouldNotRun(f"calibration refused: pins could not check the image: {result.reason}")


def refuse_hard_bounds(measurements: list[Measurement], *, hard: HardBounds, dtype: str, tf32: bool = False) -> None:
    """GateFailed when an honest run breaks a bound that needs no calibration (non-finite outputs, mean KL, top-1
    agreement, float32's mean logprob L2, a float32 elementwise kernel): such a run is not honest, whatever it claims."""
    for run in measurements:
        broken = [*hard_bound_failures(run.stats, hard, dtype=dtype, tf32=tf32),
                  *kernel_hard_failures(results=run.kernels, hard=hard)]
        if broken:
            more = f" (+{len(broken) - 1} more)" if len(broken) > 1 else ""
            raise GateFailed(f"calibration refused: honest run {run.label} breaks a hard bound: {broken[0]}{more}")


def refuse_float32_failure(*, manifest: SkuManifest, image_id: str, docker: Docker, out: Path, model_dir: Path | None,
                           scratch: Path, tolerances: Tolerances, on_event: Callable[[str], None] = lambda _: None) -> None:
    """For a SKU with a float32 pass (it serves another dtype on an engine with FLOAT32): the gate's float32 pass on
    the image (the probe at float32 against the float32 bundle: hard bounds, and the class's float32 entry when one is
    calibrated for that bundle; for a SKU keyed per engine whose own float32 entry is not calibrated yet, the class's
    engine-free one). GateFailed when it fails, GateCouldNotRun when it cannot run."""
    if manifest.gate.dtype == "float32" or not engine_float32(manifest.stack.engine.name):
        return
    try:
        m32 = float32_manifest(manifest)
        _, ref, ref_sha = load_reference(manifest=m32)
    except BundleError as exc:
        raise GateCouldNotRun(f"calibration refused: the float32 pass cannot run: no float32 bundle to compare with: "
                              f"{exc}") from exc
    m32 = m32.model_copy(update={"gate": m32.gate.model_copy(
        update={"checks": tuple(c for c in m32.gate.checks if c != "kernels")})})
    on_event("float32: the probe at float32 against the float32 bundle before calibrating")
    probe = probe_in_container(manifest=m32, image=image_id, docker=docker, out=Path(out) / "probe-float32",
                               model_dir=model_dir or model_folder(manifest=manifest, scratch=scratch))
    model = (probe.report.get("checks") or {}).get("model") if isinstance(probe.report.get("checks"), dict) else None
    if probe.error or probe.report.get("status") != "ok" or (isinstance(model, dict) and model.get("status") != "ok"):
        raise GateCouldNotRun(f"calibration refused: the float32 probe failed: {probe.error or probe.report.get('checks')}")
    # the gate's own decision (another bundle, engine or engine release: the hard bounds alone, as the gate does), but
    # for a SKU keyed per engine with no float32 entry of its own yet: its class's engine-free one (stricter than the
    # gate, which would end uncalibrated)
    found = calibration_for(manifest, tolerances, reference_sha256=ref_sha, float32=True)
    entry, why = found.entry, found.problem
    ruler = class_ruler(tolerances, found.key) if tolerances.find(found.key) is None else None
    if ruler is not None and ruler.provenance.reference_sha256 == ref_sha:
        # an engine keyed per engine on a CPU class, not yet calibrated at float32: the class's ruler judges it
        entry, why = ruler, ""
    try:
        stats = model_statistics(ref, probe.tensors)
    except CompareError as exc:
        raise GateCouldNotRun(f"calibration refused: the float32 pass could not compare: {exc}") from exc
    result, _, _ = judge_model(stats=stats, entry=entry, hard=tolerances.hard_bounds, dtype="float32",
                               why=why, name="float32")
    if result.status == "fail":
        raise GateFailed(f"calibration refused: the float32 pass failed: {result.reason}")
    if result.status == "error":
        raise GateCouldNotRun(f"calibration refused: the float32 pass could not judge the image: {result.reason}")


def calibrate_image(*, stack: ResolvedStack, image: str, docker: Docker, out: Path, boots: int = 2,
                    variations: tuple[tuple[int, int], ...] = DEFAULT_VARIATIONS, margin: float = DEFAULT_MARGIN,
                    on_event: Callable[[str], None] = lambda _: None, tolerances: Tolerances | None = None,
                    pinned: ResolvedStack | None = None, wheelhouse: Path | None = None) -> ToleranceEntry:
    """Run the honest image `boots` x `variations` times in the gate's sandbox and derive the entry, after refusing
    poison (the module docstring): the image is checked by `pins` against `pinned` (the SKU's own resolved stack; by
    default `stack`, which for `--float32` is the SKU's float32 copy), the runs against `tolerances`' hard bounds (the
    defaults without it) and, where the SKU has one, the float32 pass is run first."""

    manifest = stack.manifest
    refuse_quantized(manifest)
    tolerances = tolerances or Tolerances()
    reap_leftovers(docker=docker, on_event=on_event)
    meta, reference, ref_sha = load_reference(manifest=manifest)
    image_id = resolve_image(docker=docker, image=image).id
    refuse_unpinned(stack=pinned or stack, image_id=image_id, docker=docker, wheelhouse=wheelhouse, on_event=on_event)
    runs: list[HonestRun] = []
    # The fixture is resolved (and checked, or generated) once, at the first run that needs it, for every run.
    with tempfile.TemporaryDirectory(prefix="skupin-fixture-") as scratch:
        model_dir: Path | None = None
        for boot in range(boots):
            for batch, threads in variations:
                label = f"boot {boot + 1}, batch {batch}, threads {threads}"
                run_out = Path(out) / f"run-{boot + 1}-b{batch}-t{threads}"
                report, tensors = _reuse(run_out, image_id)
                if report is None:
                    on_event(f"honest run: {label}")
                    if model_dir is None:
                        model_dir = model_folder(manifest=manifest, scratch=Path(scratch))
                    report, tensors = _honest_run(manifest=manifest, image=image_id, docker=docker, out=run_out,
                                                  batch=batch, threads=threads, label=label, model_dir=model_dir)
                else:
                    on_event(f"honest run: {label}: reusing the finished run in {run_out}")
                assert tensors is not None  # read with its report, or run just now
                ops = (report.get("checks") or {}).get("ops") or {}
                engine, engine_version = _engine_used(report)
                runs.append(HonestRun(label=label, tensors=tensors, env=report.get("env", {}),
                                      ops=ops if isinstance(ops, dict) else {}, engine=engine,
                                      engine_version=engine_version))
        if len(runs) < 2:
            raise GateCouldNotRun("calibration needs at least two honest runs")
        kernels = "kernels" in manifest.gate.checks
        tf32 = "tf32" in manifest.gate.reduced_precision
        measurements = [measure_run(reference=reference, run=r, kernels=kernels, tf32=tf32,
                                    key=ToleranceKey.of(manifest)) for r in runs]
        refuse_hard_bounds(measurements, hard=tolerances.hard_bounds, dtype=manifest.gate.dtype, tf32=tf32)
        refuse_float32_failure(manifest=manifest, image_id=image_id, docker=docker, out=out, model_dir=model_dir,
                               scratch=Path(scratch), tolerances=tolerances, on_event=on_event)
    key = ToleranceKey.of(manifest)
    entry = derive_entry_from_measurements(key=key, measurements=measurements, reference_sha256=ref_sha, margin=margin,
                                           image=image_id, hard=tolerances.hard_bounds, tf32=tf32)
    (Path(out) / "entry.json").write_text(json.dumps(entry.model_dump(mode="json"), indent=1) + "\n")
    return entry


def _reuse(run_out: Path, image_id: str) -> tuple[dict[str, Any] | None, dict[str, np.ndarray] | None]:
    """(probe.json, tensors) of a finished honest run of the same image in `run_out` (resume), else (None, None)."""

    marker = run_out / "image-id"
    if not (run_out / "probe.json").is_file() or not marker.is_file() or marker.read_text().strip() != image_id:
        return None, None
    try:
        report, tensors = read_probe_outputs(run_out)
    except Exception:  # an unreadable leftover is simply run again
        return None, None
    return (report, tensors) if report.get("status") == "ok" else (None, None)


def _honest_run(*, manifest: SkuManifest, image: str, docker: Docker, out: Path, batch: int, threads: int, label: str,
                model_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One honest probe container (retried once when the engine fails underneath it)."""

    for attempt in (1, 2):
        try:
            probe = probe_in_container(manifest=manifest, image=image, docker=docker, out=out, batch_size=batch,
                                       threads=threads, model_dir=model_dir)
        except DockerError as exc:
            if attempt == 2:
                raise GateCouldNotRun(f"honest run {label} could not run: {exc}") from exc
            continue
        if probe.error or probe.report.get("status") != "ok":
            raise GateCouldNotRun(f"honest run {label} could not run: {probe.error or probe.report.get('checks')}")
        marker = Path(out) / "image-id"
        marker.unlink(missing_ok=True)
        marker.write_text(image + "\n")
        return probe.report, probe.tensors
    raise AssertionError("unreachable")
