"""`skupin calibrate` refuses poison (issue 30): an image whose files are not its lock, a SKU gated on quantized weights,
honest runs that break a hard bound, an image that fails the float32 pass. Each refusal is one line with the gate's
exit code, and the tolerance file is left exactly as it was (no Docker: the probe and the layer reader are stand-ins).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import skupin.builder.check as check
import skupin.calibration.calibrate as calibrate
import skupin.dockerd as dockerd
from skupin.builder.catalog.lockfile import read_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.cli.gate import cmd_calibrate
from skupin.common.errors import GateCouldNotRun, GateFailed, ManifestError
from skupin.gates.gate import ProbeRun
from skupin.gates.integrity.static import Finding, IntegrityReport
from skupin.gates.judge.tolerance import (
    HardBounds,
    ToleranceKey,
    Tolerances,
    calibration_for,
    load_tolerances,
    merge_entry,
    write_tolerances,
)
from skupin.gates.refdata.tensorio import read_safetensors
from tests.paths import REPO, SKUS
from tests.unit.test_tolerance import _entry

BUNDLE = REPO / "gates/references/tiny-llama/h200-float32"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    tensors, _ = read_safetensors(BUNDLE / "tensors.safetensors")
    return tensors


def _stack(sku: str, **gate) -> ResolvedStack:
    manifest = load_manifest(SKUS / f"{sku}.yaml")
    if gate:
        manifest = manifest.model_copy(update={"gate": manifest.gate.model_copy(update=gate)})
    return ResolvedStack(manifest=manifest, manifest_path=SKUS / f"{sku}.yaml", lock=read_lock(SKUS / f"{sku}.lock.json"),
                         lock_state="ok")


class World:
    """Stand-ins for what calibration touches outside Python: the engine, the layer reader, the probe containers."""

    def __init__(self, monkeypatch, reference, *, report: IntegrityReport | None = None, honest=None, float32=None):
        self.runs: list[str] = []
        self.float32_runs = 0
        self.pins_checked = 0
        honest = honest if honest is not None else dict(reference)
        monkeypatch.setattr(calibrate, "reap_leftovers", lambda **_: None)
        monkeypatch.setattr(calibrate, "resolve_image", lambda **_: SimpleNamespace(id="sha256:" + "1" * 64))
        monkeypatch.setattr(calibrate, "load_reference", lambda *, manifest, folder=None: ({}, reference, "a" * 64))
        monkeypatch.setattr(calibrate, "model_folder", lambda **_: Path("/nonexistent-fixture"))
        monkeypatch.setattr(calibrate, "host_driver", lambda: {"version": "580.95.05"})

        def inspect(**_):
            self.pins_checked += 1
            return report if report is not None else IntegrityReport()

        def honest_run(*, label, manifest, **_):
            self.runs.append(label)
            engine = manifest.stack.engine  # what the probe reports it ran (checks.model), as a real run does
            return {"status": "ok", "env": {"python": "3.11"}, "checks": {"model": {
                "engine": engine.name, "engine_version": engine.version}}}, honest

        def probe(*, manifest, **_):
            assert manifest.gate.dtype == "float32" and "kernels" not in manifest.gate.checks
            self.float32_runs += 1
            return ProbeRun(report={"status": "ok", "checks": {"model": {"status": "ok"}}},
                            tensors=float32 if float32 is not None else dict(reference))

        monkeypatch.setattr(calibrate, "inspect_image_files", inspect)
        monkeypatch.setattr(calibrate, "_honest_run", honest_run)
        monkeypatch.setattr(calibrate, "probe_in_container", probe)


def _calibrate(stack, tmp_path, **kwargs):
    (tmp_path / "out").mkdir(exist_ok=True)
    return calibrate.calibrate_image(stack=stack, image="img", docker=None, out=tmp_path / "out", boots=1,
                                     variations=((8, 1), (1, 1)), **kwargs)


def _cli(monkeypatch, tmp_path, stack, *, float32=False) -> tuple[Path, bytes, argparse.Namespace]:
    """`skupin calibrate` on `stack` with a tolerance file that already holds an entry: (its path, its bytes before, the
    command line)."""
    monkeypatch.setattr(check, "resolve", lambda _path: stack)
    monkeypatch.setattr(dockerd, "connect", lambda: None)
    (tmp_path / "out").mkdir(exist_ok=True)
    path = tmp_path / "tolerances.yaml"
    write_tolerances(merge_entry(Tolerances(), _entry()), path)
    before = path.read_bytes()
    args = argparse.Namespace(sku=stack.manifest.name, image="img", boots=1, margin=4.0, out=str(tmp_path / "out"),
                              tolerances=str(path), allow_looser=False, dry_run=False, float32=float32)
    monkeypatch.setattr(calibrate, "DEFAULT_VARIATIONS", ((8, 1), (1, 1)))
    return path, before, args


def test_an_honest_image_is_calibrated_after_pins_passes(monkeypatch, tmp_path, reference):
    world = World(monkeypatch, reference)
    entry = _calibrate(_stack("cpu-x86_64"), tmp_path)
    assert world.pins_checked == 1 and len(world.runs) == 2
    assert entry.key.label() == "cpu-x86_64/float32/tiny-llama" and entry.provenance.runs == 2
    assert entry.provenance.engines == {"transformers": "5.24.0"}  # issue 31: what the probe reported it ran


def test_an_image_that_fails_pins_is_refused_before_any_run_and_nothing_is_written(monkeypatch, tmp_path, reference):
    """The poisoned image (an unowned .pth in the venv) never runs, and the class's thresholds stay as they were."""
    hook = Finding(kind="hook", path="opt/skupin/venv/lib/python3.11/site-packages/zz.pth", detail="a start-up hook")
    world = World(monkeypatch, reference, report=IntegrityReport(findings=(hook,)))
    path, before, args = _cli(monkeypatch, tmp_path, _stack("cpu-x86_64"))
    with pytest.raises(GateFailed, match=r"^calibration refused: pins failed: the image is not its lock: "
                                         r"/opt/skupin/venv/lib/python3.11/site-packages/zz.pth") as err:
        cmd_calibrate(args)
    assert err.value.exit_code == 10 and "\n" not in str(err.value)
    assert world.runs == [] and path.read_bytes() == before


def test_an_image_pins_cannot_check_is_refused_as_could_not_run(monkeypatch, tmp_path, reference):
    world = World(monkeypatch, reference, report=IntegrityReport(unverifiable=("no record of the base",)))
    with pytest.raises(GateCouldNotRun, match="calibration refused: pins could not check the image: no record"):
        _calibrate(_stack("cpu-x86_64"), tmp_path)
    assert world.runs == []


def test_a_stack_without_a_current_lock_is_refused(monkeypatch, tmp_path, reference):
    World(monkeypatch, reference)
    stale = _stack("cpu-x86_64").model_copy(update={"lock_state": "stale"})
    with pytest.raises(GateCouldNotRun, match="no current lock"):
        _calibrate(stale, tmp_path)


def test_the_float32_calibration_checks_the_skus_own_lock(monkeypatch, tmp_path, reference):
    """`--float32` calibrates the SKU's float32 copy; `pins` still checks the image against the SKU's own lock."""
    hook = Finding(kind="hook", path="opt/x.pth", detail="a start-up hook")
    World(monkeypatch, reference, report=IntegrityReport(findings=(hook,)))
    path, before, args = _cli(monkeypatch, tmp_path, _stack("nvidia-h200-vllm"), float32=True)
    seen = []
    real = calibrate.refuse_unpinned
    monkeypatch.setattr(calibrate, "refuse_unpinned", lambda *, stack, **kw: (seen.append(stack), real(stack=stack, **kw)))
    with pytest.raises(GateFailed, match="pins failed"):
        cmd_calibrate(args)
    assert seen[0].manifest.gate.dtype == "bfloat16" and path.read_bytes() == before


def test_a_sku_gated_on_quantized_weights_is_refused_before_anything_runs(monkeypatch, tmp_path, reference):
    world = World(monkeypatch, reference)
    stack = _stack("cpu-x86_64-llamacpp", weights="q8_0")
    path, before, args = _cli(monkeypatch, tmp_path, stack)
    with pytest.raises(ManifestError, match="gate.weights is q8_0: calibration comes only from full-precision weights"):
        cmd_calibrate(args)
    with pytest.raises(ManifestError, match="full-precision"):
        _calibrate(stack, tmp_path)
    assert world.pins_checked == 0 and world.runs == [] and path.read_bytes() == before


def test_honest_runs_that_break_a_hard_bound_are_refused_and_nothing_is_written(monkeypatch, tmp_path, reference):
    bad = dict(reference)
    bad["model.topk_ids"] = np.roll(reference["model.topk_ids"], 1, axis=-1)  # every top-1 token wrong
    bad["model.logprobs_full"] = reference["model.logprobs_full"][..., ::-1].copy()
    world = World(monkeypatch, reference, honest=bad)
    path, before, args = _cli(monkeypatch, tmp_path, _stack("cpu-x86_64"))
    with pytest.raises(GateFailed, match=r"^calibration refused: honest run boot 1, batch 8, threads 1 breaks a hard "
                                         r"bound: ") as err:
        cmd_calibrate(args)
    assert err.value.exit_code == 10 and len(world.runs) == 2 and path.read_bytes() == before


def test_a_kernel_hard_bound_is_refused_too(monkeypatch, tmp_path, reference):
    bad = dict(reference)
    bad["kernels.silu.float32"] = reference["kernels.silu.float32"] * np.float32(1 + 2**-7)  # one part in 128
    World(monkeypatch, reference, honest=bad)
    with pytest.raises(GateFailed, match="silu.float32: max error .* > hard bound"):
        _calibrate(_stack("cpu-x86_64"), tmp_path)


def test_a_float32_calibration_holds_float32s_own_hard_bound(monkeypatch, tmp_path, reference):
    """A kernel 1% off passes every bf16 threshold; at float32 its mean logprob L2 breaks the calibration-free bound."""
    off = dict(reference)
    off["model.target_logprob"] = reference["model.target_logprob"] - np.float32(2e-4)  # ~ an attention scale 1% off
    World(monkeypatch, reference, honest=off)
    with pytest.raises(GateFailed, match="float32 mean logprob L2 .* > hard bound"):
        _calibrate(_stack("cpu-x86_64"), tmp_path)


def test_an_image_that_fails_the_float32_pass_is_refused(monkeypatch, tmp_path, reference):
    """A bf16 SKU with a float32 pass: the honest bf16 runs look fine, the float32 pass shows the fault."""
    off = dict(reference)
    off["model.target_logprob"] = reference["model.target_logprob"] - np.float32(2e-4)  # ~ an attention scale 1% off
    world = World(monkeypatch, reference, float32=off)
    path, before, args = _cli(monkeypatch, tmp_path, _stack("nvidia-h200-vllm"))
    with pytest.raises(GateFailed, match=r"^calibration refused: the float32 pass failed: ") as err:
        cmd_calibrate(args)
    assert err.value.exit_code == 10 and world.float32_runs == 1 and path.read_bytes() == before
    assert load_tolerances(path) == merge_entry(Tolerances(), _entry())


def test_a_bf16_sku_whose_float32_pass_passes_is_calibrated(monkeypatch, tmp_path, reference):
    world = World(monkeypatch, reference)
    entry = _calibrate(_stack("nvidia-h200-vllm"), tmp_path)
    assert world.float32_runs == 1 and entry.key.label() == "nvidia-hopper/bfloat16/tiny-llama/vllm"
    # issue 31: the entry records the engine and exact version its honest runs used, and it holds for the SKU
    assert entry.provenance.engines == {"vllm": "0.32.0"}
    found = calibration_for(_stack("nvidia-h200-vllm").manifest, merge_entry(Tolerances(), entry),
                            reference_sha256="a" * 64)
    assert found.entry == entry and found.why == ""


def test_an_accelerated_calibration_whose_runs_do_not_report_the_keys_engine_is_refused(monkeypatch, tmp_path,
                                                                                          reference):
    """The entry of an accelerated key holds for its engine's release alone, so calibration refuses (nothing written)
    honest runs that do not say which engine and version computed them."""
    world = World(monkeypatch, reference)
    monkeypatch.setattr(calibrate, "_engine_used", lambda report: ("", ""))
    with pytest.raises(GateCouldNotRun, match=r"holds for vllm alone, and not every honest run reported it with its version"):
        _calibrate(_stack("nvidia-h200-vllm"), tmp_path)
    assert len(world.runs) == 2


def test_deriving_an_entry_with_hard_bounds_refuses_runs_that_break_one(reference):
    bad = dict(reference)
    bad["model.topk_ids"] = np.roll(reference["model.topk_ids"], 1, axis=-1)
    bad["model.logprobs_full"] = reference["model.logprobs_full"][..., ::-1].copy()
    runs = [calibrate.HonestRun(label=f"run {i}", tensors=t, env={}) for i, t in enumerate((dict(reference), bad))]
    key = ToleranceKey(hardware_class="cpu-x86_64", dtype="float32", model="tiny-llama")
    with pytest.raises(GateFailed, match="calibration refused: honest run run 1 breaks a hard bound"):
        calibrate.derive_entry(key=key, reference=reference, reference_sha256="a" * 64, runs=runs, margin=4, image="x",
                               hard=HardBounds())
