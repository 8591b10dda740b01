"""Gate an image: run the probe in a sandboxed container, compare with the reference bundle, decide.

Stage function: ``gate_image(*, stack, image, engine, out, on_event) -> GateVerdict``. The probe
(gates/probe.py) and the model fixture are mounted read-only into the image under test, a fresh
output folder read-write; the container has no network, no capabilities, no-new-privileges, a
read-only root with a tmpfs /tmp, the SKU's memory limit and a pid limit, and is always removed
(also at the deadline, on a crash or Ctrl-C: the engine adapter guarantees it). Its outputs are
read back as JSON and safetensors with gates/tensorio.py; nothing is unpickled.
Checks, in order, stopping at the first hard failure: reference, boot, pins, kernels, model,
serve (gates/serve.py: the engine's own server; `baseline` adds an interleaved A/B).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from builder import __version__
from builder.errors import BundleError, EngineError, GateCouldNotRun
from builder.manifest import SkuManifest
from gates.compare import CompareError, kernel_errors, model_statistics
from gates.tolerance import DEFAULT_PATH, ToleranceKey, load_tolerances
from gates.verdict import (
    CheckResult,
    GateVerdict,
    ReferenceInfo,
    ToleranceInfo,
    decide,
    judge_kernels,
    judge_model,
    judge_pins,
    kernel_hard_failures,
)

OnEvent = Callable[[str], None]
PROBE = Path(__file__).with_name("probe.py")
PROBE_MOUNT = "/skupin/probe.py"
MODEL_MOUNT = "/skupin/model"
OUT_MOUNT = "/skupin/out"
RUN_LABEL = "io.skupin.gate-run"
MAX_REPORT_BYTES = 64 * 1024**2
# Environment every probe container gets (the SKU's runtime env is applied on top, --threads below).
SANDBOX_ENV = {
    "HOME": "/tmp", "HF_HOME": "/tmp/hf", "XDG_CACHE_HOME": "/tmp/cache", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": "/tmp/triton",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor", "MPLCONFIGDIR": "/tmp/mpl",
}


def _quiet(_: str) -> None:
    return None


@dataclass(frozen=True)
class ProbeRun:
    """What one probe container produced: its probe.json, its tensors, and how it ended."""

    report: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    error: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    logs_tail: str = ""


# ---------------------------------------------------------------- inputs


def repo_root() -> Path:
    from builder.paths import REPO

    return Path(REPO)


def bundle_sha256(folder: Path) -> str:
    """The bundle's identity: sha256 of its SHA256SUMS (which names the sha256 of every file)."""
    return hashlib.sha256((Path(folder) / "SHA256SUMS").read_bytes()).hexdigest()


def load_reference(*, manifest: SkuManifest, folder: Path | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray], str]:
    """Verify the SKU's reference bundle (hashes, model, prompt set, dtype) and read it: (meta, tensors, sha256)."""
    from gates.bundle import load_bundle

    folder = Path(folder) if folder else repo_root() / manifest.gate.reference
    if not folder.is_dir():
        raise BundleError(f"{folder}: reference bundle folder is missing (gate.reference of {manifest.name})")
    meta, tensors = load_bundle(folder=folder, manifest=manifest)
    return meta, tensors, bundle_sha256(folder)


def image_from_build_record(sku: str) -> str:
    """The image of the SKU's build record (.skupin/builds/<sku>.json), or GateCouldNotRun with the fix."""
    from builder.paths import STATE

    path = Path(STATE) / "builds" / f"{sku}.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return str(record.get("image_id") or record["image"])
    except (OSError, ValueError, KeyError) as exc:
        raise GateCouldNotRun(f"{path}: no build record for {sku}; fix: skupin build {sku}, or pass --image") from exc


def resolve_image(*, engine, image: str) -> str:
    """The id of local image `image`, or GateCouldNotRun."""
    info = engine.inspect_image(image)
    if info is None:
        raise GateCouldNotRun(f"image {image} is not on this engine; fix: build or load it first")
    return info.id


# ---------------------------------------------------------------- running the probe


def run_label(out: Path) -> str:
    """The value of the RUN_LABEL label on the probe container writing to `out` (find or clean up one run's container)."""
    return hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:16]


def probe_spec(*, manifest: SkuManifest, image: str, out: Path, model_dir: Path, batch_size: int | None = None,
               threads: int = 0, checks: str = "env,kernels,model", probe: Path = PROBE):
    """The sandboxed container that runs the probe on `image` (see the module docstring)."""
    from builder.engine import BindMount, ContainerSpec

    gate, runtime = manifest.gate, manifest.runtime
    env = {**SANDBOX_ENV, **runtime.env}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    args = ["--model", MODEL_MOUNT, "--prompts", f"{MODEL_MOUNT}/prompts.json", "--out", OUT_MOUNT,
            "--dtype", gate.dtype, "--batch-size", str(batch_size or gate.batch_size), "--device", "auto",
            "--engine", manifest.stack.engine.name if manifest.stack.engine.name in ("transformers", "vllm", "sglang")
            else "transformers", "--checks", checks]
    if threads:
        args += ["--threads", str(threads)]
    return ContainerSpec(
        image=image, entrypoint=("python3",), command=(PROBE_MOUNT, *args), env=env, network="none", read_only=True,
        tmpfs={"/tmp": "rw,exec,size=1g"}, mem_limit=gate.memory, pids_limit=1024, shm_size=runtime.shm_size,
        ipc="host" if runtime.ipc == "host" else None, cap_drop=("ALL",), security_opt=("no-new-privileges",),
        mounts=(BindMount(source=probe.resolve(), target=PROBE_MOUNT, read_only=True),
                BindMount(source=model_dir.resolve(), target=MODEL_MOUNT, read_only=True),
                BindMount(source=out.resolve(), target=OUT_MOUNT, read_only=False)),
        devices=tuple(runtime.devices), group_add=tuple(runtime.group_add), gpus=runtime.gpus == "all",
        labels={"io.skupin.role": "gate-probe", "io.skupin.sku": manifest.name, RUN_LABEL: run_label(out)},
    )


def read_probe_outputs(out: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """probe.json (JSON) and tensors.safetensors (validated, numpy) from a probe's output folder."""
    from gates.tensorio import read_safetensors

    report_path = out / "probe.json"
    if not report_path.is_file() or report_path.is_symlink():
        raise BundleError(f"{report_path}: the probe wrote no probe.json")
    if report_path.stat().st_size > MAX_REPORT_BYTES:
        raise BundleError(f"{report_path}: larger than {MAX_REPORT_BYTES} bytes")
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BundleError(f"{report_path}: not valid JSON: {exc}") from exc
    if not isinstance(report, dict) or report.get("format") != "skupin-probe/1":
        raise BundleError(f"{report_path}: not a skupin-probe/1 report")
    tensors_path = out / "tensors.safetensors"
    if tensors_path.is_symlink():
        raise BundleError(f"{tensors_path}: is a symlink")
    tensors, _ = read_safetensors(tensors_path) if tensors_path.is_file() else ({}, {})
    return report, tensors


def probe_in_container(*, manifest: SkuManifest, image: str, engine, out: Path, batch_size: int | None = None,
                       threads: int = 0, checks: str = "env,kernels,model", model_dir: Path | None = None,
                       deadline_s: float | None = None) -> ProbeRun:
    """Run the probe on `image` in the sandbox and read its outputs; failures come back in ProbeRun.error."""
    from gates.bundle import fixture_folder

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o777)  # the image's user may not be root  # noqa: S103
    with tempfile.TemporaryDirectory(prefix="skupin-fixture-") as scratch:
        model_dir = fixture_folder(name=manifest.gate.model, model_dir=model_dir, scratch=Path(scratch))
        spec = probe_spec(manifest=manifest, image=image, out=out, model_dir=model_dir, batch_size=batch_size,
                          threads=threads, checks=checks)
        deadline = float(deadline_s or manifest.gate.deadline_s)
        try:
            result = engine.run(spec, deadline_s=deadline)
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine SDK's own errors (e.g. 409 when removed by someone else)
            raise EngineError(f"running the probe container failed: {exc}") from exc
    tail = (result.stderr or result.stdout)[-3000:]
    (out / "container.log").write_text(f"exit {result.exit_code}\n--- stdout\n{result.stdout[-20000:]}\n"
                                       f"--- stderr\n{result.stderr[-20000:]}\n", encoding="utf-8")
    if result.timed_out:
        return ProbeRun(error=f"the probe did not finish within the deadline of {deadline:.0f} s (container killed and removed)",
                        timed_out=True, seconds=result.seconds, logs_tail=tail)
    try:
        report, tensors = read_probe_outputs(out)
    except BundleError as exc:
        return ProbeRun(error=f"the container exited {result.exit_code} without usable outputs ({exc}); "
                              f"last output: {tail.strip()[-600:] or '(none)'}",
                        exit_code=result.exit_code, seconds=result.seconds, logs_tail=tail)
    return ProbeRun(report=report, tensors=tensors, exit_code=result.exit_code, seconds=result.seconds, logs_tail=tail)


# ---------------------------------------------------------------- the stage


def _probe_check_error(report: dict[str, Any], name: str) -> str:
    check = (report.get("checks") or {}).get(name) or {}
    if check.get("status") == "ok":
        return ""
    return str(check.get("error") or f"the probe reported {name} as {check.get('status', 'missing')}")[:800]


def _skip_rest(checks: list[CheckResult], names: tuple[str, ...], why: str) -> None:
    done = {c.name for c in checks}
    checks.extend(CheckResult(name=n, status="skipped", reason=why) for n in names if n not in done)


def gate_image(*, stack, image: str, engine, out: Path, on_event: OnEvent = _quiet,
               tolerances_path: Path = DEFAULT_PATH, reference: Path | None = None, baseline: str | None = None,
               serve_perf=None) -> GateVerdict:
    """Gate `image` for the SKU of `stack` (a ResolvedStack) and write verdict.json, report.md and plot.png to `out`.

    `baseline` (an image) adds the serve check's interleaved A/B; `serve_perf` (gates.perf.PerfSettings)
    overrides its load settings.
    """
    from gates.report import write_report

    started = time.monotonic()
    created = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    manifest: SkuManifest = stack.manifest
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = stack.lock if getattr(stack, "lock_state", "") == "ok" else None
    timings: dict[str, float] = {}
    checks: list[CheckResult] = []
    state: dict[str, Any] = {"image_id": None, "label": None, "reference": None, "tolerance": None,
                             "decisions": (), "prompts": (), "probe": {}}
    order = ("reference", "boot", "pins", "kernels", "model", "serve")
    wanted = set(manifest.gate.checks)

    def finish() -> GateVerdict:
        _skip_rest(checks, order, "not evaluated: an earlier check did not pass")
        decision, reason = decide(tuple(checks))
        timings["total_s"] = round(time.monotonic() - started, 3)
        verdict = GateVerdict(
            sku=manifest.name, hardware_class=manifest.accelerator.hardware_class, image=image,
            image_id=state["image_id"], lock_hash=lock.content_hash() if lock else None,
            image_lock_label=state["label"], reference=state["reference"], tolerance=state["tolerance"],
            checks=tuple(checks), model_decision=state["decisions"], prompts=state["prompts"], decision=decision,
            reason=reason, timings=timings, probe=state["probe"], tool_version=__version__, created=created)
        t0 = time.monotonic()
        write_report(verdict=verdict, out=out)
        on_event(f"verdict: {decision}: {reason} (report {out / 'report.md'}; {time.monotonic() - t0:.1f} s)")
        return verdict

    # reference bundle: hashes, then fit to the SKU
    t0 = time.monotonic()
    ref_folder = Path(reference) if reference else repo_root() / manifest.gate.reference
    try:
        meta, ref, ref_sha = load_reference(manifest=manifest, folder=ref_folder)
    except BundleError as exc:
        checks.append(CheckResult(name="reference", status="error", reason=str(exc)))
        return finish()
    state["reference"] = ReferenceInfo(
        path=str(ref_folder), sha256=ref_sha, gpu=(meta.get("gpu") or {}).get("name"), driver=meta.get("driver"),
        torch=meta.get("torch"), engine=f"{(meta.get('engine') or {}).get('name')} {(meta.get('engine') or {}).get('version')}",
        model=(meta.get("model") or {}).get("name"), model_sha256=(meta.get("model") or {}).get("sha256"),
        prompts_sha256=(meta.get("prompts") or {}).get("sha256"), dtype=meta.get("dtype"))
    checks.append(CheckResult(name="reference", status="pass",
                              reason=f"bundle {ref_sha[:12]} verified: {meta.get('model', {}).get('name')} "
                                     f"{meta.get('dtype')} on {(meta.get('gpu') or {}).get('name')}"))
    timings["reference_s"] = round(time.monotonic() - t0, 3)
    on_event(checks[-1].reason)

    # tolerance entry (a missing one is not fatal yet: the hard bounds still run)
    tolerances = load_tolerances(tolerances_path)
    key = ToleranceKey(hardware_class=manifest.accelerator.hardware_class, dtype=manifest.gate.dtype, model=manifest.gate.model)
    entry = tolerances.find(key)
    tol_problem = ""
    if entry is None:
        tol_problem = (f"no calibrated tolerance for {key.label()} in {tolerances_path}; "
                       f"fix: skupin calibrate {manifest.name}")
    elif entry.provenance.reference_sha256 != ref_sha:
        tol_problem = (f"the tolerance of {key.label()} was calibrated against bundle "
                       f"{entry.provenance.reference_sha256[:12]}, not {ref_sha[:12]}; fix: skupin calibrate {manifest.name}")
        entry = None
    state["tolerance"] = ToleranceInfo(key=key.label(), source=str(tolerances_path),
                                       entry=entry.model_dump(mode="json") if entry else None,
                                       hard_bounds=tolerances.hard_bounds.model_dump())

    # boot: run the probe once in the sandbox
    t0 = time.monotonic()
    try:
        state["image_id"] = resolve_image(engine=engine, image=image)
        info = engine.inspect_image(image)
        state["label"] = (info.labels or {}).get("io.skupin.lock-sha256") if info else None
    except (GateCouldNotRun, EngineError) as exc:
        checks.append(CheckResult(name="boot", status="error", reason=str(exc)))
        return finish()
    on_event(f"booting {image} ({state['image_id'][:19]}) with the probe (deadline {manifest.gate.deadline_s} s)")
    try:
        probe = probe_in_container(manifest=manifest, image=state["image_id"], engine=engine, out=out / "probe")
    except (EngineError, BundleError) as exc:
        checks.append(CheckResult(name="boot", status="error", reason=str(exc)))
        return finish()
    timings["probe_container_s"] = round(time.monotonic() - t0, 3)
    report = probe.report
    env = report.get("env") or {}
    state["probe"] = {"exit_code": probe.exit_code, "seconds": probe.seconds, "device": report.get("device"),
                      "args": report.get("args"), "torch": env.get("torch"), "python": env.get("python"),
                      "engines": env.get("engines"), "cpu_capability": env.get("cpu_capability"),
                      "threads": env.get("threads"), "driver": env.get("driver"),
                      "checks": {k: {kk: vv for kk, vv in v.items() if kk in ("status", "error", "wall_s", "load_s",
                                                                              "forward_s", "generate_s")}
                                 for k, v in (report.get("checks") or {}).items()}}
    if probe.error or _probe_check_error(report, "env"):
        checks.append(CheckResult(name="boot", status="error", reason=probe.error or
                                  f"the probe could not read the environment: {_probe_check_error(report, 'env')}",
                                  details={"logs_tail": probe.logs_tail[-2000:]}))
        return finish()
    checks.append(CheckResult(name="boot", status="pass",
                              reason=f"the image booted and the probe ran in {probe.seconds:.1f} s "
                                     f"(python {env.get('python')}, torch {env.get('torch')}, device {report.get('device')})"))
    on_event(checks[-1].reason)

    # pins
    if "boot" in wanted:
        pins = judge_pins(env=env, manifest=manifest, lock=lock, gpu_host=manifest.accelerator.vendor != "cpu")
        if state["label"] and lock and state["label"] != lock.content_hash():
            pins = pins.model_copy(update={"details": {**pins.details, "note": f"the image's lock label {state['label'][:12]} "
                                                                              f"is not the current lock {lock.content_hash()[:12]}"}})
        checks.append(pins)
        on_event(f"pins: {pins.status}: {pins.reason}")
        if pins.status != "pass":
            return finish()
    else:
        checks.append(CheckResult(name="pins", status="skipped", reason="boot is not in the SKU's gate.checks"))

    # kernels
    t0 = time.monotonic()
    if "kernels" in wanted:
        results = kernel_errors(ref, probe.tensors)
        hard_kernel = kernel_hard_failures(results=results, hard=tolerances.hard_bounds)
        if hard_kernel:
            more = f" (+{len(hard_kernel) - 1} more)" if len(hard_kernel) > 1 else ""
            checks.append(CheckResult(name="kernels", status="fail", reason=hard_kernel[0] + more,
                                      details={"hard_bounds": hard_kernel}))
            on_event(f"kernels: fail: {checks[-1].reason}")
            return finish()
        if entry is None:
            checks.append(CheckResult(name="kernels", status="error", reason=tol_problem))
            return finish()
        problem = _probe_check_error(report, "kernels")
        kern = judge_kernels(results=results, entry=entry)
        if problem and kern.status == "pass":
            kern = CheckResult(name="kernels", status="error", reason=f"the probe's kernel battery failed: {problem}")
        checks.append(kern)
        on_event(f"kernels: {kern.status}: {kern.reason}")
        timings["kernels_s"] = round(time.monotonic() - t0, 3)
        if kern.status != "pass":
            return finish()
    else:
        checks.append(CheckResult(name="kernels", status="skipped", reason="kernels is not in the SKU's gate.checks"))

    # model
    t0 = time.monotonic()
    if "model" in wanted:
        problem = _probe_check_error(report, "model")
        if problem:
            checks.append(CheckResult(name="model", status="error", reason=f"the probe's model check failed: {problem}"))
            return finish()
        try:
            stats = model_statistics(ref, probe.tensors)
        except CompareError as exc:
            checks.append(CheckResult(name="model", status="error", reason=str(exc)))
            return finish()
        model_check, decisions, prompts = judge_model(stats=stats, entry=entry, hard=tolerances.hard_bounds)
        if model_check.status == "error" and tol_problem:
            model_check = model_check.model_copy(update={"reason": f"{tol_problem} (hard bounds passed)"})
        checks.append(model_check)
        state["decisions"], state["prompts"] = decisions, prompts
        timings["model_s"] = round(time.monotonic() - t0, 3)
        on_event(f"model: {model_check.status}: {model_check.reason}")
    else:
        checks.append(CheckResult(name="model", status="skipped", reason="model is not in the SKU's gate.checks"))
    if checks[-1].status not in ("pass", "skipped"):
        return finish()

    # serve: the engine's own server, greedy completions vs the reference, speed (gates/serve.py)
    t0 = time.monotonic()
    if "serve" in wanted:
        from gates.serve import serve_check

        on_event("serve: booting the engine's server in the sandbox")
        serve = serve_check(manifest=manifest, image=state["image_id"], engine=engine, ref=ref, entry=entry,
                            baseline=baseline, perf=serve_perf, on_event=on_event)
        checks.append(serve)
        timings["serve_s"] = round(time.monotonic() - t0, 3)
        on_event(f"serve: {serve.status}: {serve.reason}")
    else:
        checks.append(CheckResult(name="serve", status="skipped", reason="serve is not in the SKU's gate.checks"))
    return finish()


def write_verdict(verdict: GateVerdict, path: Path) -> None:
    """verdict.json: the verdict as stable JSON."""
    Path(path).write_text(verdict.model_dump_json(indent=1) + "\n", encoding="utf-8")
