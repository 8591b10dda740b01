"""The model decision at any prompt count: the mean bound narrows with more prompts (never weaker detection), and the
float32 pass refuses missing outputs as the model check does (gates/judge/tolerance.py: mean_bound; gates/gate.py)."""

from __future__ import annotations

import numpy as np
import yaml

import skupin.gates.gate as gate
from skupin.gates.gate import BootResult, PinsResult, ProbeRun, ToleranceResult, _check_float32
from skupin.gates.judge.tolerance import HardBounds
from skupin.gates.judge.verdict import CheckResult, judge_model
from tests.unit.test_gate_model import _inputs
from tests.unit.test_verdict import entry, stats

PASSED = CheckResult(name="test", status="pass", reason="test")


def test_the_mean_bound_is_the_calibrated_one_at_the_calibrations_prompt_count() -> None:
    e = entry(mean_center={"kl": 0.1})
    assert e.model.mean_bound("kl", prompts=64, calibrated_prompts=64) == 0.5


def test_the_mean_bound_never_grows_with_more_prompts_with_or_without_a_centre() -> None:
    for e in (entry(), entry(mean_center={"kl": 0.1, "logprob_l2": 0.2})):
        bounds = [e.model.mean_bound("kl", prompts=n, calibrated_prompts=64) for n in (1, 4, 8, 16, 32, 64, 128, 600)]
        assert all(a >= b for a, b in zip(bounds, bounds[1:], strict=False)), bounds
        assert bounds[0] > 0.5  # an honest 1-prompt run scatters more: the bound is wider


def test_with_a_centre_the_bound_narrows_towards_it_and_without_one_it_never_narrows_below_the_calibrated() -> None:
    centred = entry(mean_center={"kl": 0.1})
    assert abs(centred.model.mean_bound("kl", prompts=256, calibrated_prompts=64) - (0.1 + 0.4 / 2)) < 1e-12
    assert entry().model.mean_bound("kl", prompts=256, calibrated_prompts=64) == 0.5
    # a centre at or above the bound is not a centre: the entry is treated as one without
    odd = entry(mean_center={"kl": 0.7})
    assert odd.model.mean_bound("kl", prompts=256, calibrated_prompts=64) == 0.5


def test_a_fault_caught_at_eight_prompts_is_caught_at_sixty_four() -> None:
    """A mean shift the bound at 8 prompts rejects is rejected at 64 too (the bound at 64 is lower)."""
    e = entry(mean_center={"kl": 0.1})
    rng = np.random.default_rng(0)
    caught_at8 = 0
    for shift in (0.45, 0.6, 0.9, 1.2):
        faulty = np.clip(shift + rng.normal(0, 0.05, 64), 0, None)
        at8 = [judge_model(stats=stats(faulty[i:i + 8]), entry=e, hard=HardBounds(), dtype="bfloat16")[0].status
               for i in range(0, 64, 8)]
        at64 = judge_model(stats=stats(faulty), entry=e, hard=HardBounds(), dtype="bfloat16")[0].status
        if "fail" in at8:
            caught_at8 += 1
            assert at64 == "fail", (shift, at8, at64)
    assert caught_at8 >= 2  # the property was exercised, not vacuous


def test_an_honest_short_run_is_not_rejected_for_its_noise() -> None:
    e = entry(mean_center={"kl": 0.1})
    honest = np.full(4, 0.1)
    honest[0] = 0.9  # one noisy prompt of four: the mean 0.3 is within a 4-prompt bound (not the 64-prompt 0.5 alone)
    check, decisions, _ = judge_model(stats=stats(honest), entry=e, hard=HardBounds(), dtype="bfloat16")
    kl = next(d for d in decisions if d.stat == "kl")
    assert kl.mean_threshold > 0.5
    assert "mean" not in kl.failed_by


def test_narrowing_stops_at_the_dtype_floor() -> None:
    e = entry(mean_center={"kl": 0.1})
    assert e.model.mean_bound("kl", prompts=100_000, calibrated_prompts=64, floor=0.3) == 0.3
    assert e.model.mean_bound("kl", prompts=8, calibrated_prompts=64, floor=0.3) > 0.5  # widening is not floored


def test_an_entry_without_centres_serialises_as_before() -> None:
    dumped = entry().model_dump(mode="json")
    assert "mean_center" not in dumped["model"]
    assert "mean_center" in entry(mean_center={"kl": 0.1}).model_dump(mode="json")["model"]
    assert "mean_center" not in yaml.safe_dump(dumped)


def test_the_float32_pass_fails_when_the_candidate_leaves_out_an_output_its_engine_provides(monkeypatch) -> None:
    inputs = _inputs()
    bf16 = inputs.manifest.model_copy(update={"gate": inputs.manifest.gate.model_copy(update={"dtype": "bfloat16"})})
    inputs = gate.GateInputs(**{**inputs.__dict__, "stack": inputs.stack.model_copy(update={"manifest": bf16})})
    ref = {"model.hidden": np.zeros((2, 3, 4), np.float32), "model.logprobs_full": np.zeros((1, 2, 5), np.float32)}
    monkeypatch.setattr(gate, "float32_reference", lambda folder, dtype: folder)
    monkeypatch.setattr(gate, "float32_manifest", lambda m: m)
    monkeypatch.setattr(gate, "load_reference", lambda **_: ({}, ref, "a" * 64))
    monkeypatch.setattr(gate, "probe_in_container", lambda **_: ProbeRun(
        report={"checks": {"model": {"status": "ok"}}}, tensors={"model.logprobs_full": ref["model.logprobs_full"]}))
    result = _check_float32(inputs, PinsResult(PASSED, image_id="sha256:x"), ToleranceResult(),
                            BootResult(PASSED)).check
    assert result.status == "fail", result.reason
    assert result.reason.startswith("the candidate returned no model.hidden")
