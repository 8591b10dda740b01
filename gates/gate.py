"""Gate an image: run the probe in a sandboxed container, compare with the reference bundle, decide.

Stage function: ``gate(built, docker, *, out, on_event) -> GateVerdict`` for an image built here;
``gate_image(*, stack, image, docker, out, on_event)`` is the same gate for any local image. The probe
(skupin/imagetools/probe/: skupin_probe.py and its engine adapters) and the model fixture are mounted read-only into
the image under test; nothing the container can write is mounted. The container has no network, no capabilities,
no-new-privileges, a read-only root with a tmpfs /tmp, private IPC, the SKU's memory limit, a CPU
and a pid limit, an output cap and an in-container deadline, and is always removed (also at the
deadline, on a crash, Ctrl-C or when skupin itself is killed: the Docker adapter guarantees it).
The probe prints its outputs as one frame on stdout (``--out -``); the host parses it strictly
(gates/refdata/probe_output.py) and writes the raw outputs and the container's log into the host-only
folder OUT/probe/. Nothing is unpickled.
Checks, in order, stopping at the first hard failure: reference, pins (static, before anything of
the image runs: its files are its lock, gates/integrity/static.py), boot, kernels, ops (the engine's own ops against
float64 math on the host, gates/judge/ops.py), model, float32
(a SKU serving bf16 is probed again at float32 against the float32 bundle), serve
(gates/serving/serve.py: the engine's own server; `baseline` adds an interleaved A/B). Each check
is a GateCheck of the registry `CHECKS`: it takes the GateInputs and the typed outcomes of the earlier checks it
needs (ReferenceResult, ToleranceResult, PinsResult, BootResult) and returns its own (its CheckResult and what
later checks and the verdict take); the driver records each result and stops at the first that did not pass (an
exception a check did not expect is recorded as its error result, so every run ends in a verdict), and `_finish`
assembles the verdict from the outcomes.
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from skupin.builder.build import BuiltImage
from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.builder.catalog.lockfile import Lock
from skupin.builder.catalog.manifest import SkuManifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.builder.render import VENV, render
from skupin.common import __version__
from skupin.common.errors import BundleError, DockerError, GateCouldNotRun, SkupinError
from skupin.common.paths import data_path, env_wheelhouse, state_dir
from skupin.common.untrusted import open_folder, printable, write_new_file
from skupin.dockerd import BindMount, ContainerSpec, Docker, ImageInfo, RunResult
from skupin.engines import (
    MODEL_MOUNT,
    engine_float32,
    engine_module_inputs,
    engine_modules,
    engine_ops,
    engine_outputs,
    probe_adapter,
)
from skupin.gates.host import HostAccelerator, host_accelerator
from skupin.gates.integrity.binaries import check_binaries, load_rules
from skupin.gates.integrity.static import ImageFiles, inspect_image
from skupin.gates.judge.compare import CompareError, kernel_errors, model_statistics
from skupin.gates.judge.modules import host_model, missing_modules, with_modules
from skupin.gates.judge.ops import battery_bounds, judge_battery, judge_ops, missing_ops, spec_sha256
from skupin.gates.judge.smoke import judge_smoke
from skupin.gates.judge.tolerance import (
    ToleranceEntry,
    ToleranceKey,
    Tolerances,
    calibration_for,
    captured_ops,
    catalog_tolerances,
    load_tolerances,
)
from skupin.gates.judge.verdict import (
    CheckResult,
    GateVerdict,
    PromptResult,
    ReferenceInfo,
    StatDecision,
    ToleranceInfo,
    decide,
    judge_binaries,
    judge_kernels,
    judge_model,
    judge_pins,
    kernel_hard_failures,
    kernels_uncalibrated,
    serve_uncalibrated,
)
from skupin.gates.refdata.bundle import (
    PROBE,
    bundle_sha256,
    float32_manifest,
    float32_reference,
    load_bundle,
    model_folder,
    probe_args,
)
from skupin.gates.refdata.fixture import spec_for
from skupin.gates.refdata.probe_output import MAX_FRAME_BYTES, decode_outputs, read_output_folder, split_frame
from skupin.gates.report import write_report
from skupin.gates.sandbox import sandbox_spec
from skupin.gates.serving.perf import PerfSettings
from skupin.gates.serving.serve import serve_check
from skupin.imagetools.probe import smoke_imports

OnEvent = Callable[[str], None]
# The probe's folder (skupin/imagetools/probe/, bind-mounted read-only: its entry script's sys.path[0]) and that script.
PROBE_DIR_MOUNT = "/skupin"
PROBE_MOUNT = f"{PROBE_DIR_MOUNT}/{PROBE.name}"
# The probe's interpreter, by absolute path (the venv's link to the interpreter `pins` checked): never found through
# the image's PATH.
PROBE_PYTHON = f"{VENV}/bin/python3"
RUN_LABEL = "io.skupin.gate-run"
# The host-only files probe_in_container writes into OUT/probe/ (each created exclusively).
PROBE_FILES = ("probe.json", "tensors.safetensors", "container.log")
MAX_LOG_CHARS = 40_000
BINARY_RULES = "gates/data/binaries.yaml"  # the binaries check's declared exceptions (catalog-relative)



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
    """The reference bundle folder: `folder` when given, else the SKU's gate.reference (skupin/common/paths.py: data_path)."""
    return Path(folder) if folder else data_path(manifest.gate.reference)


def load_reference(*, manifest: SkuManifest, folder: Path | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray], str]:
    """Verify the SKU's reference bundle (hashes, model, prompt set, dtype) and read it: (meta, tensors, sha256)."""

    folder = reference_folder(manifest=manifest, folder=folder)
    if not folder.is_dir():
        raise BundleError(f"{folder}: reference bundle folder is missing (gate.reference of {manifest.name})")
    meta, tensors = load_bundle(folder=folder, manifest=manifest)
    return meta, tensors, bundle_sha256(folder)


def default_wheelhouse() -> Path | None:
    """$SKUPIN_WHEELHOUSE when set (where locked wheelhouse-only files such as the CPU torch wheel lie): the default of
    every command's --wheelhouse too (skupin/common/paths.py: env_wheelhouse)."""
    return env_wheelhouse()


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
               threads: int = 0, ops: bool = True) -> ContainerSpec:
    """The sandboxed container that runs the probe on `image` (see the module docstring); `out` only names the run
    (RUN_LABEL): the probe prints its outputs (`--out -`), nothing writable is mounted. `ops`: the engine op battery
    too (with the model check)."""

    gate, engine = manifest.gate, manifest.stack.engine.name
    # the kernel battery only where the SKU's gate checks kernels (a llama.cpp image has no torch to run it)
    checks = "env,kernels,model" if "kernels" in gate.checks else "env,model"
    if ops and "model" in gate.checks:
        checks += ",ops"
    args = probe_args(model_dir=MODEL_MOUNT, out="-", dtype=gate.dtype, batch_size=batch_size or gate.batch_size,
                      engine=probe_adapter(engine), threads=threads, checks=checks,
                      full_logprobs=spec_for(gate.model).full_logprobs)
    return sandbox_spec(
        manifest=manifest, image=image, entrypoint=(PROBE_PYTHON,), command=(PROBE_MOUNT, *args),
        env={"OMP_NUM_THREADS": str(threads)} if threads else None,
        mounts=(BindMount(source=PROBE.parent.resolve(), target=PROBE_DIR_MOUNT, read_only=True),
                BindMount(source=model_dir.resolve(), target=MODEL_MOUNT, read_only=True)),
        labels={"io.skupin.role": "gate-probe", "io.skupin.sku": manifest.name, RUN_LABEL: run_label(out)},
        max_stdout_bytes=MAX_FRAME_BYTES,
    )


def read_probe_outputs(out: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """probe.json (JSON) and tensors.safetensors (validated, numpy) from a probe's output folder (bounded reads,
    no links followed; BundleError when malformed)."""
    return read_output_folder(Path(out))


def probe_in_container(*, manifest: SkuManifest, image: str, docker: Docker, out: Path, batch_size: int | None = None,
                       threads: int = 0, model_dir: Path | None = None, ops: bool = True) -> ProbeRun:
    """Run the probe on `image` in the sandbox and read its output frame; failures come back in ProbeRun.error.

    `out` is a host-only folder (the container never sees it): the raw probe.json and tensors.safetensors of a
    well-formed frame and container.log (exit status, stdout/stderr head and tail) are written there, each file
    created exclusively. `model_dir` is the folder from gates.refdata.bundle.model_folder (a gate or
    calibration run resolves it once); without it the SKU's fixture is resolved and checked here, for this probe only.
    """
    out_fd = _host_folder(Path(out))
    try:
        with contextlib.ExitStack() as scope:
            if model_dir is None:
                scratch = scope.enter_context(tempfile.TemporaryDirectory(prefix="skupin-fixture-"))
                model_dir = model_folder(manifest=manifest, scratch=Path(scratch))
            spec = probe_spec(manifest=manifest, image=image, out=Path(out), model_dir=model_dir,
                              batch_size=batch_size, threads=threads, ops=ops)
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


@dataclass
class Stopwatch:
    """The run's timings (verdict.json's `timings`): each check adds the spans it measured, in the order measured.

    Like `on_event`, a sink the checks write to, never read: what a check gives a later one is its outcome."""

    spans: dict[str, float] = field(default_factory=dict)

    def time(self, name: str, since: float) -> None:
        self.spans[name] = round(time.monotonic() - since, 3)


@dataclass(frozen=True)
class GateInputs:
    """What one gate run is asked: the stack, the image, where it writes and how it may run. Every check takes it."""

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
    accelerator: HostAccelerator | None = None  # what this host has for the SKU's family (None: look when asked)
    pre_gate: bool = False  # stop before boot: only the checks that need no accelerator (`skupin gate --pre-gate`)
    clock: Stopwatch = field(default_factory=Stopwatch)

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

    def host(self) -> HostAccelerator:
        """This host's accelerator for the SKU's family (gates/host.py), as the run was given it or looked at now."""
        return self.accelerator or host_accelerator(self.manifest.base.family)


# What each check returns: its CheckResult and what later checks (and the verdict) take of it. A check returns its
# outcome also when it did not pass, with what it had established (pins: the image's id; boot: the probe's summary).


class Outcome(Protocol):
    """What every check returns: its CheckResult (None for the tolerance lookup, which records none)."""

    @property
    def check(self) -> CheckResult | None: ...


@dataclass(frozen=True)
class Judged:
    """The outcome of a check that gives later checks nothing but its CheckResult (kernels, float32, serve, a skip)."""

    check: CheckResult


@dataclass(frozen=True)
class ReferenceResult:
    """reference: the verified bundle's facts (verdict.json's `reference`) and its tensors."""

    check: CheckResult
    info: ReferenceInfo | None = None
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ToleranceResult:
    """The tolerance lookup: the tolerance file, the SKU's calibrated entry or why there is none, and verdict.json's
    `tolerance`. No CheckResult: a missing entry is not fatal (every check then runs its calibration-free part)."""

    tolerances: Tolerances = field(default_factory=Tolerances)
    entry: ToleranceEntry | None = None
    problem: str = ""  # why `entry` is None ('' with an entry)
    info: ToleranceInfo | None = None
    check: CheckResult | None = None


@dataclass(frozen=True)
class PinsResult:
    """pins: the id of the image that is gated from then on, its io.skupin.lock-sha256 label, and the files it read
    (the binaries check reads the same view, never the image again)."""

    check: CheckResult
    image_id: str = ""
    lock_label: str | None = None
    files: ImageFiles | None = None


@dataclass(frozen=True)
class BootResult:
    """boot: the probe's run, its summary (verdict.json's `probe`) and the model fixture folder later probes reuse."""

    check: CheckResult
    probe: ProbeRun = field(default_factory=ProbeRun)
    summary: dict[str, Any] = field(default_factory=dict)
    model_dir: Path | None = None


@dataclass(frozen=True)
class ModelResult:
    """model: the decision of each statistic and each prompt's result (verdict.json's `model_decision`, `prompts`)."""

    check: CheckResult
    decisions: tuple[StatDecision, ...] = ()
    prompts: tuple[PromptResult, ...] = ()


T = TypeVar("T")


@dataclass(frozen=True)
class Results:
    """The outcomes of the checks run so far, in order; a check takes an earlier one's by its type (each type but
    Judged is returned by one check only)."""

    outcomes: tuple[Outcome, ...] = ()

    def then(self, outcome: Outcome) -> Results:
        return Results((*self.outcomes, outcome))

    def get(self, kind: type[T]) -> T | None:
        return next((o for o in self.outcomes if isinstance(o, kind)), None)

    def need(self, kind: type[T]) -> T:
        found = self.get(kind)
        if found is None:
            raise LookupError(f"no {kind.__name__}: the check that gives it has not run (gates/gate.py: CHECKS order)")
        return found

    @property
    def checks(self) -> tuple[CheckResult, ...]:
        """The recorded CheckResults, in order."""
        return tuple(o.check for o in self.outcomes if o.check is not None)


def _check_reference(inputs: GateInputs) -> ReferenceResult:
    """The bundle's hashes, then its fit to the SKU (model, prompt set, dtype)."""
    t0 = time.monotonic()
    m = inputs.manifest
    folder = reference_folder(manifest=m, folder=inputs.reference)
    try:
        meta, ref, ref_sha = load_reference(manifest=m, folder=folder)
    except BundleError as exc:
        return ReferenceResult(CheckResult(name="reference", status="error", reason=str(exc)))
    gpu, engine, model = meta.get("gpu") or {}, meta.get("engine") or {}, meta.get("model") or {}
    info = ReferenceInfo(
        # the manifest's relative path when it is the SKU's own bundle (no host path in verdicts and attestations)
        path=str(folder) if inputs.reference else m.gate.reference, sha256=ref_sha, gpu=gpu.get("name"),
        driver=meta.get("driver"), torch=meta.get("torch"),
        engine=f"{engine.get('name')} {engine.get('version')}", model=model.get("name"),
        model_sha256=model.get("sha256"), prompts_sha256=(meta.get("prompts") or {}).get("sha256"),
        dtype=meta.get("dtype"))
    inputs.clock.time("reference_s", t0)
    return ReferenceResult(CheckResult(name="reference", status="pass",
                                       reason=f"bundle {ref_sha[:12]} verified: {model.get('name')} {meta.get('dtype')} "
                                              f"on {gpu.get('name')}"),
                           info=info, tensors=ref)


def _entry_for(inputs: GateInputs, tolerances: Tolerances, ref_sha: str, *, float32: bool = False
               ) -> tuple[ToleranceEntry | None, str]:
    """The entry that holds for the SKU's gate (or its float32 pass) against the bundle `ref_sha`, or None and why
    there is none, ending in the exact `skupin calibrate` command to run on this hardware for this image: the one
    decision `skupin check` and the matrix make too (gates/judge/tolerance.py: calibration_for)."""
    found = calibration_for(inputs.manifest, tolerances, reference_sha256=ref_sha, float32=float32,
                            image=inputs.display or inputs.image, path=inputs.tolerances_path)
    return found.entry, found.why


def _find_tolerance(inputs: GateInputs, reference: ReferenceResult) -> ToleranceResult:
    """The calibrated entry of the SKU's class x dtype x model; a missing one (or one of another bundle or, on an
    accelerator, of another engine release) is not fatal: every check then runs what it can without calibration and
    the run ends `uncalibrated`, never pass."""
    tolerances = load_tolerances(inputs.tolerances_path)
    m = inputs.manifest
    key = ToleranceKey.of(m)
    ref_sha = reference.info.sha256 if reference.info is not None else ""
    entry, problem = _entry_for(inputs, tolerances, ref_sha)
    info = ToleranceInfo(key=key.label(), source=str(inputs.tolerances_path),
                         entry=entry.model_dump(mode="json") if entry else None,
                         hard_bounds=tolerances.hard_bounds.model_dump())
    return ToleranceResult(tolerances=tolerances, entry=entry, problem=problem, info=info)


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


def _check_boot(inputs: GateInputs, pins: PinsResult) -> BootResult:
    """Run the probe once in the sandbox: the image starts and reports its environment. A GPU image on a host without
    its accelerator is not booted: the run ends "could not run" after the checks that need none."""
    t0 = time.monotonic()
    m = inputs.manifest
    host = inputs.host()
    if not host.present:
        return BootResult(CheckResult(
            name="boot", status="error",
            reason=f"could not run: no {m.accelerator.hardware_class} accelerator here ({host.evidence}); what needs "
                   f"none ran first (reference, pins, binaries, smoke); run the gate on a {m.accelerator.device} host",
            details={"accelerator": host.evidence, "no_accelerator": True}))
    try:
        inputs.on_event(f"booting {inputs.shown} ({pins.image_id[:19]}) with the probe "
                        f"(deadline {inputs.manifest.gate.deadline_s} s)")
        model_dir = model_folder(manifest=inputs.manifest, scratch=inputs.scratch)
        probe = probe_in_container(manifest=inputs.manifest, image=pins.image_id, docker=inputs.docker,
                                   out=inputs.out / "probe", model_dir=model_dir)
    except (GateCouldNotRun, DockerError, BundleError) as exc:
        return BootResult(CheckResult(name="boot", status="error", reason=str(exc)))
    inputs.clock.time("probe_container_s", t0)
    summary = _summarise_probe(probe)
    env_problem = _probe_check_error(probe.report, "env")
    if probe.error or env_problem:
        result = CheckResult(name="boot", status="error",
                             reason=probe.error or f"the probe could not read the environment: {env_problem}",
                             details={"logs_tail": probe.logs_tail[-2000:]})
    else:
        env = probe.report.get("env") or {}
        result = CheckResult(name="boot", status="pass",
                             reason=f"the image booted and the probe ran in {probe.seconds:.1f} s (python "
                                    f"{env.get('python')}, torch {env.get('torch')}, device {probe.report.get('device')})")
    return BootResult(result, probe=probe, summary=summary, model_dir=model_dir)


def _check_pins(inputs: GateInputs) -> PinsResult:
    """Before anything runs: the image's files are exactly its lock, read from its layers (gates/integrity/static.py);
    on a GPU host the host's driver is in the pinned series (read on the host, not from inside the image). What it
    learned of the image (its id, its lock label) is in its outcome however the check of its files ends."""
    t0 = time.monotonic()
    try:
        info = resolve_image(docker=inputs.docker, image=inputs.image)
    except (GateCouldNotRun, DockerError) as exc:
        return PinsResult(CheckResult(name="pins", status="error", reason=str(exc)))
    files: ImageFiles | None = None
    try:
        result, files = _check_pinned_files(inputs, info, since=t0)
    except Exception as exc:  # as _guarded would, keeping the image's id
        result = _internal_error("pins", exc)
    return PinsResult(result, image_id=info.id, lock_label=(info.labels or {}).get("io.skupin.lock-sha256"),
                      files=files)


def _check_pinned_files(inputs: GateInputs, info: ImageInfo, *, since: float
                        ) -> tuple[CheckResult, ImageFiles | None]:
    """The pins check of the resolved image `info`: its files against the lock, the host's driver (`pins_s` counts
    from `since`, the check's start); and the files it read, for the binaries check."""
    m, lock = inputs.manifest, inputs.lock
    if lock is None:
        return CheckResult(name="pins", status="error",
                           reason=f"{m.name} has no current lock, so the image's files cannot be checked against one; "
                                  f"fix: skupin lock {m.name}"), None
    inputs.on_event(f"pins: checking the files of {inputs.shown} ({info.id[:19]}) against lock "
                    f"{lock.content_hash()[:12]}")
    try:
        dockerfile = render(inputs.stack).text  # what the image's config must be (builder/imageconfig.py)
        report, files = inspect_image(docker=inputs.docker, image_id=info.id, lock=lock, state=state_dir(),
                                      dockerfile=dockerfile, wheelhouse=inputs.wheelhouse, on_event=inputs.on_event)
    except SkupinError as exc:
        return CheckResult(name="pins", status="error", reason=f"the image's files could not be checked: {exc}"), None
    inputs.clock.time("pins_s", since)
    host = inputs.host()  # the driver's series is checked where the accelerator is (a GPU host)
    gpu_host = ALL_FAMILIES[m.base.family].accelerated and host.present
    return judge_pins(report=report, manifest=m, host_driver=host.driver if gpu_host else None, gpu_host=gpu_host), files


def _check_binaries(inputs: GateInputs, pins: PinsResult) -> Judged:
    """Before anything runs: every ELF file the build added resolves its NEEDED inside the image (or on the host,
    for the family's host-injected driver libraries), and its device code runs on the SKU's arch
    (gates/integrity/binaries.py); read from the view pins read, headers only."""
    if pins.files is None:
        return Judged(CheckResult(name="binaries", status="error",
                                  reason="the pins check read no file view of the image to check binaries in"))
    t0 = time.monotonic()
    m = inputs.manifest
    report = check_binaries(view=pins.files.view, base_layers=pins.files.base_layers, env=pins.files.env,
                            family=ALL_FAMILIES[m.base.family], arch=m.accelerator.arch, platform=m.base.platform,
                            rules=load_rules(data_path(BINARY_RULES)))
    inputs.clock.time("binaries_s", t0)
    return Judged(judge_binaries(report))


# What the smoke container's environment says of GPUs, over the image's: CUDA base images set NVIDIA_VISIBLE_DEVICES=all
# in their config, and where nvidia is Docker's default runtime that variable alone attaches every GPU, no --gpus
# asked; `void` makes the NVIDIA runtime act as runc (no devices, no driver libraries), as the smoke test promises.
NO_ACCELERATOR_ENV = {"NVIDIA_VISIBLE_DEVICES": "void"}


def smoke_spec(*, manifest: SkuManifest, image: str, out: Path) -> ContainerSpec:
    """The sandboxed container of the import smoke test: the probe's `env,smoke` checks, no model, and no accelerator
    (no GPU request, none of the SKU's devices, NO_ACCELERATOR_ENV over the image's), whatever the host has."""
    args = ["--out", "-", "--device", "cpu", "--engine", probe_adapter(manifest.stack.engine.name), "--checks", "env,smoke"]
    spec = sandbox_spec(
        manifest=manifest, image=image, entrypoint=(PROBE_PYTHON,), command=(PROBE_MOUNT, *args),
        mounts=(BindMount(source=PROBE.parent.resolve(), target=PROBE_DIR_MOUNT, read_only=True),),
        labels={"io.skupin.role": "gate-smoke", "io.skupin.sku": manifest.name, RUN_LABEL: run_label(out)},
        env=dict(NO_ACCELERATOR_ENV), max_stdout_bytes=MAX_FRAME_BYTES)
    return spec.model_copy(update={"gpus": False, "devices": (), "group_add": ()})


def _check_smoke(inputs: GateInputs, pins: PinsResult) -> Judged:
    """The import smoke test with no accelerator attached (skupin_probe_smoke.py, judged by gates/judge/smoke.py), for
    the families that compute on one; a CPU image's boot check is its import test."""
    m = inputs.manifest
    family = ALL_FAMILIES[m.base.family]
    if not family.accelerated:
        return Judged(CheckResult(name="smoke", status="skipped",
                                  reason="a CPU image needs no accelerator: its boot check is its import test"))
    t0 = time.monotonic()
    out = inputs.out / "smoke"
    inputs.on_event(f"smoke: importing {m.stack.engine.name} and loading its runtime libraries with no accelerator")
    out_fd = _host_folder(out)
    try:
        result = inputs.docker.run(smoke_spec(manifest=m, image=pins.image_id, out=out))
        probe = _probe_run(result, deadline=float(m.gate.deadline_s), out_fd=out_fd)
    except DockerError as exc:
        return Judged(CheckResult(name="smoke", status="error", reason=f"the smoke container could not run: {exc}"))
    finally:
        os.close(out_fd)
    inputs.clock.time("smoke_s", t0)
    report = (probe.report.get("checks") or {}).get("smoke")
    if probe.error or not isinstance(report, dict) or report.get("status") != "ok":
        why = probe.error or _probe_check_error(probe.report, "smoke") or "no smoke report"
        return Judged(CheckResult(name="smoke", status="error", reason=f"the smoke test did not run: {printable(why, 600)}",
                                  details={"logs_tail": probe.logs_tail[-2000:]}))
    expected = smoke_imports(probe_adapter(m.stack.engine.name))  # what the probe was asked to import
    return Judged(judge_smoke(report, host_libraries=family.host_libraries, family=family.name, expected=expected,
                              rules=load_rules(data_path(BINARY_RULES))))


def _check_kernels(inputs: GateInputs, reference: ReferenceResult, tolerance: ToleranceResult, boot: BootResult
                   ) -> Judged:
    """Hard bounds first (no calibration), then every op against its calibrated tolerance."""
    t0 = time.monotonic()
    results = kernel_errors(reference.tensors, boot.probe.tensors)
    hard = kernel_hard_failures(results=results, hard=tolerance.tolerances.hard_bounds)
    if hard:
        more = f" (+{len(hard) - 1} more)" if len(hard) > 1 else ""
        return Judged(CheckResult(name="kernels", status="fail", reason=hard[0] + more, details={"hard_bounds": hard}))
    if tolerance.entry is None:  # no calibrated entry: the hard bounds were all that could run (docs/GATE.md)
        problem = _probe_check_error(boot.probe.report, "kernels")
        if problem:
            return Judged(CheckResult(name="kernels", status="error",
                                      reason=f"the probe's kernel battery failed: {problem}"))
        return Judged(kernels_uncalibrated(results=results, why=tolerance.problem))
    result = judge_kernels(results=results, entry=tolerance.entry)
    problem = _probe_check_error(boot.probe.report, "kernels")
    if problem and result.status == "pass":
        result = CheckResult(name="kernels", status="error", reason=f"the probe's kernel battery failed: {problem}")
    inputs.clock.time("kernels_s", t0)
    return Judged(result)


def _check_ops(inputs: GateInputs, tolerance: ToleranceResult, boot: BootResult) -> Judged:
    """The engine op battery (gates/judge/ops.py): each op of the engine's own path, as the image ran it at the serving
    dtype and at float32, against float64 math on the host; hard bounds always, the class's calibrated op bounds
    where its entry has them."""
    t0 = time.monotonic()
    report = (boot.probe.report.get("checks") or {}).get("ops")
    problem = _probe_check_error(boot.probe.report, "ops")
    if problem or not isinstance(report, dict) or not isinstance(report.get("ops"), dict):
        return Judged(CheckResult(name="ops", status="error",
                                  reason=f"the probe's op battery failed: {printable(problem or 'no ops report', 400)}"))
    m = inputs.manifest
    tf32 = "tf32" in m.gate.reduced_precision
    entry = tolerance.entry
    calibrated: dict[str, dict[str, float]] | None = (
        {op: {str(k): v for k, v in row.items()} for op, row in entry.ops.items()} if entry else None)
    spec_now = spec_sha256(captured=entry is not None and captured_ops(entry.key))
    if entry is not None and entry.ops and entry.ops_spec != spec_now:  # bounds of other inputs: not applied
        return Judged(CheckResult(
            name="ops", status="uncalibrated",
            reason=f"the op bounds of {ToleranceKey.of(m).label()} were calibrated on another battery spec "
                   f"({entry.ops_spec[:12] or 'unrecorded'}, not {spec_now[:12]}); fix: skupin calibrate {m.name}",
            details={"why": "op bounds of another battery spec", "calibration_free": "not run"}))
    dtypes = tuple(dict.fromkeys((m.gate.dtype, "float32")))
    battery = judge_battery(boot.probe.tensors, report, tf32=tf32, calibrated=calibrated, dtypes=dtypes)
    # read in the image after the battery ran, and again after the model check (an engine may switch as it loads)
    settings = {**_dict(report.get("settings")), **{k: v for k, v in _dict(report.get("settings_after_model")).items()
                                                   if v not in (False, "highest", "ieee")}}
    engine = m.stack.engine.name
    expected = engine_ops(engine, moe=_is_moe(boot.model_dir))
    missing = missing_ops(battery, expected=expected, dtypes=dtypes)
    model = host_model(m.gate.model) if engine_modules(engine) else None
    captured = engine_module_inputs(engine) == "captured"
    if model is not None and captured and m.gate.weights != "full":
        # the engine computes with the quantized weights it serves, the host has the fixture's full-precision ones:
        # a comparison would measure the quantization, not the kernels (the model check judges the weights)
        battery = replace(battery, uncovered={
            **battery.uncovered, "modules": f"the served weights are {m.gate.weights}: the host recomputes modules "
                                            "with the fixture's full-precision weights only"})
        model = None
    hard_only_why = ""
    if model is not None and captured and not (entry is not None and entry.key.engine == engine):
        # captured modules take calibrated bounds only from the engine's own entry (calibrated on its own forward): a
        # class entry's module bounds are of seeded inputs, so they judge neither these modules nor their absence
        calibrated = {k: dict(v) for k, v in battery_bounds(calibrated).items()} if calibrated else calibrated
        hard_only_why = (f"captured from {engine}'s own forward, which only an entry keyed to {engine} bounds "
                         "(gate.tolerance_per_engine)")
    if model is not None:  # the modules of the model as the engine loaded it, with the fixture's own weights
        # captured from the engine's own forward (llama.cpp): at the serving dtype only, as the image serves it
        module_dtypes = (m.gate.dtype,) if captured else dtypes
        battery = with_modules(battery, boot.probe.tensors, report, model, dtypes=module_dtypes, calibrated=calibrated,
                               tf32=tf32, captured=captured)
        if not any(r.op == "modules" for r in battery.results):  # else that result says why none came back
            said = _dict(_dict(report.get("modules")).get("uncovered"))
            missing += [k for dtype in module_dtypes
                        for k in missing_modules(list(battery.results), model, dtype=dtype, uncovered=said)]
    result = judge_ops(battery, calibrated=calibrated, entry_key=ToleranceKey.of(m).label(),
                       why=tolerance.problem if entry is None else "", tf32_declared=tf32, settings=settings,
                       engine=engine, missing=missing, hard_only_why=hard_only_why)
    inputs.clock.time("ops_s", t0)
    return Judged(result)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _is_moe(model_dir: Path | None) -> bool:
    """Whether the fixture the gate mounted (the host's own copy, checked against its SHA256SUMS) is a mixture of
    experts; False when it has no config.json (a GGUF-only folder)."""
    if model_dir is None:
        return False
    try:
        with open(Path(model_dir) / "config.json", encoding="utf-8") as fh:
            return bool(json.load(fh).get("num_local_experts"))
    except (OSError, ValueError, AttributeError):
        return False


def _check_model(inputs: GateInputs, reference: ReferenceResult, tolerance: ToleranceResult, boot: BootResult
                 ) -> ModelResult:
    """Teacher-forced statistics per prompt against the reference: hard bounds, binomial tests, means."""
    t0 = time.monotonic()
    ref, probe = reference.tensors, boot.probe
    problem = _probe_check_error(probe.report, "model")
    if problem:
        return ModelResult(CheckResult(name="model", status="error", reason=f"the probe's model check failed: {problem}"))
    missing = _missing_outputs(inputs.manifest.stack.engine.name, ref, probe.tensors, name="model")
    if missing is not None:
        return ModelResult(missing)
    try:
        stats = model_statistics(ref, probe.tensors)
    except CompareError as exc:
        return ModelResult(CheckResult(name="model", status="error", reason=str(exc)))
    result, decisions, prompts = judge_model(stats=stats, entry=tolerance.entry, hard=tolerance.tolerances.hard_bounds,
                                             dtype=inputs.manifest.gate.dtype, why=tolerance.problem,
                                             tf32="tf32" in inputs.manifest.gate.reduced_precision)
    result = result.model_copy(update={"details": {**result.details, "engine_path": engine_path(probe.report)}})
    inputs.clock.time("model_s", t0)
    return ModelResult(result, decisions=decisions, prompts=prompts)


def _missing_outputs(engine: str, ref: dict[str, np.ndarray], candidate: dict[str, np.ndarray], *, name: str
                     ) -> CheckResult | None:
    """A failing `name` result when the candidate left out an output the reference has and its engine provides
    (skupin/engines/<engine>.py OUTPUTS): a statistic would be lost, so the check fails instead of skipping it."""
    missing = sorted(f"model.{out}" for out in engine_outputs(engine)
                     if f"model.{out}" in ref and f"model.{out}" not in candidate)
    if not missing:
        return None
    return CheckResult(name=name, status="fail",
                       reason=f"the candidate returned no {', '.join(missing)}, which the {engine} engine provides: "
                              "a statistic would be lost, so the check fails instead of skipping it")


def _check_float32(inputs: GateInputs, pins: PinsResult, tolerance: ToleranceResult, boot: BootResult) -> Judged:
    """The float32 pass of a SKU that serves another dtype: the probe again, the fixture at float32, against the float32
    bundle beside the SKU's reference. A kernel wrong by 1% (an attention scale, a narrower accumulation) moves bf16
    outputs by less than one bf16 rounding, so the serving-dtype check cannot see it; at float32 it stands 10^2-10^5
    above the noise. Judged with the class's float32 entry when calibrated, else by the hard bounds alone (float32's
    mean logprob L2 bound among them), which ends the run `uncalibrated` at best."""
    m = inputs.manifest
    if m.gate.dtype == "float32":
        return Judged(CheckResult(name="float32", status="skipped",
                                  reason="the SKU serves float32: its model check was the float32 pass"))
    engine = m.stack.engine.name
    if not engine_float32(engine):
        return Judged(CheckResult(
            name="float32", status="skipped",
            reason=f"the {engine} engine has no float32 path the gate runs (skupin/engines/{engine}.py: FLOAT32)"))
    t0 = time.monotonic()
    try:
        folder = float32_reference(reference_folder(manifest=m, folder=inputs.reference), dtype=m.gate.dtype)
        m32 = float32_manifest(m)
        _, ref, ref_sha = load_reference(manifest=m32, folder=folder)
        # the model check only: the kernel battery is the same at any model dtype and ran in the boot's probe
        m32 = m32.model_copy(update={"gate": m32.gate.model_copy(
            update={"checks": tuple(c for c in m32.gate.checks if c != "kernels")})})
    except BundleError as exc:
        return Judged(CheckResult(name="float32", status="error", reason=f"no float32 bundle to compare with: {exc}"))
    inputs.on_event(f"float32: booting {inputs.shown} again with the probe at float32 (against {folder})")
    try:
        probe = probe_in_container(manifest=m32, image=pins.image_id, docker=inputs.docker,
                                   out=inputs.out / "probe-float32", model_dir=boot.model_dir, ops=False)
    except (GateCouldNotRun, DockerError, BundleError) as exc:
        return Judged(CheckResult(name="float32", status="error", reason=str(exc)))
    inputs.clock.time("float32_s", t0)
    problem = probe.error or _probe_check_error(probe.report, "model")
    if problem:
        return Judged(CheckResult(name="float32", status="error", reason=f"the float32 probe failed: {problem}",
                                  details={"logs_tail": probe.logs_tail[-2000:]}))
    missing = _missing_outputs(engine, ref, probe.tensors, name="float32")
    if missing is not None:
        return Judged(missing)
    try:
        stats = model_statistics(ref, probe.tensors)
    except CompareError as exc:
        return Judged(CheckResult(name="float32", status="error", reason=str(exc)))
    key = ToleranceKey.of(m, float32=True)
    entry, why = _entry_for(inputs, tolerance.tolerances, ref_sha, float32=True)
    tf32 = "tf32" in m.gate.reduced_precision
    result, _, _ = judge_model(stats=stats, entry=entry, hard=tolerance.tolerances.hard_bounds, dtype="float32", why=why,
                               name="float32", tf32=tf32)
    return Judged(result.model_copy(update={"details": {
        **result.details, "reference": str(folder), "reference_sha256": ref_sha, "tolerance_key": key.label(),
        "tolerance_entry": entry.model_dump(mode="json") if entry is not None else None,  # attested (publish)
        "calibrated": entry is not None, "probe_seconds": probe.seconds,
        **({"tf32_declared": True, "note": "TF32 declared: the float32 mean logprob L2 hard bound is not applied"}
           if tf32 else {})}}))


ENGINE_PATH_KEYS = ("engine", "engine_distribution", "engine_version", "hidden_states", "logprobs", "greedy")


def engine_path(report: dict[str, Any]) -> dict[str, str]:
    """What the probe says computed the model check (engine, its distribution and version, how hidden states,
    logprobs and greedy tokens were obtained), as short printable text: the image wrote it, so it is shown, not trusted."""
    model = (report.get("checks") or {}).get("model") if isinstance(report.get("checks"), dict) else None
    if not isinstance(model, dict):
        return {}
    return {key: printable(str(model[key]), 200) for key in ENGINE_PATH_KEYS if model.get(key) is not None}


def _check_serve(inputs: GateInputs, reference: ReferenceResult, tolerance: ToleranceResult, pins: PinsResult,
                 boot: BootResult) -> Judged:
    """The engine's own server: greedy completions vs the reference, speed (gates/serving/serve.py)."""

    if tolerance.entry is None:  # its thresholds are calibrated: nothing of it can judge without them
        return Judged(serve_uncalibrated(tolerance.problem))
    t0 = time.monotonic()
    inputs.on_event("serve: booting the engine's server in the sandbox")
    result: CheckResult = serve_check(manifest=inputs.manifest, image=pins.image_id, docker=inputs.docker,
                                      ref=reference.tensors, entry=tolerance.entry, baseline=inputs.baseline,
                                      model_dir=boot.model_dir, perf=inputs.serve_perf, on_event=inputs.on_event)
    inputs.clock.time("serve_s", t0)
    return Judged(result)


# ---------------------------------------------------------------- the registry and its driver


@dataclass(frozen=True)
class GateCheck:
    """One check of the registry.

    `name` is the CheckResult it records ('' for the tolerance lookup, which records none); `run` takes the
    GateInputs and then, in `needs`' order, the outcomes of earlier checks it needs (by type), and returns its own
    outcome; `enabled_by` is the gate.checks entry it needs (None: it always runs; a check whose entry is not in the
    SKU's gate.checks is recorded as skipped and not run). tests/unit/test_gate_model.py holds `needs` to `run`'s
    parameters and to what earlier checks return.
    """

    name: str
    run: Callable[..., Outcome]
    needs: tuple[type[Any], ...] = ()
    enabled_by: str | None = None

    @property
    def label(self) -> str:
        """The name its internal error is recorded under: its own, or its function's."""
        return self.name or self.run.__name__.strip("_")

    def __call__(self, inputs: GateInputs, results: Results) -> Outcome:
        return self.run(inputs, *(results.need(kind) for kind in self.needs))


# Cheapest first; the first that neither passed nor was skipped ends the run (`_run_checks`).
CHECKS: tuple[GateCheck, ...] = (
    GateCheck("reference", _check_reference),
    GateCheck("", _find_tolerance, needs=(ReferenceResult,)),
    GateCheck("pins", _check_pins),
    GateCheck("binaries", _check_binaries, needs=(PinsResult,)),
    GateCheck("smoke", _check_smoke, needs=(PinsResult,)),
    GateCheck("boot", _check_boot, needs=(PinsResult,)),
    GateCheck("kernels", _check_kernels, needs=(ReferenceResult, ToleranceResult, BootResult), enabled_by="kernels"),
    GateCheck("ops", _check_ops, needs=(ToleranceResult, BootResult), enabled_by="model"),
    GateCheck("model", _check_model, needs=(ReferenceResult, ToleranceResult, BootResult), enabled_by="model"),
    GateCheck("float32", _check_float32, needs=(PinsResult, ToleranceResult, BootResult), enabled_by="model"),
    GateCheck("serve", _check_serve, needs=(ReferenceResult, ToleranceResult, PinsResult, BootResult),
              enabled_by="serve"),
)
CHECK_NAMES = tuple(check.name for check in CHECKS if check.name)
# `skupin gate --pre-gate` (a build runner, before an image goes to staging) runs every check before this one: those
# that need no accelerator. Its verdict is never a pass (publish refuses it): the stop is recorded as boot's error.
PRE_GATE_STOP = "boot"
PRE_GATE_REASON = ("pre-gate only: the checks that need no accelerator ran; boot and the numeric checks need the "
                   "SKU's accelerator (run the full gate on such a host)")


def pre_gate_passed(verdict: GateVerdict) -> bool:
    """Whether a `--pre-gate` run's checks all passed (or were skipped) up to its stop before boot."""
    stop = next((c for c in verdict.checks if c.name == PRE_GATE_STOP), None)
    before = [c for c in verdict.checks if c.name in CHECK_NAMES[:CHECK_NAMES.index(PRE_GATE_STOP)]]
    return (stop is not None and stop.details.get("pre_gate") is True and bool(before)
            and all(c.status in ("pass", "skipped") for c in before))


def _run_checks(inputs: GateInputs) -> Results:
    """Run the checks in order, recording each result; the first that neither passed nor was skipped ends the run
    (`uncalibrated` goes on: with no calibrated entry every check still runs its calibration-free part)."""
    results = Results()
    for check in CHECKS:
        if inputs.pre_gate and check.name == PRE_GATE_STOP:
            inputs.on_event(f"pre-gate: stopping before {PRE_GATE_STOP}")
            return results.then(Judged(CheckResult(name=PRE_GATE_STOP, status="error", reason=PRE_GATE_REASON,
                                                   details={"pre_gate": True})))
        if check.enabled_by is not None and not inputs.wanted(check.enabled_by):
            outcome: Outcome = Judged(CheckResult(name=check.name, status="skipped",
                                                  reason=f"{check.enabled_by} is not in the SKU's gate.checks"))
        else:
            outcome = _guarded(check, inputs, results)
        results = results.then(outcome)
        result = outcome.check
        if result is None:
            continue
        inputs.on_event(f"{result.name}: {result.status}: {result.reason}")
        if result.status not in ("pass", "skipped", "uncalibrated"):
            break
    return results


def _guarded(check: GateCheck, inputs: GateInputs, results: Results) -> Outcome:
    """The check's outcome; an exception it did not expect is an error result of that check (the run still ends
    in a verdict). KeyboardInterrupt and SystemExit pass."""
    try:
        return check(inputs, results)
    except Exception as exc:  # a crafted image must never turn a gate run into a traceback
        return Judged(_internal_error(check.label, exc))


def _internal_error(label: str, exc: Exception) -> CheckResult:
    return CheckResult(name=label, status="error",
                       reason=f"internal error in the {label} check: {type(exc).__name__}: {printable(str(exc), 800)}")


def _skip_rest(checks: tuple[CheckResult, ...], names: tuple[str, ...], why: str) -> tuple[CheckResult, ...]:
    done = {c.name for c in checks}
    return (*checks, *(CheckResult(name=n, status="skipped", reason=why) for n in names if n not in done))


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
               display: str | None = None, pre_gate: bool = False) -> GateVerdict:
    """Gate any local image `image` for the SKU of `stack` and write verdict.json, report.md and plot.png to `out`.

    `gate` is the stage for an image built here; this is the same gate for one that was not (`skupin
    gate --image`, a third-party image, the tests' tampered images). Checks run in
    order and the first one that does not pass stops the rest. `baseline` (an image) adds the serve
    check's interleaved A/B; `serve_perf` overrides its load. `display` is the name reports give `image`
    (verdict.json's `image`; its `image_id` is always the id that ran). `pre_gate`: stop before boot (PRE_GATE_STOP).
    """
    started = time.monotonic()
    created = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reap_leftovers(docker=docker, on_event=on_event)
    with tempfile.TemporaryDirectory(prefix="skupin-fixture-") as scratch:
        inputs = GateInputs(stack=stack, image=image, docker=docker, out=out, on_event=on_event,
                            tolerances_path=tolerances_path or catalog_tolerances(), reference=reference,
                            baseline=baseline, serve_perf=serve_perf, scratch=Path(scratch),
                            wheelhouse=wheelhouse if wheelhouse is not None else default_wheelhouse(),
                            display=display or "", accelerator=host_accelerator(stack.manifest.base.family),
                            pre_gate=pre_gate)
        results = _run_checks(inputs)
    return _finish(inputs, results, started=started, created=created)


def _finish(inputs: GateInputs, results: Results, *, started: float, created: str) -> GateVerdict:
    """The one place the verdict is assembled from the checks' outcomes: skip what did not run, decide, and write
    verdict.json, report.md and plot.png."""

    checks = _skip_rest(results.checks, CHECK_NAMES, "not evaluated: an earlier check did not pass")
    decision, reason = decide(checks)
    timings = {**inputs.clock.spans, "total_s": round(time.monotonic() - started, 3)}
    pins, reference = results.get(PinsResult), results.get(ReferenceResult)
    tolerance, boot, model = results.get(ToleranceResult), results.get(BootResult), results.get(ModelResult)
    lock = inputs.lock
    verdict = GateVerdict(
        sku=inputs.manifest.name, hardware_class=inputs.manifest.accelerator.hardware_class, image=inputs.shown,
        image_id=(pins.image_id if pins else "") or None, lock_hash=lock.content_hash() if lock else None,
        image_lock_label=pins.lock_label if pins else None, reference=reference.info if reference else None,
        tolerance=tolerance.info if tolerance else None, checks=checks,
        model_decision=model.decisions if model else (), prompts=model.prompts if model else (), decision=decision,
        reason=reason,
        calibration_free={c.name: str(c.details.get("calibration_free", "")) for c in checks
                          if c.status == "uncalibrated"},
        timings=timings, probe=boot.summary if boot else {}, tool_version=__version__, created=created)
    t0 = time.monotonic()
    write_report(verdict=verdict, out=inputs.out)
    inputs.on_event(f"verdict: {decision}: {reason} (report {inputs.out / 'report.md'}; {time.monotonic() - t0:.1f} s)")
    return verdict
