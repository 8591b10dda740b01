"""A SKU whose tolerance key has no calibrated entry: every calibration-free check runs, the decision is
`uncalibrated` (exit 14), never pass and never "could not run"; a hard bound still fails (exit 10); publish refuses
it; `skupin check` warns (issue 18)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import skupin.gates.gate as gate
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.common.errors import GateCouldNotRun, GateFailed, GateUncalibrated, PublishError
from skupin.gates.gate import BootResult, GateCheck, GateInputs, PinsResult, ProbeRun, ReferenceResult, ToleranceResult
from skupin.gates.judge.compare import KernelResult
from skupin.gates.judge.tolerance import (
    DEFAULT_PATH,
    HardBounds,
    ToleranceKey,
    Tolerances,
    calibration_for,
    calibration_warning,
    float32_pass_warning,
    load_tolerances,
    write_tolerances,
)
from skupin.gates.judge.verdict import (
    CALIBRATION_FREE,
    CheckResult,
    decide,
    kernels_uncalibrated,
    raise_for_verdict,
    serve_uncalibrated,
)
from skupin.gates.refdata.tensorio import read_safetensors
from skupin.publishing.publish import refusals, verdict_facts
from tests.paths import REPO, SKUS

BUNDLE = REPO / "gates/references/tiny-llama/h200-float32"


def ref(manifest):
    return REPO / manifest.gate.reference


def _warn(warning, manifest, tolerances):
    return warning(manifest=manifest, tolerances=tolerances, reference=ref(manifest))
CPU = SKUS / "cpu-x86_64.yaml"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    tensors, _ = read_safetensors(BUNDLE / "tensors.safetensors")
    return tensors


def bundle_sha() -> str:
    return hashlib.sha256((BUNDLE / "SHA256SUMS").read_bytes()).hexdigest()


@dataclass
class Run:
    """A gate run whose reference, pins and boot passed (no Docker): its inputs, the reference and the probe."""

    inputs: GateInputs
    ref: dict
    reference_info: gate.ReferenceInfo
    probe: ProbeRun


def gate_run(tmp_path: Path, reference: dict, candidate: dict, *, tolerances: Tolerances, sha: str | None = None) -> Run:
    """A gate run of the CPU SKU whose reference, pins and boot passed (no Docker), with `candidate` as the probe's
    outputs and `tolerances` as the tolerance file; the real tolerance lookup, kernels, model and serve checks run."""
    path = tmp_path / "tolerances.yaml"
    write_tolerances(tolerances, path)
    manifest = load_manifest(CPU)
    inputs = GateInputs(stack=ResolvedStack(manifest=manifest, manifest_path=CPU), image="img", docker=None,  # type: ignore[arg-type]
                        out=tmp_path / "out", on_event=lambda _: None, tolerances_path=path, reference=None,
                        baseline=None, serve_perf=None, scratch=tmp_path)
    return Run(inputs=inputs, ref=reference,
               reference_info=gate.ReferenceInfo(path=str(BUNDLE), sha256=sha or bundle_sha(), dtype="float32"),
               probe=ProbeRun(report={"checks": {"kernels": {"status": "ok"}, "model": {"status": "ok"}}},
                              tensors=candidate))


def run_gate(monkeypatch, run: Run):
    """The gate's own driver and _finish over the real checks after reference, pins and boot (which need Docker)."""

    def passed(name: str) -> CheckResult:
        return CheckResult(name=name, status="pass", reason=f"{name} ok (test)")

    reference = ReferenceResult(passed("reference"), info=run.reference_info, tensors=run.ref)
    pins, boot = PinsResult(passed("pins")), BootResult(passed("boot"), probe=run.probe)
    checks = {check.name or check.run.__name__: check for check in gate.CHECKS}
    monkeypatch.setattr(gate, "CHECKS", (
        GateCheck("reference", lambda _inputs: reference), checks["_find_tolerance"],
        GateCheck("pins", lambda _inputs: pins), GateCheck("boot", lambda _inputs: boot),
        checks["kernels"], checks["model"], checks["serve"]))
    results = gate._run_checks(run.inputs)
    return gate._finish(run.inputs, results, started=0.0, created="2026-12-01T00:00:00+00:00")


def test_no_entry_runs_every_calibration_free_check_and_ends_uncalibrated_never_pass(monkeypatch, tmp_path, reference):
    verdict = run_gate(monkeypatch, gate_run(tmp_path, reference, dict(reference), tolerances=Tolerances()))
    statuses = {c.name: c.status for c in verdict.checks}
    assert statuses == {"reference": "pass", "pins": "pass", "boot": "pass", "kernels": "uncalibrated",
                        "ops": "skipped", "model": "uncalibrated", "float32": "skipped", "serve": "uncalibrated",
                        "binaries": "skipped", "smoke": "skipped"}  # not in run_gate's checks: not evaluated
    assert verdict.decision == "uncalibrated" and verdict.exit_code == 14 == GateUncalibrated.exit_code
    assert "no calibrated tolerance for cpu-x86_64/float32/tiny-llama" in verdict.reason
    assert "fix: skupin calibrate cpu-x86_64 --image img on that hardware" in verdict.reason  # the image it gated
    assert "calibration-free checks passed: reference, pins, boot, kernels (hard bounds only), model (hard bounds only)" \
        in verdict.reason and "not run without calibration: serve" in verdict.reason
    assert verdict.calibration_free == {name: CALIBRATION_FREE[name] for name in ("kernels", "model", "serve")}
    assert verdict.check("model").details["prompts"] == 64  # the model's statistics were computed
    with pytest.raises(GateUncalibrated, match="never a pass"):
        raise_for_verdict(verdict)
    report = (tmp_path / "out/report.md").read_text()
    assert "**Decision: UNCALIBRATED**" in report and "## Without calibration" in report
    assert "| serve | UNCALIBRATED | not run: " in report and CALIBRATION_FREE["serve"] in report
    assert "## Serve check" not in report
    assert (tmp_path / "out/verdict.json").is_file() and (tmp_path / "out/plot.png").is_file()


def test_an_entry_of_another_bundle_is_uncalibrated_too(monkeypatch, tmp_path, reference):
    tolerances = load_tolerances(DEFAULT_PATH)  # holds cpu-x86_64/float32/tiny-llama, for the committed bundle
    verdict = run_gate(monkeypatch, gate_run(tmp_path, reference, dict(reference), tolerances=tolerances, sha="c" * 64))
    assert verdict.decision == "uncalibrated" and "was calibrated against bundle" in verdict.reason


def test_with_its_entry_the_same_candidate_passes_kernels_and_model(monkeypatch, tmp_path, reference):
    run = gate_run(tmp_path, reference, dict(reference), tolerances=load_tolerances(DEFAULT_PATH))
    monkeypatch.setattr(gate, "serve_check", lambda **_: CheckResult(name="serve", status="pass", reason="ok (test)"))
    verdict = run_gate(monkeypatch, run)
    assert verdict.decision == "pass" and verdict.calibration_free == {}


def test_a_kernel_hard_bound_still_fails_without_calibration(monkeypatch, tmp_path, reference):
    cand = dict(reference)
    cand["kernels.silu.float32"] = reference["kernels.silu.float32"] * np.float32(1 + 2**-7)
    verdict = run_gate(monkeypatch, gate_run(tmp_path, reference, cand, tolerances=Tolerances()))
    assert verdict.decision == "fail" and verdict.exit_code == GateFailed.exit_code == 10
    assert verdict.check("kernels").status == "fail" and "silu.float32" in verdict.reason
    assert verdict.check("model").status == "skipped"  # the first failure stops the rest, as always


def test_a_model_hard_bound_still_fails_without_calibration(monkeypatch, tmp_path, reference):
    cand = dict(reference)
    cand["model.topk_ids"] = np.roll(reference["model.topk_ids"], 1, axis=-1)  # every top-1 token wrong
    cand["model.logprobs_full"] = reference["model.logprobs_full"][..., ::-1].copy()
    verdict = run_gate(monkeypatch, gate_run(tmp_path, reference, cand, tolerances=Tolerances()))
    assert verdict.decision == "fail" and verdict.check("model").status == "fail"
    assert verdict.check("model").reason.startswith("hard bound:")
    assert verdict.check("kernels").status == "uncalibrated"


def test_the_probe_failing_its_kernel_battery_is_still_could_not_run(monkeypatch, tmp_path, reference):
    run = gate_run(tmp_path, reference, dict(reference), tolerances=Tolerances())
    run.probe = ProbeRun(report={"checks": {"kernels": {"status": "error", "error": "boom"}}}, tensors=dict(reference))
    verdict = run_gate(monkeypatch, run)
    assert verdict.decision == "could_not_run" and "boom" in verdict.reason


def test_decide_orders_fail_and_error_before_uncalibrated():
    ok = CheckResult(name="boot", status="pass", reason="")
    partial = kernels_uncalibrated(results=(KernelResult("silu.float32", 1e-8, True),), why="no entry for k")
    assert decide((ok, partial))[0] == "uncalibrated"
    assert decide((ok, partial, CheckResult(name="model", status="fail", reason="x")))[0] == "fail"
    assert decide((ok, partial, CheckResult(name="serve", status="error", reason="x")))[0] == "could_not_run"
    assert decide((ok, serve_uncalibrated("no entry for k")))[0] == "uncalibrated"  # serve alone never lets it pass
    assert partial.details["ops"]["silu.float32"]["tolerance"] is None


def test_an_uncalibrated_verdict_exits_14_and_publish_refuses_it(monkeypatch, tmp_path, reference):
    verdict = run_gate(monkeypatch, gate_run(tmp_path, reference, dict(reference), tolerances=Tolerances()))
    facts = verdict_facts(verdict.model_dump(mode="json"))
    why = refusals(sku="cpu-x86_64", image_id=str(verdict.image_id), lock_sha256=str(verdict.lock_hash), verdict=facts)
    assert why and why[0].startswith("the gate ran uncalibrated") and "never published" in why[0]
    assert "skupin calibrate cpu-x86_64 on that hardware" in why[0]
    forged = verdict_facts({**verdict.model_dump(mode="json"), "decision": "pass"})  # an edited decision is not enough
    assert any(w.startswith("the gate ran uncalibrated") for w in refusals(
        sku="cpu-x86_64", image_id=str(verdict.image_id), lock_sha256=str(verdict.lock_hash), verdict=forged))
    assert {GateFailed.exit_code, GateCouldNotRun.exit_code, GateUncalibrated.exit_code, PublishError.exit_code} \
        == {10, 11, 14, 8}


def test_hard_bounds_are_the_gates_defaults():
    assert HardBounds().max_mean_kl == 0.5 and HardBounds().min_top1_agree == 0.8


def test_check_warns_naming_the_key_and_the_fix():
    manifest = load_manifest(CPU)
    tolerances = load_tolerances(DEFAULT_PATH)
    assert calibration_warning(manifest=manifest, tolerances=tolerances, reference=ref(manifest)) is None
    missing = calibration_warning(manifest=manifest, tolerances=Tolerances(), reference=ref(manifest))
    assert missing is not None and "no calibrated tolerance for cpu-x86_64/float32/tiny-llama" in missing
    assert "'uncalibrated' (exit 14)" in missing and "fix: skupin calibrate cpu-x86_64 on that hardware" in missing
    stale = tolerances.model_copy(update={"entries": tuple(
        e.model_copy(update={"provenance": e.provenance.model_copy(update={"reference_sha256": "d" * 64})})
        for e in tolerances.entries)})
    warning = calibration_warning(manifest=manifest, tolerances=stale, reference=ref(manifest))
    assert "calibrated against bundle dddddddddddd" in str(warning)


def test_skupin_check_warns_on_stderr_and_still_exits_0(monkeypatch, capsys, tmp_path):
    import skupin.gates.judge.tolerance as tolerance
    from skupin.cli import main

    empty = tmp_path / "tolerances.yaml"
    write_tolerances(Tolerances(), empty)
    monkeypatch.setattr(tolerance, "catalog_tolerances", lambda: empty)
    assert main(["check", str(CPU)]) == 0
    captured = capsys.readouterr()
    assert "ok  cpu-x86_64" in captured.out
    assert "warning: cpu-x86_64: no calibrated tolerance for cpu-x86_64/float32/tiny-llama" in captured.err


def test_an_accelerated_classs_entry_holds_for_the_engine_it_was_calibrated_with_alone():
    """Issue 31: on accelerator hardware every engine brings its own kernels and its own honest noise. The committed
    nvidia-hopper entries were calibrated with transformers, so a vLLM or SGLang SKU's gate ends 'uncalibrated' (the
    warning names the entries' engine and the command), and the same SKU on transformers finds its entry; the CPU
    class's entry holds for every engine its SKUs do not key per engine (its committed cross-engine evidence)."""
    from skupin.engines import engine_float32

    tolerances = load_tolerances(DEFAULT_PATH)
    for path in sorted(SKUS.glob("nvidia-*.yaml")):
        manifest = load_manifest(path)
        engine = manifest.stack.engine.name
        assert ToleranceKey.of(manifest).engine == engine != "transformers"
        for warn, flag in ((calibration_warning, ""), (float32_pass_warning, " --float32")):
            if flag and not engine_float32(engine):
                continue  # SGLang has no float32 pass
            warning = _warn(warn, manifest, tolerances)
            assert warning is not None and f"/tiny-llama/{engine} " in warning, path.name
            assert "calibrated with transformers 5.17.0 only" in warning and "'uncalibrated' (exit 14)" in warning
            assert f"fix: skupin calibrate {manifest.name}{flag} on that hardware" in warning
        on_transformers = manifest.model_copy(update={"stack": manifest.stack.model_copy(update={
            "engine": manifest.stack.engine.model_copy(update={"name": "transformers", "version": "5.17.2"})})})
        assert _warn(calibration_warning, on_transformers, tolerances) is None, path.name
        assert _warn(float32_pass_warning, on_transformers, tolerances) is None, path.name
    for name in ("cpu-x86_64", "cpu-x86_64-vllm", "cpu-x86_64-llamacpp", "cpu-x86_64-bf16"):
        manifest = load_manifest(SKUS / f"{name}.yaml")
        assert ToleranceKey.of(manifest).engine == "" and _warn(calibration_warning, manifest, tolerances) is None


def test_a_cpu_sku_that_says_tolerance_per_engine_is_keyed_to_its_engine_and_never_takes_the_classs_entry():
    """The CPU class's engine-free entry holds for every engine whose honest noise it admits; a SKU whose engine's it
    does not (vLLM's CPU router at bfloat16) names its engine in its key, and with no entry of that key it is
    uncalibrated, naming the engine-free entry's key nowhere as its own."""
    tolerances = load_tolerances(DEFAULT_PATH)
    manifest = load_manifest(SKUS / "cpu-x86_64-bf16.yaml")
    assert ToleranceKey.of(manifest).label() == "cpu-x86_64/bfloat16/peaked-moe"
    keyed = manifest.model_copy(update={"gate": manifest.gate.model_copy(update={"tolerance_per_engine": True})})
    assert ToleranceKey.of(keyed).label() == "cpu-x86_64/bfloat16/peaked-moe/transformers"
    assert ToleranceKey.of(keyed, float32=True).label() == "cpu-x86_64/float32/peaked-moe/transformers"
    engine_free = tolerances.model_copy(update={"entries": tuple(e for e in tolerances.entries if not e.key.engine)})
    assert calibration_for(manifest, engine_free, reference_sha256=None).entry is not None
    found = calibration_for(keyed, engine_free, reference_sha256=None)
    assert found.entry is None and "no calibrated tolerance for cpu-x86_64/bfloat16/peaked-moe/transformers" \
        in found.problem


def test_the_float32_pass_of_every_shipped_bf16_sku_has_its_bundle_and_what_it_lacks_is_said():
    from skupin.gates.refdata.bundle import float32_manifest

    tolerances = load_tolerances(DEFAULT_PATH)
    h200 = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    assert float32_manifest(h200).gate.reference == "gates/references/tiny-llama/h200-float32"
    assert float32_manifest(h200).gate.dtype == "float32"
    assert _warn(float32_pass_warning, load_manifest(SKUS / "cpu-x86_64-bf16.yaml"), tolerances) is None
    amd = _warn(float32_pass_warning, load_manifest(SKUS / "amd-mi300x-vllm.yaml"), tolerances)
    assert amd is not None and "no calibrated tolerance for amd-cdna3/float32/tiny-llama/vllm" in amd
    assert "skupin calibrate amd-mi300x-vllm --float32" in amd
    assert _warn(float32_pass_warning, load_manifest(CPU), tolerances) is None  # serves fp32


def test_a_missing_float32_bundle_is_said_before_anything_is_built(tmp_path):
    import shutil

    manifest = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "gates/references/tiny-llama/h200-bfloat16", repo / "gates/references/tiny-llama/h200-bfloat16")
    warning = float32_pass_warning(manifest=manifest, tolerances=load_tolerances(DEFAULT_PATH),
                                   reference=repo / manifest.gate.reference)
    assert warning is not None and "needs the bundle {}".format(repo / "gates/references/tiny-llama/h200-float32") in warning
    assert "'could not run' (exit 11)" in warning


# ---------------------------------------------------------------- the float32 pass of a bf16 SKU, without Docker


def float32_run(tmp_path: Path, monkeypatch, candidate: dict, *, tolerances_path: Path = DEFAULT_PATH,
                reference: Path | None = None):
    """A gate run of nvidia-h200-vllm (serves bf16) served by transformers (the engine the committed nvidia-hopper
    entries were calibrated with) at its float32 check, the probe container replaced by one that answers
    `candidate`; returns (result, what the probe was asked to run)."""
    asked: dict = {}

    def fake_probe(*, manifest, image, docker, out, model_dir=None, **_):
        asked.update(dtype=manifest.gate.dtype, checks=manifest.gate.checks, reference=manifest.gate.reference,
                     out=out, image=image)
        return ProbeRun(report={"checks": {"model": {"status": "ok"}}}, tensors=candidate, seconds=1.0)

    monkeypatch.setattr(gate, "probe_in_container", fake_probe)
    manifest = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    manifest = manifest.model_copy(update={"stack": manifest.stack.model_copy(update={
        "engine": manifest.stack.engine.model_copy(update={"name": "transformers", "version": "5.17.0"})})})
    inputs = GateInputs(stack=ResolvedStack(manifest=manifest, manifest_path=SKUS / "nvidia-h200-vllm.yaml"),
                        image="img", docker=None, out=tmp_path / "out", on_event=lambda _: None,  # type: ignore[arg-type]
                        tolerances_path=tolerances_path, reference=reference, baseline=None, serve_perf=None,
                        scratch=tmp_path)
    ok = CheckResult(name="test", status="pass", reason="test")
    pins = PinsResult(ok, image_id="sha256:" + "1" * 64)
    tolerance = ToleranceResult(tolerances=load_tolerances(tolerances_path))
    return gate._check_float32(inputs, pins, tolerance, BootResult(ok)).check, asked


def test_the_float32_pass_probes_the_same_image_at_float32_against_the_float32_bundle(monkeypatch, tmp_path,
                                                                                      reference):
    result, asked = float32_run(tmp_path, monkeypatch, dict(reference))
    assert (result.name, result.status) == ("float32", "pass"), result.reason
    assert (asked["dtype"], asked["reference"]) == ("float32", "gates/references/tiny-llama/h200-float32")
    assert (asked["out"], asked["image"]) == (tmp_path / "out" / "probe-float32", "sha256:" + "1" * 64)
    assert "model" in asked["checks"] and "kernels" not in asked["checks"]  # the battery ran in the boot's probe
    assert result.details["tolerance_key"] == "nvidia-hopper/float32/tiny-llama/transformers"
    assert result.details["calibrated"]
    assert result.details["reference_sha256"] == bundle_sha()


def test_a_float32_pass_one_percent_off_fails_on_the_hard_bound_and_without_an_entry_is_uncalibrated(
        monkeypatch, tmp_path, reference):
    shifted = dict(reference)
    shifted["model.target_logprob"] = reference["model.target_logprob"] - 2e-4  # ~ an attention scale 1% off
    result, _ = float32_run(tmp_path, monkeypatch, shifted)
    assert result.status == "fail" and result.reason.startswith("hard bound: float32 mean logprob L2")
    empty = tmp_path / "empty.yaml"
    write_tolerances(Tolerances(), empty)
    honest, _ = float32_run(tmp_path, monkeypatch, dict(reference), tolerances_path=empty)
    assert honest.status == "uncalibrated" and "skupin calibrate nvidia-h200-vllm --float32" in honest.reason
    caught, _ = float32_run(tmp_path, monkeypatch, shifted, tolerances_path=empty)
    assert caught.status == "fail"  # the hard bound needs no calibration


def test_a_float32_pass_without_a_bundle_beside_the_reference_cannot_run(monkeypatch, tmp_path, reference):
    import shutil

    alone = tmp_path / "refs" / "h200-bfloat16"
    shutil.copytree(REPO / "gates/references/tiny-llama/h200-bfloat16", alone)
    result, asked = float32_run(tmp_path, monkeypatch, dict(reference), reference=alone)
    assert result.status == "error" and "no float32 bundle to compare with" in result.reason and not asked


def test_the_gate_of_a_hopper_sku_whose_engine_the_class_never_calibrated_finds_no_entry_and_says_why(tmp_path):
    """Issue 31: the gate's own tolerance step (the one every check reads) gives a vLLM Hopper SKU no entry, naming the
    engine its class was calibrated with and the command; every check then runs its calibration-free part and the run
    ends 'uncalibrated' (exit 14), never pass and never fail for want of an entry."""
    manifest = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    inputs = GateInputs(stack=ResolvedStack(manifest=manifest, manifest_path=SKUS / "nvidia-h200-vllm.yaml"),
                        image="img", docker=None, out=tmp_path, on_event=lambda _: None,  # type: ignore[arg-type]
                        tolerances_path=DEFAULT_PATH, reference=None, baseline=None, serve_perf=None, scratch=tmp_path)
    found = gate._find_tolerance(inputs, gate._check_reference(inputs))
    assert found.entry is None and found.info.key == "nvidia-hopper/bfloat16/tiny-llama/vllm"
    assert "calibrated with transformers 5.17.0 only" in found.problem
    assert "fix: skupin calibrate nvidia-h200-vllm --image img on that hardware" in found.problem


def test_an_engine_free_and_an_engine_keyed_entry_of_one_key_each_serve_only_their_own_skus():
    """cpu-x86_64/bfloat16/peaked-moe holds for every CPU SKU not keyed per engine (transformers'); its vLLM SKU says
    gate.tolerance_per_engine and takes the entry calibrated with vLLM, never the other."""
    tolerances = load_tolerances(DEFAULT_PATH)
    transformers = load_manifest(SKUS / "cpu-x86_64-bf16.yaml")
    vllm = load_manifest(SKUS / "cpu-x86_64-vllm-bf16.yaml")
    free = calibration_for(transformers, tolerances, reference_sha256=None).entry
    keyed = calibration_for(vllm, tolerances, reference_sha256=None).entry
    assert free is not None and keyed is not None and free != keyed
    assert (free.key.label(), keyed.key.label()) == ("cpu-x86_64/bfloat16/peaked-moe",
                                                     "cpu-x86_64/bfloat16/peaked-moe/vllm")
    assert keyed.provenance.engines == {"vllm": "0.32.0"}
    on_sglang = vllm.model_copy(update={"stack": vllm.stack.model_copy(update={
        "engine": vllm.stack.engine.model_copy(update={"name": "sglang"})})})
    found = calibration_for(on_sglang, tolerances, reference_sha256=None)
    assert found.entry is None and "cpu-x86_64/bfloat16/peaked-moe/sglang" in found.problem


def test_an_engines_own_entry_takes_the_class_ruler_wherever_its_honest_runs_fit_it():
    """AN-001 for gate.tolerance_per_engine: a first engine-keyed entry beside the class's engine-free one is bounded
    by it wherever the engine's own honest maxima fit (within_ruler), and what stays looser needs --allow-looser."""
    from skupin.common.errors import GateCouldNotRun as CouldNotRun
    from skupin.gates.judge.tolerance import class_ruler, looser, looser_ops, merge_entry

    tolerances = load_tolerances(DEFAULT_PATH)
    ruler = tolerances.find(ToleranceKey(hardware_class="cpu-x86_64", dtype="bfloat16", model="peaked-moe"))
    assert ruler is not None
    others = tolerances.model_copy(update={"entries": tuple(e for e in tolerances.entries if not e.key.engine)})
    key = ruler.key.model_copy(update={"engine": "vllm"})
    # an engine whose honest runs fit the ruler everywhere but calibrated 10x looser (few runs, a wide margin)
    wide = ruler.model_copy(update={
        "key": key, "provenance": ruler.provenance.model_copy(update={"engines": {"vllm": "0.32.0"}}),
        "model": ruler.model.model_copy(update={"per_prompt": {k: 10 * v for k, v in ruler.model.per_prompt.items()},
                                                "mean": {k: 10 * v for k, v in ruler.model.mean.items()}}),
        "ops": {op: {m: 1.05 * v for m, v in row.items()} for op, row in ruler.ops.items()}})  # under 1.1x: fits
    merged = merge_entry(others, wide).find(key)
    assert merged is not None and not looser(merged, ruler) and not looser_ops(merged, ruler)
    assert merged.model.mean == ruler.model.mean and merged.ops == ruler.ops
    # one statistic its honest runs really need looser: refused unless asked, and named
    needs = wide.model_copy(update={"provenance": wide.provenance.model_copy(update={"honest_max": {
        **wide.provenance.honest_max, "mean.kl": 5 * ruler.model.mean["kl"]}})})
    with pytest.raises(CouldNotRun, match=r"would loosen 1 thresholds of the class's engine-free entry "
                                          r"cpu-x86_64/bfloat16/peaked-moe \(mean\.kl\)"):
        merge_entry(others, needs)
    asked = merge_entry(others, needs, allow_looser=True).find(key)
    assert asked is not None and looser(asked, ruler) == ["mean.kl"]
    assert class_ruler(tolerances, ruler.key) is None  # an engine-free key has no ruler above it
    # a recalibration that adds op bounds the entry it replaces had none of (a first calibration of an engine's
    # captured module ops) is ruled on those by the class, not waved through for want of an old bound
    no_ops = wide.model_copy(update={"ops": {}})
    before = merge_entry(others, no_ops)
    with_ops = wide.model_copy(update={"ops": {"lm_head.bfloat16": {"max": 5 * ruler.ops["lm_head.bfloat16"]["max"]}},
                                       "provenance": wide.provenance.model_copy(update={"honest_max": {
                                           **wide.provenance.honest_max, "mean.kl": ruler.model.mean["kl"]}})})
    with pytest.raises(CouldNotRun, match=r"would loosen 1 thresholds of the entry it replaces \(and its class's "
                                          r"ruler, for op bounds it had none of\) \(ops\.lm_head\.bfloat16\.max\)"):
        merge_entry(before, with_ops)
    assert merge_entry(before, with_ops, allow_looser=True).find(key) is not None
    # the entry it replaces was calibrated on another battery spec: it rules none of the new op bounds, the ruler (on
    # the new spec) rules all of them
    old_spec = merge_entry(before, wide.model_copy(update={"ops": with_ops.ops, "ops_spec": "0" * 64}),
                           allow_looser=True)
    with pytest.raises(CouldNotRun, match=r"ops\.lm_head\.bfloat16\.max"):
        merge_entry(old_spec, with_ops)
    # a recalibration without op bounds (a SKU running no battery) keeps the entry's own, as it keeps its kernels;
    # one that brings some of them back keeps the rest as they were (the same battery spec: they still hold)
    some = {op: row for op, row in ruler.ops.items() if op.rpartition(".")[0] in ("matmul", "rmsnorm")}
    partial = merge_entry(merge_entry(others, wide), wide.model_copy(update={"ops": some})).find(key)
    assert partial is not None and partial.ops == ruler.ops


def test_an_engines_captured_module_bounds_are_its_own_forwards_not_ruled_by_the_seeded_class():
    """llama.cpp's module ops are captured from its own forward: within_ruler substitutes none of the class's seeded
    bounds into them, and a first calibration is not refused for being looser than seeded ones (its model thresholds
    still are ruled)."""
    from skupin.gates.judge.tolerance import captured_ops, merge_entry

    tolerances = load_tolerances(DEFAULT_PATH)
    ruler = tolerances.find(ToleranceKey(hardware_class="cpu-x86_64", dtype="bfloat16", model="peaked-moe"))
    assert ruler is not None
    others = tolerances.model_copy(update={"entries": tuple(e for e in tolerances.entries if not e.key.engine)})
    key = ruler.key.model_copy(update={"engine": "llamacpp"})
    assert captured_ops(key) and not captured_ops(ruler.key)
    own = {op: {m: 0.5 * v for m, v in row.items()} for op, row in ruler.ops.items()}
    own["lm_head.bfloat16"] = {m: 3 * v for m, v in ruler.ops["lm_head.bfloat16"].items()}  # looser than the class's
    entry = ruler.model_copy(update={"key": key, "ops": own,
                                     "provenance": ruler.provenance.model_copy(update={"engines": {"llamacpp": "0.3.36"}})})
    merged = merge_entry(others, entry).find(key)
    assert merged is not None and merged.ops == own  # kept as calibrated: nothing substituted, nothing refused


def test_the_committed_engine_keyed_cpu_entries_loosen_the_class_only_where_their_honest_runs_need_it():
    """vLLM: its router rounds top-k weights to bf16, its float32 GEMM, 4 runs not 8. llama.cpp: nothing (its op bounds
    are of modules captured from its own forward, compared with no seeded entry's: captured_ops)."""
    from skupin.gates.judge.tolerance import captured_ops, class_ruler, looser, looser_ops

    tolerances = load_tolerances(DEFAULT_PATH)
    needed = {"vllm": {f"ops.layer.{i}.router.bfloat16.bias" for i in range(4)} | {
        "ops.matmul.float32.rms", "ops.moe.route.float32.rms", "honest_rate"},
        "llamacpp": set()}
    keyed = [e for e in tolerances.entries if e.key.engine and class_ruler(tolerances, e.key) is not None]
    assert {e.key.label() for e in keyed} == {"cpu-x86_64/bfloat16/peaked-moe/vllm", "cpu-x86_64/float32/peaked-moe/vllm",
                                              "cpu-x86_64/bfloat16/peaked-moe/llamacpp"}
    for entry in keyed:
        ruler = class_ruler(tolerances, entry.key)
        assert ruler is not None
        ops = [] if captured_ops(entry.key) else looser_ops(entry, ruler)
        assert set(looser(entry, ruler) + ops) <= needed[entry.key.engine], entry.key.label()
        assert captured_ops(entry.key) == (entry.key.engine == "llamacpp")


def test_every_committed_op_table_is_of_the_current_battery_spec_captured_ones_of_the_capture_spec():
    """A committed entry whose op bounds are of another spec would leave its SKUs' ops check `uncalibrated`; an
    engine's captured module bounds (llama.cpp's) record the capture's spec too, so a change to what that forward is
    fed (its positions, segments, the experts' extra ids) voids them, and only them."""
    from skupin.gates.judge.ops import spec_sha256
    from skupin.gates.judge.tolerance import captured_ops

    entries = [e for e in load_tolerances(DEFAULT_PATH).entries if e.ops]
    assert any(captured_ops(e.key) for e in entries) and spec_sha256(captured=True) != spec_sha256()
    for entry in entries:
        assert entry.ops_spec == spec_sha256(captured=captured_ops(entry.key)), entry.key.label()
