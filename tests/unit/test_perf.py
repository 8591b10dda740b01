"""Perf statistics, cost per token and the A/B decision without Docker (synthetic samples and a mock server)."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from skupin.gates.serving.ab import ab_from_runs, interleaved_ab, plot_serve, serve_markdown
from skupin.gates.serving.perf import (
    PerfResult,
    PerfSettings,
    Sample,
    cost_per_million,
    cost_summary,
    merge_perf,
    percentile,
    run_perf,
    summarize_level,
)
from skupin.gates.serving.serve import ServeClient


def level(c: int, tok_s: float, *, reps: int = 3, ttft: float = 0.01):
    """A synthetic level: `reps` repetitions of 4 requests of 32 tokens at `tok_s` decode each."""
    decode_s = 31 / tok_s
    rep = [Sample(ttft_s=ttft, prompt_tokens=64, output_tokens=32, decode_s=decode_s) for _ in range(4)]
    return summarize_level(concurrency=c, reps=[(rep, 4 * (ttft + decode_s) / c * (1 + 0.01 * r)) for r in range(reps)])


def perf(tok_s: float, levels=(1, 2, 4), reps: int = 1) -> PerfResult:
    return PerfResult(settings=PerfSettings(concurrency=levels, repetitions=reps),
                      levels=tuple(level(c, tok_s, reps=reps) for c in levels), wall_s=1.0)


def test_level_statistics_follow_their_definitions() -> None:
    a = [Sample(ttft_s=0.02, prompt_tokens=64, output_tokens=11, decode_s=0.1)] * 3
    b = [Sample(ttft_s=0.04, prompt_tokens=64, output_tokens=21, decode_s=0.1)] * 3
    lv = summarize_level(concurrency=2, reps=[(a, 1.0), (b, 2.0)])
    assert lv.requests == 6 and lv.output_tokens == 96
    assert lv.ttft_p50_s == pytest.approx(0.03) and 0.02 < lv.ttft_p99_s <= 0.04
    assert lv.prefill_tok_s == pytest.approx((64 / 0.02 + 64 / 0.04) / 2)
    assert lv.decode_tok_s_per_request == pytest.approx(150.0)  # median of 100 and 200
    assert lv.aggregate_tok_s_reps == (33.0, 31.5) and lv.aggregate_tok_s == pytest.approx(32.25)
    assert lv.spread == pytest.approx(1.5 / 32.25)


def test_percentile_and_cost() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))
    # $0.10/h at 100 tok/s, 60% busy: 0.1 / (100 * 3600 * 0.6) * 1e6
    assert cost_per_million(hourly_usd=0.10, utilisation=0.6, tok_s=100) == pytest.approx(0.46296, rel=1e-4)
    assert cost_per_million(hourly_usd=1, utilisation=0.6, tok_s=0) == math.inf
    p = perf(100.0)
    cost = cost_summary(perf=p, hourly_usd=3.8, utilisation=0.5)
    assert cost.concurrency == p.headline().concurrency == 4
    assert cost.usd_per_1m_output_tokens == pytest.approx(3.8 / (p.headline().aggregate_tok_s * 1800) * 1e6)
    assert cost_summary(perf=p, hourly_usd=None, utilisation=None) is None


def test_merge_keeps_every_repetition() -> None:
    merged = merge_perf([perf(100.0), perf(120.0)])
    assert merged.settings.repetitions == 2
    assert all(len(lv.aggregate_tok_s_reps) == 2 and lv.requests == 8 for lv in merged.levels)


def test_ab_of_equal_runs_is_near_one_and_a_slow_candidate_fails_the_bound() -> None:
    same = ab_from_runs(candidate_runs=[perf(100.0), perf(101.0), perf(99.0)],
                        baseline_runs=[perf(100.0), perf(100.0), perf(100.0)], bound=0.1, candidate_image="a",
                        baseline_image="b", order=["BA", "AB", "BA"])
    assert same.status == "pass" and same.decode_ratio == pytest.approx(1.0, abs=0.011)
    assert same.decode_ratio_spread[0] < 1.0 < same.decode_ratio_spread[1] and len(same.levels) == 3
    slow = ab_from_runs(candidate_runs=[perf(70.0)] * 3, baseline_runs=[perf(100.0)] * 3, bound=0.1,
                        candidate_image="a", baseline_image="b", order=["BA", "AB", "BA"])
    assert slow.status == "fail" and slow.decode_ratio == pytest.approx(0.7, rel=1e-6) and "below the bound" in slow.summary
    noisy = ab_from_runs(candidate_runs=[perf(70.0), perf(85.0), perf(105.0)], baseline_runs=[perf(100.0)] * 3,
                         bound=0.1, candidate_image="a", baseline_image="b", order=["BA", "AB", "BA"])
    assert noisy.status == "pass" and "inconclusive" in noisy.summary and noisy.decode_ratio < 0.9
    unbound = ab_from_runs(candidate_runs=[perf(70.0)], baseline_runs=[perf(100.0)], bound=None, candidate_image="a",
                           baseline_image="b", order=["BA"])
    assert unbound.status == "report" and "no regression bound" in unbound.summary


def test_interleaving_alternates_which_image_goes_first() -> None:
    calls: list[str] = []

    def runner(name: str, tok_s: float):
        def run(settings: PerfSettings) -> PerfResult:
            calls.append(name)
            assert settings.repetitions == 1
            return perf(tok_s, levels=settings.concurrency)
        return run

    ab = interleaved_ab(candidate=runner("A", 90.0), baseline=runner("B", 100.0), settings=PerfSettings(concurrency=(1, 2)),
                        rounds=4, bound=0.05, candidate_image="a", baseline_image="b")
    assert calls == ["B", "A", "A", "B", "B", "A", "A", "B"] and ab.order == ("BA", "AB", "BA", "AB")
    assert ab.status == "fail" and ab.rounds == 4


def test_run_perf_against_a_mock_server() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        events = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": body["max_tokens"]}})
        time.sleep(0.002)
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=iter([text.encode()]))  # streamed, as a real server's body is

    settings = PerfSettings(concurrency=(1, 2), requests=3, repetitions=2, warmup=1, max_tokens=4, prompts=2)
    with ServeClient(base_url="http://x", model_id="m", transport=httpx.MockTransport(handler), workers=2) as client:
        result = run_perf(client=client, prompts=["a", "b"], settings=settings)
    assert [lv.concurrency for lv in result.levels] == [1, 2]
    for lv in result.levels:
        assert lv.requests == 6 and lv.output_tokens == 24 and lv.repetitions == 2 and lv.aggregate_tok_s > 0


def test_report_pieces(tmp_path) -> None:
    ab = ab_from_runs(candidate_runs=[perf(90.0)], baseline_runs=[perf(100.0)], bound=0.2, candidate_image="a",
                      baseline_image="b", order=["BA"])
    details = {"launch": ["transformers", "serve"], "ready_s": 5.0, "logprobs": "not provided by engine",
               "greedy": {"match": 64, "prompts": 64, "near_tie": 0, "diverged": 0, "near_tie_threshold": 2e-5,
                          "near_tie_threshold_source": "src", "compared_by": ["pieces"]},
               "perf": ab.candidate.model_dump(mode="json"), "ab": ab.model_dump(mode="json"),
               "cost": cost_summary(perf=ab.candidate, hourly_usd=0.1, utilisation=0.6).model_dump(mode="json")}
    text = "\n".join(serve_markdown(details, plot_name="serve.png"))
    assert "not provided by engine" in text and "per 1M output tokens" in text and "0.900" in text
    assert plot_serve(details, tmp_path / "serve.png") and (tmp_path / "serve.png").stat().st_size > 1000
    assert not plot_serve({}, tmp_path / "none.png")
