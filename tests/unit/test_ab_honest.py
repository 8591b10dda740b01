"""`skupin ab` made signable (issue 33): host-counted tokens, under-generation, intervals, slices, capacity, CPU cost."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from skupin.ab.annex import annex_markdown
from skupin.ab.decision import (
    DECISION_RULE,
    ABRound,
    capacity,
    capacity_side,
    decide,
    kpi,
    min_host_tokens,
    ratio_interval,
    slice_decisions,
    t_quantile,
)
from skupin.ab.runtime import _Measured
from skupin.builder.catalog.manifest import ServeGate
from skupin.clients.openai import Completion, ServeClient
from skupin.engines import ALL_ENGINES, NEVER_EOS, serve_launch
from skupin.gates.serving.perf import PerfResult, PerfSettings, Sample, run_perf, sample_of, summarize_level, tokenizer_counter

FIXTURE = Path(__file__).resolve().parents[2] / "gates" / "fixtures" / "tiny-llama"
WORDS = "the quick brown fox jumps over the lazy dog and runs far away from the quiet old farm house"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


def _text_of(tokenizer: Tokenizer, n: int) -> tuple[str, list[str]]:
    """The text of the first n tokens of WORDS, and its pieces as a server streams them (one per token)."""
    ids = tokenizer.encode(WORDS, add_special_tokens=False).ids[:n]
    assert len(ids) == n
    pieces = [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(n)]
    return "".join(pieces), pieces


def _completion(text: str, pieces: list[str], claimed: int) -> Completion:
    return Completion(text=text, pieces=tuple(pieces), token_ids=None, logprobs=None, prompt_tokens=64,
                      completion_tokens=claimed, finish_reason="length", ttft_s=0.01, total_s=0.1,
                      piece_times=tuple(0.01 + 0.01 * i for i in range(len(pieces))))


# ---------------------------------------------------------------- counting honestly


def test_a_server_claiming_32_tokens_but_streaming_8_is_credited_8(tokenizer) -> None:
    text, pieces = _text_of(tokenizer, 8)
    liar = _completion(text, pieces, claimed=32)
    count = tokenizer_counter(tokenizer)
    assert count(text) == 8 and liar.n_tokens == 32  # the server's word, which the A/B no longer takes
    assert sample_of(liar, 32).output_tokens == 32  # the server's count (the gate's serve check, capped)
    assert sample_of(liar, 32, count).output_tokens == 8  # the host's count
    honest_text, honest_pieces = _text_of(tokenizer, 12)
    inflated = _completion(honest_text, honest_pieces, claimed=12)
    assert sample_of(inflated, 10, count).output_tokens == 10  # never above max_tokens


def test_a_mock_server_that_under_generates_is_counted_short_by_the_ab(tokenizer) -> None:
    """The A/B's recorder and run_perf against a server that claims max_tokens in usage and streams 8 tokens of text."""
    text, pieces = _text_of(tokenizer, 8)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        events = [{"choices": [{"index": 0, "text": p}]} for p in pieces]
        events.append({"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": body["max_tokens"]}})
        time.sleep(0.002)
        return httpx.Response(200, content=iter(["".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()
                                                 + b"data: [DONE]\n\n"]))

    measured = _Measured(count_tokens=tokenizer_counter(tokenizer), max_tokens=32)
    settings = PerfSettings(concurrency=(1,), requests=4, repetitions=1, warmup=0, max_tokens=32, prompts=1)
    with ServeClient(base_url="http://x", model_id="m", transport=httpx.MockTransport(handler), workers=1) as client:
        result = run_perf(client=client, prompts=["a"], settings=settings, on_completion=measured.record("candidate", 0),
                          count_tokens=measured.count_tokens)
    assert result.levels[0].output_tokens == 4 * 8  # credited with what it streamed, not the 32 it claimed
    assert measured.short["candidate"] == 4 and measured.requests["candidate"] == 4
    assert measured.tokens["candidate"] == {"asked": 128, "host": 32, "claimed": 128}


def test_the_slack_admits_the_measured_round_trip_and_not_an_under_generating_server() -> None:
    assert min_host_tokens(32) == 24  # honest worst measured on the fixture: 26 of 32
    assert min_host_tokens(4) == 2 and min_host_tokens(2) == 0


def _common(**extra):
    from tests.unit.test_runtime_ab import decode_kpi, prefill_kpi, rounds

    c, b = rounds(150, 150, 150), rounds(100, 100, 100)
    return {"candidate_gate": "pass", "candidate_failure": "", "baseline_gate": "pass", "baseline_failure": "",
            "decode": decode_kpi(c, b), "prefill": prefill_kpi(c, b), "floor": 0.02, **extra}


def test_an_under_generating_side_cannot_be_promoted() -> None:
    assert decide(**_common())[0] == "promote"
    decision, line, reason = decide(**_common(short={"candidate": 1.0}))
    assert (decision, line) == ("reject", "reject: candidate under-generates") and "not from the server's usage" in reason
    assert decide(**_common(short={"baseline": 0.5}))[:2] == ("hold", "hold: baseline under-generates")
    assert decide(**_common(short={"candidate": 0.04}))[0] == "promote"  # a rare degenerate round trip is tolerated


def test_every_engines_requests_forbid_an_early_eos() -> None:
    """So an honest server always streams max_tokens: vLLM and SGLang ignore_eos, llama.cpp min_tokens, transformers a
    generation_config whose min_new_tokens exceeds any max_tokens."""
    from skupin.builder.check import resolve
    from skupin.common.paths import sku_path

    seen = set()
    for sku in ("cpu-x86_64", "cpu-x86_64-vllm", "cpu-x86_64-llamacpp", "nvidia-h200-sglang"):
        launch = serve_launch(manifest=resolve(sku_path(sku)).manifest)
        assert launch is not None
        extra = launch.request_extra
        seen.add(launch.engine)
        full = (extra.get("ignore_eos") is True or extra.get("min_tokens") == NEVER_EOS
                or json.loads(extra.get("generation_config", "{}")).get("min_new_tokens") == NEVER_EOS)
        assert full, (launch.engine, extra)
    assert seen == set(ALL_ENGINES)


# ---------------------------------------------------------------- intervals


def test_t_quantiles_and_the_paired_interval_are_exact_and_deterministic() -> None:
    assert t_quantile(1) == pytest.approx(12.706, abs=1e-3) and t_quantile(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile(30) == pytest.approx(2.042, abs=1e-3)
    logs = [math.log(x) for x in (0.9, 0.95, 1.0)]
    mean, sd = sum(logs) / 3, math.sqrt(sum((v - sum(logs) / 3) ** 2 for v in logs) / 2)
    low, high = ratio_interval([0.9, 0.95, 1.0])
    assert low == pytest.approx(math.exp(mean - 4.3027 * sd / math.sqrt(3)), rel=1e-4)
    assert high == pytest.approx(math.exp(mean + 4.3027 * sd / math.sqrt(3)), rel=1e-4)
    assert ratio_interval([0.9, 0.95, 1.0]) == (low, high)  # no randomness
    assert ratio_interval([1.1]) is None and ratio_interval([float("nan"), 1.0]) is None
    assert ratio_interval([1.05] * 5) == pytest.approx((1.05, 1.05))


def test_over_boots_the_interval_holds_each_server_processs_own_offset() -> None:
    # four boots whose rounds agree closely within a boot but whose processes ran 2-3% fast or slow
    offsets = [1.03, 0.98, 1.02, 0.97]
    rounds = [o * f for o in offsets for f in (0.995, 1.005, 1.0, 1.0)]
    boots = [b for b in (1, 2, 3, 4) for _ in range(4)]
    by_round, by_boot = ratio_interval(rounds), ratio_interval(rounds, boots)
    assert by_round is not None and by_boot is not None
    # over 16 rounds the interval is too narrow for a 3% offset; over 4 boots it is as wide as the boots disagree
    assert by_boot[1] - by_boot[0] > 2.5 * (by_round[1] - by_round[0])
    logs = [sum(math.log(r) for r in rounds[4 * b:4 * b + 4]) / 4 for b in range(4)]
    half = t_quantile(3) * statistics.stdev(logs) / 2
    assert by_boot == pytest.approx((math.exp(statistics.mean(logs) - half), math.exp(statistics.mean(logs) + half)))
    # one boot: the rounds' interval; a boot without a finite round counts for nothing
    assert ratio_interval(rounds[:4], [1] * 4) == ratio_interval(rounds[:4])
    assert ratio_interval([*rounds[:8], float("nan")], [*boots[:8], 3]) == ratio_interval(rounds[:8], boots[:8])


def test_every_kpi_carries_its_interval() -> None:
    from tests.unit.test_runtime_ab import rounds

    k = kpi(name="decode", unit="tok/s", higher_is_better=True, candidate=rounds(104, 106, 105, 105),
            baseline=rounds(100, 100, 100, 100), metric=lambda lv: lv.decode_tok_s_per_request,
            pooled=lambda lvs: 0.0)
    assert k.ci_low is not None and k.ci_high is not None and 1.0 < k.ci_low < k.ratio < k.ci_high < 1.1
    cand, base = rounds(200, 200), rounds(100, 100)
    cost = kpi(name="cost", unit="USD", higher_is_better=False, candidate=cand, baseline=base,
               metric=lambda lv: 1 / lv.aggregate_tok_s, pooled=lambda lvs: 0.0, scale=3.0)
    speedup = cand[0][0].levels[0].aggregate_tok_s / base[0][0].levels[0].aggregate_tok_s
    assert speedup > 1.5 and cost.ratio == pytest.approx(3.0 / speedup)  # 3x the rate at `speedup` the throughput


# ---------------------------------------------------------------- slices


def _level(c: int, tok_s: float) -> object:
    rep = [Sample(ttft_s=0.01, prompt_tokens=64, output_tokens=32, decode_s=31 / tok_s) for _ in range(4)]
    return summarize_level(concurrency=c, reps=[(rep, 1.0)])


def _round(by_slice: dict[tuple[int, int], float]) -> list[PerfResult]:
    """One round: per prompt length (64, 256), levels 1 and 4 at the given decode tok/s."""
    return [PerfResult(settings=PerfSettings(concurrency=(1, 4), repetitions=1),
                       levels=tuple(_level(c, by_slice[(n, c)]) for c in (1, 4)), wall_s=1.0) for n in (64, 256)]


def test_one_slice_that_regresses_turns_a_promote_into_a_trade_off_naming_it() -> None:
    """The issue's case: faster on the headline, 0.6x at 256-token prompts and concurrency 4."""
    from tests.unit.test_runtime_ab import decode_kpi

    base = [_round({(64, 1): 100, (64, 4): 100, (256, 1): 100, (256, 4): 100}) for _ in range(3)]
    cand = [_round({(64, 1): 150 + r, (64, 4): 150, (256, 1): 140, (256, 4): 60 + r}) for r in range(3)]
    per_slice = slice_decisions(candidate=cand, baseline=base, prompt_lengths=(64, 256))
    moves = {(s.prompt_tokens, s.concurrency): s.move for s in per_slice}
    assert moves == {(64, 1): "better", (64, 4): "better", (256, 1): "better", (256, 4): "worse"}
    worst = per_slice[-1]
    assert worst.ratio == pytest.approx(0.61) and worst.ci_high is not None and worst.ci_high < 1
    common = _common(decode=decode_kpi(cand, base), prefill=None)
    assert decide(**common)[0] == "promote"  # what the headline alone says
    decision, line, reason = decide(**common, slices=per_slice)
    assert (decision, line) == ("hold", "hold: trade-off (decode faster; slices 256 tok x c4 worse)")
    assert "256 tok x c4 0.610x, 95% CI" in reason


def test_a_noisy_slice_is_the_same_not_worse_and_ttft_is_lower_is_better() -> None:
    base = [_round({(64, 1): 100, (64, 4): 100, (256, 1): 100, (256, 4): 100}) for _ in range(3)]
    cand = [_round({(64, 1): 130, (64, 4): 130, (256, 1): 130, (256, 4): v}) for v in (70, 130, 95)]
    assert [s.move for s in slice_decisions(candidate=cand, baseline=base, prompt_lengths=(64, 256))][-1] == "same"
    ttft = slice_decisions(candidate=cand, baseline=base, prompt_lengths=(64, 256), primary="ttft_p50")
    assert {s.move for s in ttft} == {"not measured"} or {s.move for s in ttft} <= {"same"}  # equal TTFTs


def test_the_manifest_names_the_primary_kpi() -> None:
    assert ServeGate().primary_kpi == "decode"
    assert ServeGate(primary_kpi="aggregate").primary_kpi == "aggregate"
    with pytest.raises(ValueError):
        ServeGate(primary_kpi="vibes")


# ---------------------------------------------------------------- capacity, cost, CPU


def test_capacity_follows_seed_001s_cost_model() -> None:
    # 100M tokens/day at 100 tok/s per server, 60% busy: 1e8 / (100 * 86400 * 0.6) = 19.3 -> 20 servers
    b = capacity_side(tok_s=100.0, devices=1, hourly_usd=0.10, utilisation=0.6, volume=1e8)
    c = capacity_side(tok_s=150.0, devices=1, hourly_usd=0.10, utilisation=0.6, volume=1e8)
    assert b is not None and c is not None
    assert (b.servers, b.devices, b.monthly_usd) == (20, 20, pytest.approx(20 * 0.10 * 730))
    assert c.servers == 13 and b.usd_per_1m_output_tokens == pytest.approx(0.10 / (100 * 3600 * 0.6) * 1e6)
    eight = capacity_side(tok_s=5000.0, devices=8, hourly_usd=3.0, utilisation=0.5, volume=1e10)
    assert eight is not None and eight.servers == 47 and eight.devices == 376  # whole 8-GPU servers
    cap = capacity(volume=1e8, baseline=b, candidate=c)
    assert cap.monthly_saving_usd == pytest.approx(7 * 0.10 * 730)
    assert capacity_side(tok_s=100.0, devices=1, hourly_usd=None, utilisation=None, volume=1e8) is None
    assert "baseline" in capacity(volume=1e8, baseline=None, candidate=c).missing


def test_cpu_seconds_per_million_tokens_from_the_containers_accounting() -> None:
    m = _Measured()
    m.cpu["candidate"] |= {0: (2.0, 1000), 1: (3.0, 1000)}
    assert m.cpu_cost("candidate") is None  # only over rounds both sides have accounting for
    m.cpu["baseline"] |= {0: (1.0, 1000), 1: (1.0, 1000)}
    cost = m.cpu_cost("candidate")
    assert cost is not None and cost.cpu_s_per_1m_output_tokens == pytest.approx(2500.0)
    assert cost.rounds == pytest.approx((2000.0, 3000.0)) and cost.round_numbers == (1, 2)


def test_the_annex_states_intervals_slices_capacity_the_rule_and_that_the_model_is_a_fixture() -> None:
    from tests.unit.test_runtime_ab import _record

    base_runs = [_round({(64, 1): 100, (64, 4): 100, (256, 1): 100, (256, 4): 100}) for _ in range(3)]
    cand_runs = [_round({(64, 1): 150, (64, 4): 150, (256, 1): 140, (256, 4): 60 + r}) for r in range(3)]
    per_slice = slice_decisions(candidate=cand_runs, baseline=base_runs, prompt_lengths=(64, 256))
    b = capacity_side(tok_s=100.0, devices=1, hourly_usd=0.10, utilisation=0.6, volume=1e8)
    c = capacity_side(tok_s=150.0, devices=1, hourly_usd=0.10, utilisation=0.6, volume=1e8)
    m = _Measured()
    m.cpu["baseline"][0], m.cpu["candidate"][0] = (4.0, 2000), (3.0, 2000)
    cpu_cost = m.cpu_cost("baseline")
    assert cpu_cost is not None
    record = _record().model_copy(update={
        "slices": per_slice, "capacity": capacity(volume=1e8, baseline=b, candidate=c), "decision_rule": DECISION_RULE,
        "model_parameters": 2_819_840, "cpu": {"baseline": cpu_cost},
        "requests": {"baseline": 3, "candidate": 3},
        "output_tokens": {"baseline": {"asked": 96, "host": 96, "claimed": 96}}})
    text = annex_markdown(record)
    assert "**Model: the `tiny-llama` test fixture (2.8M parameters, random weights), not a customer model.**" in text
    assert "re-measured on the customer's model and card" in text
    assert "| KPI | baseline | candidate | ratio | 95% CI | rounds | better |" in text
    assert "## Per slice: decode tok/s per request (the primary KPI)" in text and "| 256 | 4 | 0.610 |" in text
    assert "**worse**" in text
    assert "## Capacity and cost at 100,000,000 output tokens per day" in text
    assert "| servers (devices) needed | 20 (20) | 13 (13) |" in text and "Monthly saving of the candidate: **$511**" in text
    assert "baseline 2,000 (4.0 CPU-s for 2000 tokens)" in text
    assert "## Decision rule" in text and "no slice (prompt length x concurrency) worse on the primary KPI" in text
    assert "baseline 96 / 96 / 96" in text
    again = type(record).model_validate_json(record.model_dump_json())
    assert again.slices == record.slices and again.capacity == record.capacity
    assert "all rounds ran on one boot of each server" in text  # what an interval over rounds misses, said
    restarted = record.model_copy(update={
        "settings": record.settings.model_copy(update={"restart_every": 2}),
        "rounds": tuple(ABRound(number=n + 1, order="BA" if n % 2 == 0 else "AB", boot=1 + n // 2, baseline="ok",
                                candidate="ok") for n in range(len(record.order)))})
    text = annex_markdown(restarted)
    boots = len(set(restarted.boots))
    assert boots == 2 and "measured over 2 boots of both servers, started again after every 2 rounds" in text
    assert "paired t on the log ratio over 2 boots" in text


def test_the_cpu_kpi_pairs_each_rounds_cpu_per_token() -> None:
    from skupin.ab.runtime import _cpu_kpi

    m = _Measured(order=["BA", "AB", "BA"], boot=[1, 1, 1])
    m.cpu["baseline"] |= {0: (2.0, 1000), 1: (2.2, 1000), 2: (1.8, 1000)}
    m.cpu["candidate"] |= {0: (1.0, 1000), 1: (1.1, 1000), 2: (0.9, 1000)}  # half the CPU per token in every round
    k = _cpu_kpi(m)
    assert k is not None and k.name == "cpu" and not k.higher_is_better
    assert k.ratio == pytest.approx(0.5) and k.ci_low == pytest.approx(0.5) and k.ci_high == pytest.approx(0.5)
    assert k.baseline == pytest.approx(2000.0) and k.candidate == pytest.approx(1000.0)
    m.cpu["candidate"].pop(2)  # a round without the candidate's accounting pairs with nothing
    k = _cpu_kpi(m)
    assert k is not None and len(k.rounds) == 2 and k.baseline == pytest.approx(2100.0)


def test_the_plot_shows_each_slices_interval(tmp_path: Path) -> None:
    from skupin.ab.annex import plot_annex
    from tests.unit.test_runtime_ab import _record

    base_runs = [_round({(64, 1): 100, (64, 4): 100, (256, 1): 100, (256, 4): 100}) for _ in range(3)]
    cand_runs = [_round({(64, 1): 150, (64, 4): 150, (256, 1): 140, (256, 4): 60 + r}) for r in range(3)]
    record = _record().model_copy(update={"slices": slice_decisions(candidate=cand_runs, baseline=base_runs,
                                                            prompt_lengths=(64, 256))})
    assert plot_annex(record, tmp_path / "annex.png") and (tmp_path / "annex.png").stat().st_size > 10_000


def test_rounds_are_added_until_the_interval_is_tight_enough_or_the_budget_is_spent_and_say_why_they_stopped() -> None:
    from skupin.ab.decision import MAX_ROUNDS_S, ABSettings, interval_half_width, rounds_stop, stop_text

    fixed = ABSettings(runs=3)
    assert rounds_stop(settings=fixed, ratios=[0.9, 1.1], elapsed_s=0) is None
    assert rounds_stop(settings=fixed, ratios=[0.5, 1.5, 1.0], elapsed_s=0) == "runs"  # no target: exactly --runs
    target = ABSettings(runs=3, target_ci=0.05, max_runs=6, budget_s=100)
    noisy, quiet = [0.9, 1.1, 1.0], [1.00, 1.01, 1.005]
    assert (interval_half_width(quiet) or 1) < 0.05 < (interval_half_width(noisy) or 0)
    assert rounds_stop(settings=target, ratios=noisy, elapsed_s=10) is None
    assert rounds_stop(settings=target, ratios=quiet, elapsed_s=10) == "target_ci"
    assert rounds_stop(settings=target, ratios=quiet, elapsed_s=100) == "target_ci"  # met beats spent: the truer why
    assert rounds_stop(settings=target, ratios=noisy, elapsed_s=100) == "budget"
    assert rounds_stop(settings=target, ratios=noisy * 2, elapsed_s=10) == "max_runs"
    assert rounds_stop(settings=target, ratios=[float("nan")] * 3, elapsed_s=10) is None  # no interval yet
    # the cap holds whatever was asked, even before --runs; rounds that ended as asked at the cap ended as asked
    assert rounds_stop(settings=fixed, ratios=[1.0], elapsed_s=MAX_ROUNDS_S) == "cap"
    assert rounds_stop(settings=fixed, ratios=[1.0] * 3, elapsed_s=MAX_ROUNDS_S) == "runs"
    assert rounds_stop(settings=target, ratios=noisy, elapsed_s=MAX_ROUNDS_S) == "budget"
    assert "11 h" in stop_text("cap", fixed, 1) and "before what was asked" in stop_text("cap", fixed, 1)
    assert "--budget-s 100 s" in stop_text("budget", target, 4) and "+-5%" in stop_text("budget", target, 4)
    assert "--max-runs 6" in stop_text("max_runs", target, 6)
    assert stop_text("runs", fixed, 3) == "3 rounds, as asked by --runs 3"
    assert "a side that failed" in stop_text("failed", fixed, 2)


def test_the_committed_transformers_to_vllm_rounds_are_now_a_trade_off_not_a_promote() -> None:
    """docs/examples/ab-cpu-x86_64-vs-cpu-x86_64-vllm (3 rounds, decided 'promote' before issue 33): with three rounds a
    level's min, median and max decode ratio are its three per-round ratios, so each slice's interval can be rebuilt.
    256-token prompts at concurrency 4 (0.557, 0.606, 0.767) is worse beyond its interval: the promote becomes a
    trade-off naming that slice."""
    from skupin.ab.decision import KPI, SliceAB

    doc = json.loads((Path(__file__).resolve().parents[2] / "docs" / "examples" / "ab-cpu-x86_64-vs-cpu-x86_64-vllm"
                      / "ab.json").read_text())
    assert doc["decision_line"] == "promote" and len(doc["order"]) == 3
    per_slice = []
    for length in doc["lengths"]:
        for lv in length["ab"]["levels"]:
            rounds = (lv["decode_ratio_min"], lv["decode_ratio"], lv["decode_ratio_max"])
            ci = ratio_interval(rounds)
            assert ci is not None
            move = "worse" if ci[1] < 1 else "better" if ci[0] > 1 else "same"
            per_slice.append(SliceAB(prompt_tokens=length["prompt_tokens"], concurrency=lv["concurrency"], kpi="decode",
                                     ratio=lv["decode_ratio"], rounds=rounds, ci_low=ci[0], ci_high=ci[1], move=move))
    worse = [s for s in per_slice if s.move == "worse"]
    assert [(s.prompt_tokens, s.concurrency) for s in worse] == [(256, 4)]
    assert worse[0].ci_high == pytest.approx(0.961, abs=1e-3)
    kpis = {k["name"]: KPI.model_validate(k) for k in doc["kpis"]}
    decision, line, _ = decide(candidate_gate="pass", candidate_failure="", baseline_gate="pass", baseline_failure="",
                               decode=kpis["decode"], prefill=kpis["prefill"], aggregate=kpis["aggregate"],
                               floor=doc["noise_floor"], agreement=doc["output_agreement"], slices=per_slice)
    assert decision == "hold" and "slices 256 tok x c4 worse" in line
