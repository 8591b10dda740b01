"""The calibration bench's known answers (bench/ab_calibration.py): the slow-Npct swap's pacing of decode steps
(tests/integration/derived/swap.py) on a clock the test drives, on transformers' own generate loop, and the bench's
rates, resolution and duration estimate."""

from __future__ import annotations

import importlib.util
import math
import threading
from pathlib import Path

import pytest

from bench import ab_calibration as C
from skupin.ab.decision import ABSettings

SWAP = Path(__file__).resolve().parents[1] / "integration" / "derived" / "swap.py"


def _swap_module():
    spec = importlib.util.spec_from_file_location("skupin_test_swap_unit", SWAP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # MODE is "@MODE@" and SKUPIN_TEST_SWAP unset: patches nothing
    return module


class _Cache:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def get_seq_length(self) -> int:
        return self.tokens


@pytest.mark.parametrize("keep", [0.95, 0.90])
def test_a_paced_decode_step_takes_one_over_keep_of_its_own_period(keep: float) -> None:
    swap = _swap_module()
    assert swap.SLOW_DECODE == {"slow-5pct": 0.95, "slow-10pct": 0.90}
    now = [0.0]

    def clock() -> float:  # the busy wait reads it: each read is a microsecond
        now[0] += 1e-6
        return now[0]

    def forward(self, input_ids=None, cache=None):
        now[0] += 0.009 if cache is not None and cache.get_seq_length() else 0.030  # a decode step, a prefill
        return input_ids

    stepped = swap.paced(forward, keep=keep, state=threading.local(), clock=clock)
    stepped(None, 1, cache=_Cache(0))  # prefill: no wait
    assert now[0] == pytest.approx(0.030, abs=1e-5)
    start = now[0]
    for n in range(1, 64):
        now[0] += 0.001  # the generate loop's own work between forwards (streamer, sampler): part of the period
        stepped(None, 1, cache=_Cache(64 + n))
    # each step's period is 10 ms; paced, 10 ms / keep, to the clock's resolution
    assert (now[0] - start) / 63 == pytest.approx(0.010 / keep, abs=3e-6)
    assert stepped(None, 1) == 1 and stepped.__wrapped__ is forward  # no cache: a prefill; the signature is kept


def test_transformers_generate_waits_after_every_decode_forward_and_never_after_the_prefill(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    swap = _swap_module()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 120, (1, 12))
    honest = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    reads = [0]

    def clock() -> float:  # one unit per read: a wait of keep 0.5 after a one-unit period ends at its first read
        reads[0] += 1
        return float(reads[0])

    monkeypatch.setattr(LlamaForCausalLM, "forward",
                        swap.paced(LlamaForCausalLM.forward, keep=0.5, state=threading.local(), clock=clock))
    paced = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(paced, honest)  # the numbers are the honest ones
    assert reads[0] == 1 + 2 * 7  # the prefill reads the clock once, each of the 7 decode steps twice (end, wait)


def test_wilson_and_the_rates() -> None:
    assert C.wilson(0, 0) is None
    low, high = C.wilson(20, 20)
    assert high == 1.0 and 0.83 < low < 0.84  # 20 of 20 shows at least ~84%, not 95%
    assert C.wilson(19, 20)[0] == pytest.approx(0.764, abs=1e-3)


def test_resolvable_difference_shrinks_with_rounds_and_noise() -> None:
    assert C.resolvable(0.03, 1) is None
    r16, r4 = C.resolvable(0.03, 16), C.resolvable(0.03, 4)
    assert r16 is not None and r4 is not None and r16 < r4
    # (t(0.975, 15) + t(0.95, 15)) x 0.03 / 4 = (2.131 + 1.753) x 0.0075
    assert r16 == pytest.approx(1 - math.exp(-3.884 * 0.0075), rel=1e-3)


def _row(arm: str, rounds: list[float], line: str = "hold: within noise") -> dict:
    from skupin.ab.decision import ratio_interval

    lo, hi = ratio_interval(rounds)
    return {"arm": arm, "expected_ratio": C.ARMS[arm], "decision_line": line, "decode_half_width": math.sqrt(hi / lo) - 1,
            "within_noise": line == "hold: within noise", "detected_slower": hi < 1, "detected_faster": lo > 1,
            "covers_expected": lo <= C.ARMS[arm] <= hi, "kpis": {"decode": {"rounds": rounds}}}


def test_arm_summary_and_goals() -> None:
    selfs = [_row("self", [1.01, 0.99, 1.0, 1.02]), _row("self", [0.98, 1.0, 1.01, 0.99])]
    slows = [_row("slow-5pct", [0.95, 0.94, 0.96, 0.95], "hold: within noise"),
             _row("slow-5pct", [0.95, 0.97, 0.93, 0.96], "reject: slower")]
    summary = {"self": C.arm_summary(selfs), "slow-5pct": C.arm_summary(slows)}
    assert summary["self"]["within_noise"]["hits"] == 2 and summary["self"]["covers_expected"]["rate"] == 1.0
    assert summary["slow-5pct"]["detected_slower"]["hits"] == 2
    assert summary["slow-5pct"]["decisions"] == {"hold: within noise": 1, "reject: slower": 1}
    assert summary["slow-5pct"]["pooled_ratio"] == pytest.approx(0.951, abs=0.002)
    assert 0 < summary["self"]["resolves_at_95"] < 0.05
    goals = C.goals(summary)
    assert goals["self_within_noise"]["met_observed"] and not goals["self_within_noise"]["met_with_95_confidence"]


def test_the_full_run_is_estimated_in_hours_and_the_quick_one_in_minutes() -> None:
    full = C.settings_of(C._parse([]))
    quick = C.settings_of(C._parse(["--quick"]))
    assert (full.runs, full.concurrency, full.prompt_lengths) == (16, (1,), (64,))
    assert 3 * 3600 < C.estimate_s(full, abs_count=90, images=4) < 6 * 3600
    assert C.estimate_s(quick, abs_count=3, images=4) < 15 * 60
    assert C.settings_of(C._parse(["--target-ci", "0.02", "--max-runs", "40"])).max_runs == 40
    with pytest.raises(SystemExit):
        C.settings_of(C._parse(["--budget-s", "60"]))
    assert isinstance(quick, ABSettings)


def test_boot_components_split_a_processs_offset_from_round_noise() -> None:
    # two A/Bs of 4 boots x 4 rounds: rounds within a boot spread by +-1%, boots sit 3% apart
    def row(offsets: list[float]) -> dict:
        rounds = [o * f for o in offsets for f in (0.99, 1.01, 0.99, 1.01)]
        return {**_row("self", rounds), "boots": [b for b in range(1, 5) for _ in range(4)]}

    rows = [row([1.03, 0.97, 1.03, 0.97]), row([0.97, 1.03, 0.97, 1.03])]
    c = C.boot_components(rows)
    assert c is not None and (c["abs"], c["boots"], c["rounds_per_boot"]) == (2, 8, 4)
    assert c["sd_within_boot"] == pytest.approx(0.0115, abs=1e-3)
    assert c["sd_between_boots"] == pytest.approx(0.0345, abs=2e-3)  # the 3% offsets, net of the rounds' share
    # more rounds per boot cannot average out an offset of the process: boots needed stop shrinking
    needed = c["boots_for_5pct"]
    assert needed[2] is not None and needed[16] is not None and needed[2] >= needed[4] >= needed[16] >= 3
    summary = C.arm_summary(rows)
    assert summary["boot_components"] == c and summary["resolves_at_95_boots"] > C.resolvable(c["sd_within_boot"], 16)
    assert C.boot_components([_row("self", [1.0, 1.01, 0.99])]) is None  # one boot: nothing to split


def test_append_takes_the_earlier_runs_abs_only_with_the_same_settings(tmp_path) -> None:
    settings = C.settings_of(C._parse(["--runs", "8", "--restart-every", "4"]))
    out = tmp_path / "boots.json"
    assert C._earlier(out, settings) == ([], [])
    C._write(out, {"settings": settings.model_dump(mode="json"), "abs": [{"arm": "self"}] * 3, "started": "t0",
                   "wall_s": 60.0, "earlier_runs": [{"started": "t-1", "wall_s": 30.0, "abs": 1}]})
    rows, runs = C._earlier(out, settings)
    assert len(rows) == 3 and runs == [{"started": "t-1", "wall_s": 30.0, "abs": 1}, {"started": "t0", "wall_s": 60.0, "abs": 2}]
    with pytest.raises(SystemExit, match="other settings"):
        C._earlier(out, C.settings_of(C._parse(["--runs", "12", "--restart-every", "4"])))
