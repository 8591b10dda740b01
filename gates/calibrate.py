"""Derive a hardware class's tolerance entry from honest runs of a SKU's image against the reference bundle.

Method (recorded in every entry's provenance): run the honest image several times (fresh boots,
batch sizes 1 and 8, torch thread counts 1 and 2), compare each run with the reference bundle the
way the gate does, take the largest honest value of every statistic (per prompt, per run mean, per
kernel op) and multiply it by a stated margin; a dtype floor keeps a bit-identical calibration
from turning one rounding difference into a failure. The honest per-prompt exceedance rate the
binomial test assumes is the one-sided 95% Clopper-Pearson upper bound of the exceedances observed
in calibration (0 by construction), never below 0.5%.
"""

from __future__ import annotations

import datetime as _dt
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common import __version__
from common.errors import DockerError, GateCouldNotRun
from engines import engine_distributions
from gates.bundle import model_folder
from gates.compare import DECISION_STATS, KernelResult, ModelStatistics, kernel_errors, model_statistics
from gates.gate import load_reference, probe_in_container, read_probe_outputs, reap_leftovers, resolve_image
from gates.tolerance import ModelThresholds, Provenance, ToleranceEntry, ToleranceKey
from gates.verdict import clopper_pearson_upper

DEFAULT_MARGIN = 4.0
MIN_HONEST_RATE = 0.005
ALPHA = 1e-3
# Smallest thresholds per compute dtype: about one rounding step of that dtype on the statistic.
# bfloat16: 4 x what one bf16 rounding difference gives on tiny-llama (H200 eager vs sdpa attention, and
# CPU bf16 vs H200 bf16, both ~ kl 9e-8, 1-cos 2.5e-5, logprob L2 0.0125, max |delta| 0.012; measured by
# bench/detection). The earlier floors (kl 1e-9, 1-cos 1e-6, 1e-2) rejected every honest eager-attention
# H200 run when the calibration runs were bit-identical to the reference (docs/BENCHMARKS.md, Detection power).
MODEL_FLOORS: dict[str, dict[str, float]] = {
    "float32": {"kl": 1e-13, "one_minus_cos": 1e-12, "logprob_l2": 1e-5, "max_abs": 1e-5},
    "bfloat16": {"kl": 2e-7, "one_minus_cos": 5e-5, "logprob_l2": 2.5e-2, "max_abs": 2.5e-2},
    "float16": {"kl": 1e-11, "one_minus_cos": 1e-8, "logprob_l2": 2e-3, "max_abs": 2e-3},
}
KERNEL_FLOORS = {"float32": 2.0**-22, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# The default variations: (batch size, threads), each in a fresh container.
DEFAULT_VARIATIONS: tuple[tuple[int, int], ...] = ((8, 1), (1, 1), (8, 2), (1, 2))


@dataclass(frozen=True)
class HonestRun:
    """One honest probe run: its tensors, the environment it reported and what was varied."""

    label: str
    tensors: dict[str, np.ndarray]
    env: dict[str, Any]


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


def measure_run(*, reference: dict[str, np.ndarray], run: HonestRun, kernels: bool = True) -> Measurement:
    """Compare one honest run with the reference the way the gate does (its kernels only with `kernels`: a SKU whose
    gate does not check kernels, such as llama.cpp's without torch, runs no kernel battery)."""
    return Measurement(label=run.label, stats=model_statistics(reference, run.tensors),
                       kernels=kernel_errors(reference, run.tensors) if kernels else (), env=run.env)


def derive_entry(*, key: ToleranceKey, reference: dict[str, np.ndarray], reference_sha256: str,
                 runs: list[HonestRun], margin: float, image: str, date: str | None = None,
                 kernels: bool = True) -> ToleranceEntry:
    """The tolerance entry of `key` from honest runs (see the module docstring for the method); without `kernels`
    it has no kernel thresholds (merge_entry then keeps the class's)."""
    if len(runs) < 2:
        raise GateCouldNotRun("calibration needs at least two honest runs")
    return derive_entry_from_measurements(key=key, measurements=[measure_run(reference=reference, run=r,
                                                                             kernels=kernels) for r in runs],
                                          reference_sha256=reference_sha256, margin=margin, image=image, date=date)


def derive_entry_from_measurements(*, key: ToleranceKey, measurements: list[Measurement], reference_sha256: str,
                                   margin: float, image: str, date: str | None = None) -> ToleranceEntry:
    """The tolerance entry of `key` from already measured honest runs (what `derive_entry` does after comparing)."""
    if len(measurements) < 2:
        raise GateCouldNotRun("calibration needs at least two honest runs")
    if margin <= 1:
        raise GateCouldNotRun(f"margin {margin} must be > 1")
    floors = MODEL_FLOORS[key.dtype]
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
    kernels = {op: max(margin * v, KERNEL_FLOORS[op_dtype(op)]) for op, v in sorted(kernel_max.items())}
    total = sum(v.size for v in collected[next(iter(collected))])
    exceed = max(int(sum((v > per_prompt[s]).sum() for v in vals)) for s, vals in collected.items())
    honest_rate = max(clopper_pearson_upper(exceed, total), MIN_HONEST_RATE)
    provenance = Provenance(
        runs=len(measurements), prompts_per_run=prompts,
        hosts=tuple(sorted({_host(r.env) for r in measurements})),
        versions=_versions(measurements[0].env),
        variations=tuple(r.label for r in measurements),
        date=date or _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        method=(f"skupin calibrate {__version__}: honest runs of the image vs the reference bundle; threshold = "
                f"max(margin x largest honest value, dtype floor) per statistic (per prompt and mean over prompts) "
                f"and per kernel op; honest rate = 95% Clopper-Pearson upper bound of calibration exceedances "
                f"({exceed}/{total}), floor {MIN_HONEST_RATE}"),
        margin=margin, reference_sha256=reference_sha256, image=image,
        honest_max={**{f"per_prompt.{s}": v for s, v in per_prompt_max.items()},
                    **{f"mean.{s}": v for s, v in mean_max.items()},
                    **{f"kernels.{op}": v for op, v in kernel_max.items()}},
    )
    return ToleranceEntry(key=key, kernels=kernels,
                          model=ModelThresholds(per_prompt=per_prompt, mean=mean, honest_rate=honest_rate, alpha=ALPHA),
                          provenance=provenance)


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


def calibrate_image(*, stack, image: str, docker, out: Path, boots: int = 2,
                    variations: tuple[tuple[int, int], ...] = DEFAULT_VARIATIONS, margin: float = DEFAULT_MARGIN,
                    on_event: Callable[[str], None] = lambda _: None) -> ToleranceEntry:
    """Run the honest image `boots` x `variations` times in the gate's sandbox and derive the entry."""

    manifest = stack.manifest
    reap_leftovers(docker=docker, on_event=on_event)
    meta, reference, ref_sha = load_reference(manifest=manifest)
    image_id = resolve_image(docker=docker, image=image).id
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
                runs.append(HonestRun(label=label, tensors=tensors, env=report.get("env", {})))
    key = ToleranceKey(hardware_class=manifest.accelerator.hardware_class, dtype=manifest.gate.dtype,
                       model=manifest.gate.model)
    entry = derive_entry(key=key, reference=reference, reference_sha256=ref_sha, runs=runs, margin=margin,
                         image=image_id, kernels="kernels" in manifest.gate.checks)
    (Path(out) / "entry.json").write_text(json.dumps(entry.model_dump(mode="json"), indent=1) + "\n")
    return entry


def _reuse(run_out: Path, image_id: str):
    """(probe.json, tensors) of a finished honest run of the same image in `run_out` (resume), else (None, None)."""

    marker = run_out / "image-id"
    if not (run_out / "probe.json").is_file() or not marker.is_file() or marker.read_text().strip() != image_id:
        return None, None
    try:
        report, tensors = read_probe_outputs(run_out)
    except Exception:  # an unreadable leftover is simply run again
        return None, None
    return (report, tensors) if report.get("status") == "ok" else (None, None)


def _honest_run(*, manifest, image: str, docker, out: Path, batch: int, threads: int, label: str, model_dir: Path):
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
