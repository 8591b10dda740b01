"""Gate an image: run the probe in a sandboxed container, compare with the reference bundle, decide.

Stage function: ``gate(built, docker, *, out, on_event) -> GateVerdict`` for an image built here;
``gate_image(*, stack, image, docker, out, on_event)`` is the same gate for any local image. The probe
(imagetools/probe.py) and the model fixture are mounted read-only into the image under test; nothing
the container can write is mounted. The container has no network, no capabilities,
no-new-privileges, a read-only root with a tmpfs /tmp, private IPC, the SKU's memory limit, a CPU
and a pid limit, an output cap and an in-container deadline, and is always removed (also at the
deadline, on a crash, Ctrl-C or when skupin itself is killed: the Docker adapter guarantees it).
The probe prints its outputs as one frame on stdout (``--out -``); the host parses it strictly
(gates/probe_output.py) and writes the raw outputs and the container's log into the host-only
folder OUT/probe/. Nothing is unpickled.
Checks, in order, stopping at the first hard failure: reference, pins (static, before anything of
the image runs: its files are its lock, gates/static/integrity.py), boot, kernels, model, float32
(a SKU serving bf16 is probed again at float32 against the float32 bundle), serve
(gates/serving/serve.py: the engine's own server; `baseline` adds an interleaved A/B). Each check
returns its CheckResult; the driver records it and stops at the first that did not pass (an exception a
check did not expect is recorded as its error result, so every run ends in a verdict).
"""

from __future__ import annotations

import contextlib
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

from builder.build import BuiltImage
from builder.lockfile import Lock
from builder.manifest import SkuManifest
from builder.render import VENV, render
from builder.stack import ResolvedStack
from common import __version__
from common.errors import BundleError, DockerError, GateCouldNotRun, SkupinError
from common.paths import data_path, state_dir
from common.untrusted import open_folder, printable, write_new_file
from dockerd import BindMount, Docker, ImageInfo, RunResult
from engines import MODEL_MOUNT, engine_float32, engine_outputs, probe_adapter
from gates.bundle import (
    PROBE,
    bundle_sha256,
    float32_manifest,
    float32_reference,
    load_bundle,
    model_folder,
    probe_args,
)
from gates.compare import CompareError, kernel_errors, model_statistics
from gates.probe_output import MAX_FRAME_BYTES, decode_outputs, read_output_folder, split_frame
from gates.report import write_report
from gates.sandbox import sandbox_spec
from gates.serving.perf import PerfSettings
from gates.serving.serve import serve_check
from gates.static.integrity import inspect_image_files
from gates.tolerance import ToleranceEntry, ToleranceKey, Tolerances, catalog_tolerances, load_tolerances
from gates.verdict import (
    CheckResult,
    GateVerdict,
    PromptResult,
    ReferenceInfo,
    StatDecision,
    ToleranceInfo,
    decide,
    judge_kernels,
    judge_model,
    judge_pins,
    kernel_hard_failures,
    kernels_uncalibrated,
    serve_uncalibrated,
)
from imagetools.probe import host_driver

OnEvent = Callable[[str], None]
PROBE_MOUNT = "/skupin/probe.py"
# The probe's interpreter, by absolute path (the venv's link to the interpreter `pins` checked): never found through
# the image's PATH.
PROBE_PYTHON = f"{VENV}/bin/python3"
RUN_LABEL = "io.skupin.gate-run"
# The host-only files probe_in_container writes into OUT/probe/ (each created exclusively).
PROBE_FILES = ("probe.json", "tensors.safetensors", "container.log")
MAX_LOG_CHARS = 40_000



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


def reference_folder(*, manifest: SkuManifest, folder: Path | None = None) -> Path:
    """The reference bundle folder: `folder` when given, else the SKU's gate.reference (common/paths.py: data_path)."""
    return Path(folder) if folder else data_path(manifest.gate.reference)


def load_reference(*, manifest: SkuManifest, folder: Path | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray], str]:
    """Verify the SKU's reference bundle (hashes, model, prompt set, dtype) and read it: (meta, tensors, sha256)."""

    folder = reference_folder(manifest=manifest, folder=folder)
    if not folder.is_dir():
        raise BundleError(f"{folder}: reference bundle folder is missing (gate.reference of {manifest.name})")
    meta, tensors = load_bundle(folder=folder, manifest=manifest)
    return meta, tensors, bundle_sha256(folder)


def default_wheelhouse() -> Path | None:
    """$SKUPIN_WHEELHOUSE when set (where locked wheelhouse-only files such as the CPU torch wheel lie)."""
    value = os.environ.get("SKUPIN_WHEELHOUSE")
    return Path(value) if value else None


def image_from_build_record(sku: str) -> str:
    """The image of the SKU's build record (.skupin/builds/<sku>.json), or GateCouldNotRun with the fix."""

    path = state_dir() / "builds" / f"{sku}.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return str(record.get("image_id") or record["image"])
    except (OSError, ValueError, KeyError) as exc:
        raise GateCouldNotRun(f"{path}: no build record for {sku}; fix: skupin build {sku}, or pass --image") from exc


def resolve_image(*, docker: Docker, image: str) -> ImageInfo:
    """The ImageInfo (id, labels, ...) of local image `image`, or GateCouldNotRun."""
    info = docker.inspect_image(image)
    if info is None:
        raise GateCouldNotRun(f"image {image} is not on this engine; fix: build or load it first")
    return info


# ---------------------------------------------------------------- running the probe


def run_label(out: Path) -> str:
    """The value of the RUN_LABEL label on the probe container writing to `out` (find or clean up one run's container)."""
    return hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:16]


def probe_spec(*, manifest: SkuManifest, image: str, out: Path, model_dir: Path, batch_size: int | None = None,
               threads: int = 0):
    """The sandboxed container that runs the probe on `image` (see the module docstring); `out` only names the run
    (RUN_LABEL): the probe prints its outputs (`--out -`), nothing writable is mounted."""

    gate, engine = manifest.gate, manifest.stack.engine.name
    # the kernel battery only where the SKU's gate checks kernels (a llama.cpp image has no torch to run it)
    checks = "env,kernels,model" if "kernels" in gate.checks else "env,model"
    args = probe_args(model_dir=MODEL_MOUNT, out="-", dtype=gate.dtype, batch_size=batch_size or gate.batch_size,
                      engine=probe_adapter(engine), threads=threads, checks=checks)
    return sandbox_spec(
        manifest=manifest, image=image, entrypoint=(PROBE_PYTHON,), command=(PROBE_MOUNT, *args),
        env={"OMP_NUM_THREADS": str(threads)} if threads else None,
        mounts=(BindMount(source=PROBE.resolve(), target=PROBE_MOUNT, read_only=True),
                BindMount(source=model_dir.resolve(), target=MODEL_MOUNT, read_only=True)),
        labels={"io.skupin.role": "gate-probe", "io.skupin.sku": manifest.name, RUN_LABEL: run_label(out)},
        max_stdout_bytes=MAX_FRAME_BYTES,
    )


def read_probe_outputs(out: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """probe.json (JSON) and tensors.safetensors (validated, numpy) from a probe's output folder (bounded reads,
    no links followed; BundleError when malformed)."""
    return read_output_folder(Path(out))


def probe_in_container(*, manifest: SkuManifest, image: str, docker: Docker, out: Path, batch_size: int | None = None,
                       threads: int = 0, model_dir: Path | None = None) -> ProbeRun:
    """Run the probe on `image` in the sandbox and read its output frame; failures come back in ProbeRun.error.

    `out` is a host-only folder (the container never sees it): the raw probe.json and tensors.safetensors of a
    well-formed frame and container.log (exit status, stdout/stderr head and tail) are written there, each file
    created exclusively. `model_dir` is the folder from gates.bundle.model_folder (a gate or
    calibration run resolves it once); without it the SKU's fixture is resolved and checked here, for this probe only.
    """
    out_fd = _host_folder(Path(out))
    try:
        with contextlib.ExitStack() as scope:
            if model_dir is None:
                scratch = scope.enter_context(tempfile.TemporaryDirectory(prefix="skupin-fixture-"))
                model_dir = model_folder(manifest=manifest, scratch=Path(scratch))
            spec = probe_spec(manifest=manifest, image=image, out=Path(out), model_dir=model_dir,
                              batch_size=batch_size, threads=threads)
            try:
                result = docker.run(spec)
            except DockerError:
                raise
            except Exception as exc:  # the engine SDK's own errors (e.g. 409 when removed by someone else)
                raise DockerError(f"running the probe container failed: {exc}") from exc
        return _probe_run(result, deadline=float(manifest.gate.deadline_s), out_fd=out_fd)
    finally:
        os.close(out_fd)


def _host_folder(out: Path) -> int:
    """A descriptor of `out`, made if missing (a real folder, never a link), with PROBE_FILES removed
    (a link or FIFO of that name is removed, never followed); BundleError when that cannot be done."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"{out}: cannot make the probe's output folder: {exc}") from exc
    fd = open_folder(out)
    try:
        for name in PROBE_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
    except OSError as exc:
        os.close(fd)
        raise BundleError(f"{out}: cannot clear {PROBE_FILES}: {exc}") from exc
    return fd


def _probe_run(result: RunResult, *, deadline: float, out_fd: int) -> ProbeRun:
    """The ProbeRun of a finished probe container: its frame decoded, or the reason it is unusable."""
    tail = (result.stderr.strip() or printable(result.stdout_excerpt, 3000))[-3000:]
    problem = ""
    report: dict[str, Any] = {}
    tensors: dict[str, np.ndarray] = {}
    if result.timed_out:
        problem = f"the probe did not finish within the deadline of {deadline:.0f} s (container killed and removed)"
    elif result.overflow:
        problem = f"the probe container printed too much: {result.overflow}"
    else:
        try:
            report_raw, tensors_raw = split_frame(result.stdout_bytes)
            report, tensors = decode_outputs(report_raw, tensors_raw, source="the probe's output frame")
        except BundleError as exc:
            problem = (f"the container exited {result.exit_code} without usable outputs ({exc}); "
                       f"last output: {tail.strip()[-600:] or '(none)'}")
        else:
            problem = _keep(out_fd, ("probe.json", report_raw), ("tensors.safetensors", tensors_raw))
    problem = _keep(out_fd, ("container.log", _container_log(result, problem).encode("utf-8"))) or problem
    if problem:
        return ProbeRun(error=problem, timed_out=result.timed_out, exit_code=result.exit_code, seconds=result.seconds,
                        logs_tail=tail)
    return ProbeRun(report=report, tensors=tensors, exit_code=result.exit_code, seconds=result.seconds, logs_tail=tail)


def _keep(out_fd: int, *files: tuple[str, bytes | memoryview]) -> str:
    """Write `files` into the host-only output folder; '' or why the host could not (a full disk, say)."""
    for name, data in files:
        try:
            write_new_file(name, data, dir_fd=out_fd)
        except OSError as exc:
            return f"the host could not write the probe's {name}: {exc}"
    return ""


def _container_log(result: RunResult, problem: str) -> str:
    """container.log: how the probe container ended and the head and tail of what it printed."""
    stdout = (f"(one output frame, {len(result.stdout_bytes)} bytes)" if not problem
              else result.stdout_excerpt[-MAX_LOG_CHARS // 2:])
    return (f"exit {result.exit_code}; {result.seconds:.1f} s; timed out: {result.timed_out}; "
            f"overflow: {result.overflow or 'no'}\n{('problem: ' + problem + chr(10)) if problem else ''}"
            f"--- stdout\n{stdout}\n--- stderr\n{result.stderr[-MAX_LOG_CHARS:]}\n")


def reap_leftovers(*, docker: Docker, on_event: OnEvent) -> None:
    """Remove the sandbox containers of dead skupin processes (dockerd: Docker.reap_orphans) and say so."""
    try:
        reaped = docker.reap_orphans()
    except DockerError as exc:
        on_event(f"could not look for leftover containers: {exc}")
        return
    for leftover in reaped:
        on_event(f"removed a leftover container: {leftover.describe()}")


# ---------------------------------------------------------------- the checks


def _probe_check_error(report: dict[str, Any], name: str) -> str:
    check = (report.get("checks") or {}).get(name) or {}
    if check.get("status") == "ok":
        return ""
    return str(check.get("error") or f"the probe reported {name} as {check.get('status', 'missing')}")[:800]


def _skip_rest(checks: list[CheckResult], names: tuple[str, ...], why: str) -> None:
    done = {c.name for c in checks}
    checks.extend(CheckResult(name=n, status="skipped", reason=why) for n in names if n not in done)


@dataclass
class _GateRun:
    """One gate run: its inputs, the results recorded so far, and what the passed checks computed for the next.

    A check returns its CheckResult; the driver (`_run_checks`) records it and runs the next check only
    when it passed or was skipped, so a check reads only what the checks before it filled in.
    """

    stack: ResolvedStack
    image: str  # what is gated: resolved once by pins, its id used from then on
    docker: Docker
    out: Path
    on_event: OnEvent
    tolerances_path: Path
    reference: Path | None
    baseline: str | None
    serve_perf: PerfSettings | None
    scratch: Path  # one fixture folder for the whole run (boot resolves it, serve reuses it)
    wheelhouse: Path | None = None
    display: str = ""  # the name reports show for `image` when not `image` itself (the build's tag for its id)
    checks: list[CheckResult] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    image_id: str = ""  # filled by pins
    image_lock_label: str | None = None
    reference_info: ReferenceInfo | None = None  # filled by reference, with `ref`
    ref: dict[str, np.ndarray] = field(default_factory=dict)
    tolerances: Tolerances = field(default_factory=Tolerances)  # filled by the tolerance lookup, with the next three
    entry: ToleranceEntry | None = None
    tol_problem: str = ""
    tolerance_info: ToleranceInfo | None = None
    probe: ProbeRun = field(default_factory=ProbeRun)  # filled by boot, with `probe_summary` and `model_dir`
    probe_summary: dict[str, Any] = field(default_factory=dict)
    model_dir: Path | None = None
    decisions: tuple[StatDecision, ...] = ()  # filled by model, with `prompts`
    prompts: tuple[PromptResult, ...] = ()

    @property
    def manifest(self) -> SkuManifest:
        return self.stack.manifest

    @property
    def shown(self) -> str:
        """The image as reports name it."""
        return self.display or self.image

    @property
    def lock(self) -> Lock | None:
        return self.stack.current_lock

    def wanted(self, check: str) -> bool:
        return check in self.manifest.gate.checks

    def record(self, result: CheckResult) -> None:
        """Record a check's result and say it."""
        self.checks.append(result)
        self.on_event(f"{result.name}: {result.status}: {result.reason}")

    def time(self, name: str, since: float) -> None:
        self.timings[name] = round(time.monotonic() - since, 3)


def _check_reference(run: _GateRun) -> CheckResult:
    """The bundle's hashes, then its fit to the SKU (model, prompt set, dtype)."""
    t0 = time.monotonic()
    folder = reference_folder(manifest=run.manifest, folder=run.reference)
    try:
        meta, ref, ref_sha = load_reference(manifest=run.manifest, folder=folder)
    except BundleError as exc:
        return CheckResult(name="reference", status="error", reason=str(exc))
    run.ref = ref
    gpu, engine, model = meta.get("gpu") or {}, meta.get("engine") or {}, meta.get("model") or {}
    run.reference_info = ReferenceInfo(
        # the manifest's relative path when it is the SKU's own bundle (no host path in verdicts and attestations)
        path=str(folder) if run.reference else run.manifest.gate.reference, sha256=ref_sha, gpu=gpu.get("name"),
        driver=meta.get("driver"), torch=meta.get("torch"),
        engine=f"{engine.get('name')} {engine.get('version')}", model=model.get("name"),
        model_sha256=model.get("sha256"), prompts_sha256=(meta.get("prompts") or {}).get("sha256"),
        dtype=meta.get("dtype"))
    run.time("reference_s", t0)
    return CheckResult(name="reference", status="pass",
                       reason=f"bundle {ref_sha[:12]} verified: {model.get('name')} {meta.get('dtype')} "
                              f"on {gpu.get('name')}")


def _entry_for(run: _GateRun, key: ToleranceKey, ref_sha: str, *, calibrate: str) -> tuple[ToleranceEntry | None, str]:
    """The calibrated entry of `key` measured against the bundle `ref_sha`, or None and why there is none (with the
    `calibrate` command that fixes it)."""
    entry = run.tolerances.find(key)
    if entry is None:
        return None, f"no calibrated tolerance for {key.label()} in {run.tolerances_path}; fix: {calibrate} on that hardware"
    if entry.provenance.reference_sha256 != ref_sha:
        return None, (f"the tolerance of {key.label()} was calibrated against bundle "
                      f"{entry.provenance.reference_sha256[:12]}, not {ref_sha[:12]}; fix: {calibrate}")
    return entry, ""


def _find_tolerance(run: _GateRun) -> None:
    """The calibrated entry of the SKU's class x dtype x model; a missing one (or one of another bundle) is not fatal:
    every check then runs what it can without calibration and the run ends `uncalibrated`, never pass."""
    run.tolerances = load_tolerances(run.tolerances_path)
    m = run.manifest
    key = ToleranceKey(hardware_class=m.accelerator.hardware_class, dtype=m.gate.dtype, model=m.gate.model)
    ref_sha = run.reference_info.sha256 if run.reference_info is not None else ""
    run.entry, run.tol_problem = _entry_for(run, key, ref_sha, calibrate=f"skupin calibrate {m.name}")
    run.tolerance_info = ToleranceInfo(key=key.label(), source=str(run.tolerances_path),
                                       entry=run.entry.model_dump(mode="json") if run.entry else None,
                                       hard_bounds=run.tolerances.hard_bounds.model_dump())


def _summarise_probe(probe: ProbeRun) -> dict[str, Any]:
    report = probe.report
    env = report.get("env") or {}
    kept = ("status", "error", "wall_s", "load_s", "forward_s", "generate_s")
    return {"exit_code": probe.exit_code, "seconds": probe.seconds, "device": report.get("device"),
            "args": report.get("args"), "torch": env.get("torch"), "python": env.get("python"),
            "engines": env.get("engines"), "cpu_capability": env.get("cpu_capability"),
            "threads": env.get("threads"), "driver": env.get("driver"),
            "checks": {k: {kk: vv for kk, vv in v.items() if kk in kept}
                       for k, v in (report.get("checks") or {}).items()}}


def _check_boot(run: _GateRun) -> CheckResult:
    """Run the probe once in the sandbox: the image starts and reports its environment."""
    t0 = time.monotonic()
    try:
        run.on_event(f"booting {run.shown} ({run.image_id[:19]}) with the probe "
                     f"(deadline {run.manifest.gate.deadline_s} s)")
        run.model_dir = model_folder(manifest=run.manifest, scratch=run.scratch)
        probe = probe_in_container(manifest=run.manifest, image=run.image_id, docker=run.docker,
                                   out=run.out / "probe", model_dir=run.model_dir)
    except (GateCouldNotRun, DockerError, BundleError) as exc:
        return CheckResult(name="boot", status="error", reason=str(exc))
    run.probe = probe
    run.time("probe_container_s", t0)
    run.probe_summary = _summarise_probe(probe)
    env_problem = _probe_check_error(probe.report, "env")
    if probe.error or env_problem:
        return CheckResult(name="boot", status="error",
                           reason=probe.error or f"the probe could not read the environment: {env_problem}",
                           details={"logs_tail": probe.logs_tail[-2000:]})
    env = probe.report.get("env") or {}
    return CheckResult(name="boot", status="pass",
                       reason=f"the image booted and the probe ran in {probe.seconds:.1f} s (python "
                              f"{env.get('python')}, torch {env.get('torch')}, device {probe.report.get('device')})")


def _check_pins(run: _GateRun) -> CheckResult:
    """Before anything runs: the image's files are exactly its lock, read from its layers (gates/static/integrity.py);
    on a GPU host the host's driver is in the pinned series (read on the host, not from inside the image)."""

    t0 = time.monotonic()
    m, lock = run.manifest, run.lock
    try:
        info = resolve_image(docker=run.docker, image=run.image)
    except (GateCouldNotRun, DockerError) as exc:
        return CheckResult(name="pins", status="error", reason=str(exc))
    run.image_id = info.id
    run.image_lock_label = (info.labels or {}).get("io.skupin.lock-sha256")
    if lock is None:
        return CheckResult(name="pins", status="error",
                           reason=f"{m.name} has no current lock, so the image's files cannot be checked against one; "
                                  f"fix: skupin lock {m.name}")
    run.on_event(f"pins: checking the files of {run.shown} ({info.id[:19]}) against lock {lock.content_hash()[:12]}")
    try:
        dockerfile = render(run.stack).text  # what the image's config must be (builder/imageconfig.py)
        report = inspect_image_files(docker=run.docker, image_id=info.id, lock=lock, state=state_dir(),
                                     dockerfile=dockerfile, wheelhouse=run.wheelhouse, on_event=run.on_event)
    except SkupinError as exc:
        return CheckResult(name="pins", status="error", reason=f"the image's files could not be checked: {exc}")
    run.time("pins_s", t0)
    gpu_host = m.accelerator.vendor != "cpu"
    return judge_pins(report=report, manifest=m, host_driver=host_driver() if gpu_host else None, gpu_host=gpu_host)


def _check_kernels(run: _GateRun) -> CheckResult:
    """Hard bounds first (no calibration), then every op against its calibrated tolerance."""
    t0 = time.monotonic()
    results = kernel_errors(run.ref, run.probe.tensors)
    hard = kernel_hard_failures(results=results, hard=run.tolerances.hard_bounds)
    if hard:
        more = f" (+{len(hard) - 1} more)" if len(hard) > 1 else ""
        return CheckResult(name="kernels", status="fail", reason=hard[0] + more, details={"hard_bounds": hard})
    if run.entry is None:  # no calibrated entry: the hard bounds were all that could run (docs/GATE.md)
        problem = _probe_check_error(run.probe.report, "kernels")
        if problem:
            return CheckResult(name="kernels", status="error", reason=f"the probe's kernel battery failed: {problem}")
        return kernels_uncalibrated(results=results, why=run.tol_problem)
    result = judge_kernels(results=results, entry=run.entry)
    problem = _probe_check_error(run.probe.report, "kernels")
    if problem and result.status == "pass":
        result = CheckResult(name="kernels", status="error", reason=f"the probe's kernel battery failed: {problem}")
    run.time("kernels_s", t0)
    return result


def _check_model(run: _GateRun) -> CheckResult:
    """Teacher-forced statistics per prompt against the reference: hard bounds, binomial tests, means."""
    t0 = time.monotonic()
    problem = _probe_check_error(run.probe.report, "model")
    if problem:
        return CheckResult(name="model", status="error", reason=f"the probe's model check failed: {problem}")
    engine = run.manifest.stack.engine.name
    missing = sorted(f"model.{name}" for name in engine_outputs(engine)
                     if f"model.{name}" in run.ref and f"model.{name}" not in run.probe.tensors)
    if missing:
        return CheckResult(name="model", status="fail",
                           reason=f"the candidate returned no {', '.join(missing)}, which the {engine} engine provides: "
                                  "a statistic would be lost, so the model check fails instead of skipping it")
    try:
        stats = model_statistics(run.ref, run.probe.tensors)
    except CompareError as exc:
        return CheckResult(name="model", status="error", reason=str(exc))
    result, run.decisions, run.prompts = judge_model(stats=stats, entry=run.entry, hard=run.tolerances.hard_bounds,
                                                     dtype=run.manifest.gate.dtype, why=run.tol_problem)
    result = result.model_copy(update={"details": {**result.details, "engine_path": engine_path(run.probe.report)}})
    run.time("model_s", t0)
    return result


def _check_float32(run: _GateRun) -> CheckResult:
    """The float32 pass of a SKU that serves another dtype: the probe again, the fixture at float32, against the float32
    bundle beside the SKU's reference. A kernel wrong by 1% (an attention scale, a narrower accumulation) moves bf16
    outputs by less than one bf16 rounding, so the serving-dtype check cannot see it; at float32 it stands 10^2-10^5
    above the noise. Judged with the class's float32 entry when calibrated, else by the hard bounds alone (float32's
    mean logprob L2 bound among them), which ends the run `uncalibrated` at best."""
    m = run.manifest
    if m.gate.dtype == "float32":
        return CheckResult(name="float32", status="skipped",
                           reason="the SKU serves float32: its model check was the float32 pass")
    engine = m.stack.engine.name
    if not engine_float32(engine):
        return CheckResult(name="float32", status="skipped",
                           reason=f"the {engine} engine has no float32 path the gate runs (engines/{engine}.py: FLOAT32)")
    t0 = time.monotonic()
    try:
        folder = float32_reference(reference_folder(manifest=m, folder=run.reference), dtype=m.gate.dtype)
        m32 = float32_manifest(m)
        _, ref, ref_sha = load_reference(manifest=m32, folder=folder)
        # the model check only: the kernel battery is the same at any model dtype and ran in the boot's probe
        m32 = m32.model_copy(update={"gate": m32.gate.model_copy(
            update={"checks": tuple(c for c in m32.gate.checks if c != "kernels")})})
    except BundleError as exc:
        return CheckResult(name="float32", status="error", reason=f"no float32 bundle to compare with: {exc}")
    run.on_event(f"float32: booting {run.shown} again with the probe at float32 (against {folder})")
    try:
        probe = probe_in_container(manifest=m32, image=run.image_id, docker=run.docker, out=run.out / "probe-float32",
                                   model_dir=run.model_dir)
    except (GateCouldNotRun, DockerError, BundleError) as exc:
        return CheckResult(name="float32", status="error", reason=str(exc))
    run.time("float32_s", t0)
    problem = probe.error or _probe_check_error(probe.report, "model")
    if problem:
        return CheckResult(name="float32", status="error", reason=f"the float32 probe failed: {problem}",
                           details={"logs_tail": probe.logs_tail[-2000:]})
    try:
        stats = model_statistics(ref, probe.tensors)
    except CompareError as exc:
        return CheckResult(name="float32", status="error", reason=str(exc))
    key = ToleranceKey(hardware_class=m.accelerator.hardware_class, dtype="float32", model=m.gate.model)
    entry, why = _entry_for(run, key, ref_sha, calibrate=f"skupin calibrate {m.name} --float32")
    result, _, _ = judge_model(stats=stats, entry=entry, hard=run.tolerances.hard_bounds, dtype="float32", why=why,
                               name="float32")
    return result.model_copy(update={"details": {**result.details, "reference": str(folder), "reference_sha256": ref_sha,
                                                 "tolerance_key": key.label(), "calibrated": entry is not None,
                                                 "probe_seconds": probe.seconds}})


ENGINE_PATH_KEYS = ("engine", "engine_distribution", "engine_version", "hidden_states", "logprobs", "greedy")


def engine_path(report: dict[str, Any]) -> dict[str, str]:
    """What the probe says computed the model check (engine, its distribution and version, how hidden states,
    logprobs and greedy tokens were obtained), as short printable text: the image wrote it, so it is shown, not trusted."""
    model = (report.get("checks") or {}).get("model") if isinstance(report.get("checks"), dict) else None
    if not isinstance(model, dict):
        return {}
    return {key: printable(str(model[key]), 200) for key in ENGINE_PATH_KEYS if model.get(key) is not None}


def _check_serve(run: _GateRun) -> CheckResult:
    """The engine's own server: greedy completions vs the reference, speed (gates/serving/serve.py)."""

    if run.entry is None:  # its thresholds are calibrated: nothing of it can judge without them
        return serve_uncalibrated(run.tol_problem)
    t0 = time.monotonic()
    run.on_event("serve: booting the engine's server in the sandbox")
    result: CheckResult = serve_check(manifest=run.manifest, image=run.image_id, docker=run.docker, ref=run.ref,
                                      entry=run.entry, baseline=run.baseline, model_dir=run.model_dir,
                                      perf=run.serve_perf, on_event=run.on_event)
    run.time("serve_s", t0)
    return result


Check = Callable[[_GateRun], CheckResult | None]
# (check, the name of the result it returns or "" for none, the gate.checks entry it needs or None for always):
# a check whose entry is not in the SKU's gate.checks is recorded as skipped and not run.
CHECKS: tuple[tuple[Check, str, str | None], ...] = (
    (_check_reference, "reference", None),
    (_find_tolerance, "", None),
    (_check_pins, "pins", None),
    (_check_boot, "boot", None),
    (_check_kernels, "kernels", "kernels"),
    (_check_model, "model", "model"),
    (_check_float32, "float32", "model"),
    (_check_serve, "serve", "serve"),
)
CHECK_NAMES = tuple(name for _, name, _ in CHECKS if name)


def _run_checks(run: _GateRun) -> None:
    """Run the checks in order, recording each result; the first that neither passed nor was skipped ends the run
    (`uncalibrated` goes on: with no calibrated entry every check still runs its calibration-free part)."""
    for check, name, needs in CHECKS:
        if needs is not None and not run.wanted(needs):
            result: CheckResult | None = CheckResult(name=name, status="skipped",
                                                     reason=f"{needs} is not in the SKU's gate.checks")
        else:
            result = _guarded(check, name, run)
        if result is None:
            continue
        run.record(result)
        if result.status not in ("pass", "skipped", "uncalibrated"):
            return


def _guarded(check: Check, name: str, run: _GateRun) -> CheckResult | None:
    """The check's result; an exception it did not expect is an error result of that check (the run still ends
    in a verdict). KeyboardInterrupt and SystemExit pass."""
    try:
        return check(run)
    except Exception as exc:  # a crafted image must never turn a gate run into a traceback
        label = name or check.__name__.strip("_")
        return CheckResult(name=label, status="error",
                           reason=f"internal error in the {label} check: {type(exc).__name__}: {printable(str(exc), 800)}")


# ---------------------------------------------------------------- the stage


def gate(built: BuiltImage, docker: Docker, *, out: Path, on_event: OnEvent = _quiet,
         tolerances_path: Path | None = None, reference: Path | None = None, baseline: str | None = None,
         serve_perf: PerfSettings | None = None, wheelhouse: Path | None = None) -> GateVerdict:
    """The gate stage: gate the image `build` made, for the stack it was built from (see `gate_image`).

    It gates the image's id, so a tag moved since the build cannot change what is gated; reports show the tag.
    """
    return gate_image(stack=built.stack, image=built.image_id, display=built.image, docker=docker, out=out,
                      on_event=on_event, tolerances_path=tolerances_path, reference=reference, baseline=baseline,
                      serve_perf=serve_perf, wheelhouse=wheelhouse)


def gate_image(*, stack: ResolvedStack, image: str, docker: Docker, out: Path, on_event: OnEvent = _quiet,
               tolerances_path: Path | None = None, reference: Path | None = None, baseline: str | None = None,
               serve_perf: PerfSettings | None = None, wheelhouse: Path | None = None,
               display: str | None = None) -> GateVerdict:
    """Gate any local image `image` for the SKU of `stack` and write verdict.json, report.md and plot.png to `out`.

    `gate` is the stage for an image built here; this is the same gate for one that was not (`skupin
    gate --image`, a third-party image, the tests' tampered images). Checks run in
    order and the first one that does not pass stops the rest. `baseline` (an image) adds the serve
    check's interleaved A/B; `serve_perf` overrides its load. `display` is the name reports give `image`
    (verdict.json's `image`; its `image_id` is always the id that ran).
    """
    started = time.monotonic()
    created = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reap_leftovers(docker=docker, on_event=on_event)
    with tempfile.TemporaryDirectory(prefix="skupin-fixture-") as scratch:
        run = _GateRun(stack=stack, image=image, docker=docker, out=out, on_event=on_event,
                       tolerances_path=tolerances_path or catalog_tolerances(), reference=reference, baseline=baseline,
                       serve_perf=serve_perf, scratch=Path(scratch),
                       wheelhouse=wheelhouse if wheelhouse is not None else default_wheelhouse(),
                       display=display or "")
        _run_checks(run)
    return _finish(run, started=started, created=created)


def _finish(run: _GateRun, *, started: float, created: str) -> GateVerdict:
    """Skip what did not run, decide, and write verdict.json, report.md and plot.png."""

    _skip_rest(run.checks, CHECK_NAMES, "not evaluated: an earlier check did not pass")
    decision, reason = decide(tuple(run.checks))
    run.timings["total_s"] = round(time.monotonic() - started, 3)
    lock = run.lock
    verdict = GateVerdict(
        sku=run.manifest.name, hardware_class=run.manifest.accelerator.hardware_class, image=run.shown,
        image_id=run.image_id or None, lock_hash=lock.content_hash() if lock else None,
        image_lock_label=run.image_lock_label, reference=run.reference_info, tolerance=run.tolerance_info,
        checks=tuple(run.checks), model_decision=run.decisions, prompts=run.prompts, decision=decision, reason=reason,
        calibration_free={c.name: str(c.details.get("calibration_free", "")) for c in run.checks
                          if c.status == "uncalibrated"},
        timings=run.timings, probe=run.probe_summary, tool_version=__version__, created=created)
    t0 = time.monotonic()
    write_report(verdict=verdict, out=run.out)
    run.on_event(f"verdict: {decision}: {reason} (report {run.out / 'report.md'}; {time.monotonic() - t0:.1f} s)")
    return verdict
