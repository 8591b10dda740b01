"""gates/judge/verdict.py: binomial decision, hard bounds, pin drift, kernel bounds, check order; gates/report.py output."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from skupin.builder.catalog.lockfile import read_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.gates.integrity.static import Finding, IntegrityReport
from skupin.gates.judge.compare import KernelResult, ModelStatistics
from skupin.gates.judge.tolerance import HardBounds, ModelThresholds, Provenance, ToleranceEntry, ToleranceKey
from skupin.gates.judge.verdict import (
    CheckResult,
    GateVerdict,
    binomial_sf,
    clopper_pearson_upper,
    decide,
    judge_kernels,
    judge_model,
    judge_pins,
)
from skupin.gates.report import write_report

REPO = Path(__file__).resolve().parents[2]
N = 64


def entry(**model) -> ToleranceEntry:
    thresholds = {"per_prompt": {"kl": 1.0, "logprob_l2": 1.0}, "mean": {"kl": 0.5, "logprob_l2": 0.5},
                  "honest_rate": 0.01, "alpha": 1e-3} | model
    return ToleranceEntry(
        key=ToleranceKey(hardware_class="cpu-test", dtype="float32", model="tiny"),
        kernels={"matmul.float32": 1e-6, "silu.float32": 1e-6},
        model=ModelThresholds(**thresholds),
        provenance=Provenance(runs=2, prompts_per_run=N, hosts=("h",), versions={}, variations=("a", "b"), date="d",
                              method="m", margin=4.0, reference_sha256="b" * 64, image="x", honest_max={}))


def stats(kl, l2=None, top1=None, nonfinite=()) -> ModelStatistics:
    kl = np.asarray(kl, dtype=float)
    n = len(kl)
    per = {"kl": kl, "logprob_l2": np.asarray(l2 if l2 is not None else np.full(n, 0.1), float),
           "max_abs": np.zeros(n), "one_minus_cos": np.full(n, np.nan), "kl_full": np.full(n, np.nan),
           "top1_agree": np.asarray(top1 if top1 is not None else np.ones(n), float)}
    return ModelStatistics(per_prompt=per, available=("kl", "logprob_l2", "max_abs", "top1_agree"), nonfinite=tuple(nonfinite))


def test_binomial_tail_matches_the_definition():
    assert binomial_sf(0, 10, 0.3) == 1.0
    assert binomial_sf(11, 10, 0.3) == 0.0
    assert binomial_sf(10, 10, 0.5) == pytest.approx(0.5**10)
    assert binomial_sf(1, 64, 0.01) == pytest.approx(1 - 0.99**64)


def test_clopper_pearson_upper_bound_of_zero_events_is_the_rule_of_three():
    assert clopper_pearson_upper(0, 500) == pytest.approx(1 - 0.05 ** (1 / 500), rel=1e-6)
    assert clopper_pearson_upper(5, 100) > 0.05


def test_honest_prompts_pass():
    check, decisions, prompts = judge_model(stats=stats(np.full(N, 0.1)), entry=entry(), hard=HardBounds(), dtype="bfloat16")
    assert check.status == "pass", check.reason
    assert all(d.exceedances == 0 and not d.failed_by for d in decisions)
    assert len(prompts) == N


def test_one_noisy_prompt_is_tolerated_but_many_fail_the_binomial_test():
    one = np.full(N, 0.1)
    one[7] = 3.0
    check, _, prompts = judge_model(stats=stats(one), entry=entry(), hard=HardBounds(), dtype="bfloat16")
    assert check.status == "pass", check.reason
    assert prompts[7].exceeds == ("kl",)
    many = np.full(N, 0.1)
    many[:8] = 1.5
    check, decisions, _ = judge_model(stats=stats(many), entry=entry(), hard=HardBounds(), dtype="bfloat16")
    assert check.status == "fail"
    assert check.reason.startswith("kl: 8/64 prompts exceed")
    assert "binomial" in next(d for d in decisions if d.stat == "kl").failed_by


def test_a_uniform_shift_below_the_per_prompt_threshold_fails_on_the_mean():
    check, decisions, _ = judge_model(stats=stats(np.full(N, 0.1), l2=np.full(N, 0.9)), entry=entry(), hard=HardBounds(),
                                      dtype="bfloat16")
    assert check.status == "fail"
    assert next(d for d in decisions if d.stat == "logprob_l2").failed_by == ("mean",)


@pytest.mark.parametrize("kwargs, words", [
    ({"nonfinite": ("model.hidden",)}, "NaN/Inf in model.hidden"),
    ({"kl": np.full(N, 0.7)}, "mean KL 0.7 > hard bound 0.5"),
    ({"top1": np.full(N, 0.5)}, "top-1 agreement 50.0% < hard bound 80%"),
])
def test_hard_bounds_need_no_calibration(kwargs, words):
    s = stats(kwargs.pop("kl", np.full(N, 0.01)), **kwargs)
    check, _, _ = judge_model(stats=s, entry=None, hard=HardBounds(), dtype="bfloat16")
    assert check.status == "fail"
    assert words in check.reason


def test_float32_has_a_calibration_free_bound_that_a_kernel_one_percent_off_breaks():
    # H200 numbers (bench/results/calibration): honest float32 mean logprob L2 <= 7.8e-6 on every fixture; the
    # attention scale 1% off >= 2.0e-4. The bound sits between them and applies only to float32 runs.
    honest, faulty = np.full(N, 7.8e-6), np.full(N, 2.04e-4)
    ok, _, _ = judge_model(stats=stats(np.zeros(N), l2=honest), entry=None, hard=HardBounds(), dtype="float32")
    assert ok.status == "uncalibrated", ok.reason
    bad, _, _ = judge_model(stats=stats(np.zeros(N), l2=faulty), entry=None, hard=HardBounds(), dtype="float32",
                            name="float32")
    assert (bad.name, bad.status) == ("float32", "fail")
    assert "float32 mean logprob L2 0.000204 > hard bound 4e-05 (5.1x" in bad.reason
    same_in_bf16, _, _ = judge_model(stats=stats(np.zeros(N), l2=faulty), entry=None, hard=HardBounds(),
                                     dtype="bfloat16")
    assert same_in_bf16.status == "uncalibrated"  # bf16 rounding alone moves logprobs by ~1e-2: no such bound there
    # the calibrated decision does not lift the bound: an entry whose thresholds would pass it still fails
    calibrated, _, _ = judge_model(stats=stats(np.zeros(N), l2=faulty), entry=entry(), hard=HardBounds(),
                                   dtype="float32")
    assert calibrated.status == "fail" and calibrated.reason.startswith("hard bound: float32 mean logprob L2")


def test_without_a_tolerance_only_hard_bounds_run_and_the_gate_cannot_pass():
    check, _, _ = judge_model(stats=stats(np.full(N, 0.01)), entry=None, hard=HardBounds(), dtype="bfloat16",
                              why="no entry for k")
    assert check.status == "uncalibrated"  # never pass; decide() makes the run `uncalibrated` (exit 14)
    assert check.reason == "no entry for k (only the hard bounds were checked, and they passed)"


def test_kernel_over_its_tolerance_fails_naming_the_op():
    results = (KernelResult("matmul.float32", 5e-7, True), KernelResult("silu.float32", 7.8e-3, True))
    check = judge_kernels(results=results, entry=entry())
    assert check.status == "fail"
    assert check.reason.startswith("silu.float32: max error 0.0078")
    ok = judge_kernels(results=results[:1], entry=entry())
    assert ok.status == "pass"
    both = judge_kernels(results=(KernelResult("matmul.float32", 3e-6, True), results[1]), entry=entry())
    assert both.reason.startswith("silu.float32") and both.reason.endswith("(+1 more)")  # worst offender first


@pytest.fixture()
def cpu():
    return load_manifest(REPO / "skus/cpu-x86_64.yaml"), read_lock(REPO / "skus/cpu-x86_64.lock.json")


def test_pins_pass_when_every_file_is_accounted_for(cpu):
    manifest, _ = cpu
    report = IntegrityReport(counts={"wheel_files_verified": 3, "bytecode_verified": 2})
    check = judge_pins(report=report, manifest=manifest, host_driver=None, gpu_host=False)
    assert check.status == "pass", check.reason
    assert "3 wheel files" in check.reason and check.details["counts"]["bytecode_verified"] == 2


def test_pins_fail_names_the_first_file_and_counts_the_rest(cpu):
    manifest, _ = cpu
    findings = (Finding(kind="hook", path="x/site-packages/evil.pth", detail="a start-up hook"),
                Finding(kind="wheel", path="x/METADATA", detail="changed"))
    check = judge_pins(report=IntegrityReport(findings=findings, unverifiable=("no interpreter",)), manifest=manifest,
                       host_driver=None, gpu_host=False)
    assert check.status == "fail"  # a finding beats an unverifiable part
    assert check.reason == "the image is not its lock: /x/site-packages/evil.pth: a start-up hook (+1 more)"
    assert check.details["finding_kinds"] == {"hook": 1, "wheel": 1}


def test_pins_cannot_run_when_part_of_the_image_is_unverifiable(cpu):
    manifest, _ = cpu
    check = judge_pins(report=IntegrityReport(unverifiable=("no interpreter compiles like the image's",)),
                       manifest=manifest, host_driver=None, gpu_host=False)
    assert check.status == "error" and check.reason.startswith("no interpreter")


def test_gpu_host_driver_must_be_in_the_pinned_series():
    manifest = load_manifest(REPO / "skus/nvidia-h200-vllm.yaml")
    series = manifest.stack.driver.version.split(".")[0]
    clean = IntegrityReport()
    ok = judge_pins(report=clean, manifest=manifest, host_driver={"version": f"{series}.1.2"}, gpu_host=True)
    assert ok.status == "pass", ok.reason
    bad = judge_pins(report=clean, manifest=manifest, host_driver={"version": "1.2.3"}, gpu_host=True)
    assert bad.status == "fail" and "not in the pinned series" in bad.reason
    none = judge_pins(report=clean, manifest=manifest, host_driver={}, gpu_host=True)
    assert none.status == "error"
    not_gpu = judge_pins(report=clean, manifest=manifest, host_driver=None, gpu_host=False)
    assert not_gpu.details["host_driver"] == "not checked: not a GPU host"


def test_the_first_failure_decides_and_errors_mean_could_not_run():
    ok = CheckResult(name="boot", status="pass", reason="")
    assert decide((ok, CheckResult(name="pins", status="fail", reason="drift")))[0] == "fail"
    assert decide((ok, CheckResult(name="boot", status="error", reason="deadline")))[0] == "could_not_run"
    assert decide((ok, CheckResult(name="serve", status="skipped", reason="")))[0] == "pass"


def test_report_writes_json_markdown_and_a_png(tmp_path):
    s = stats(np.linspace(0.01, 1.2, N))
    check, decisions, prompts = judge_model(stats=s, entry=entry(), hard=HardBounds(), dtype="bfloat16")
    kern = judge_kernels(results=(KernelResult("matmul.float32", 5e-7, True),), entry=entry())
    checks = (CheckResult(name="boot", status="pass", reason="ok"), kern, check)
    decision, reason = decide(checks)
    verdict = GateVerdict(sku="cpu-test", hardware_class="cpu-test", image="img", image_id="sha256:1", lock_hash=None,
                          reference=None, tolerance=None, checks=checks, model_decision=decisions, prompts=prompts,
                          decision=decision, reason=reason, timings={"total_s": 1.0}, tool_version="0", created="now")
    paths = write_report(verdict=verdict, out=tmp_path)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = paths["report"].read_text()
    assert "## Model check" in text and "kl" in text and "plot.png" in text
    again = GateVerdict.model_validate_json(paths["verdict"].read_text())
    assert again.decision == verdict.decision and again.exit_code == verdict.exit_code
    assert math.isclose(again.prompts[5].stats["kl"], prompts[5].stats["kl"])


def test_kernel_hard_bound_needs_no_calibration():
    from skupin.gates.judge.compare import KernelResult
    from skupin.gates.judge.verdict import kernel_hard_failures

    honest = (KernelResult(op="silu.float32", rel_err=4e-8, finite=True),
              KernelResult(op="softmax.float32", rel_err=1.7e-7, finite=True),
              # TF32-like matmul error: left to the calibrated bound, not the hard one
              KernelResult(op="matmul.float32", rel_err=1e-3, finite=True),
              KernelResult(op="silu.bfloat16", rel_err=7.8e-3, finite=True))
    assert kernel_hard_failures(results=honest, hard=HardBounds()) == []
    wrong_silu = (KernelResult(op="silu.float32", rel_err=7.8e-3, finite=True),)
    assert "silu.float32" in kernel_hard_failures(results=wrong_silu, hard=HardBounds())[0]
    nan = (KernelResult(op="matmul.bfloat16", rel_err=None, finite=False),)
    assert "NaN/Inf" in kernel_hard_failures(results=nan, hard=HardBounds())[0]


def test_report_of_the_committed_example_plots_without_matplotlib_warnings(tmp_path):
    """A real passing CPU verdict (docs/examples): reference lines drawn before any data made
    matplotlib warn about identical y limits."""
    import warnings

    from tests.paths import REPO

    verdict = GateVerdict.model_validate_json((REPO / "docs/examples/gate-cpu-x86_64/verdict.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_report(verdict=verdict, out=tmp_path)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_lists_every_binary_and_smoke_item_named_not_only_the_first(tmp_path):
    """The checks table shows a check's first finding; report.md lists them all (up to the verdict's cap)."""
    from skupin.gates.integrity.binaries import BinariesReport, BinaryFinding
    from skupin.gates.judge.smoke import judge_smoke
    from skupin.gates.judge.verdict import judge_binaries

    findings = tuple(BinaryFinding(kind="unresolved", path=f"venv/lib/ext{i}.so", detail=f"NEEDED libgone{i}.so.1")
                     for i in range(3))
    binaries = judge_binaries(BinariesReport(findings=findings, checked=7, needed=20))
    smoke = judge_smoke({"imports": {"torch": "ok", "vllm": "ok"}, "extensions": {"vllm._C": "ImportError: undefined symbol: x",
                                                                                  "vllm._moe_C": "ok"},
                         "libraries": {"/venv/torch/lib/libshm.so": "OSError: invalid ELF header"}},
                        host_libraries=("libcuda.so.1",), family="cuda", expected=("torch", "vllm"))
    assert binaries.status == smoke.status == "fail" and smoke.details["broken_count"] == 2
    checks = (CheckResult(name="pins", status="pass", reason="ok"), binaries)
    decision, reason = decide(checks)
    verdict = GateVerdict(sku="cpu-test", hardware_class="cpu-test", image="img", image_id="sha256:1", lock_hash=None,
                          reference=None, tolerance=None, checks=(*checks, smoke), decision=decision, reason=reason,
                          timings={"total_s": 1.0}, tool_version="0", created="now")
    text = write_report(verdict=verdict, out=tmp_path)["report"].read_text()
    assert "## Native binaries" in text and "7 ELF files above the base" in text
    assert all(f"- /venv/lib/ext{i}.so: NEEDED libgone{i}.so.1" in text for i in range(3))
    assert "## Import smoke test" in text and "- extension vllm._C: ImportError: undefined symbol: x" in text
    assert "- library /venv/torch/lib/libshm.so: OSError: invalid ELF header" in text
