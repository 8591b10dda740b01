"""Measure an engine server's speed: TTFT, prefill and decode tok/s per concurrency level, spreads, cost per 1M output tokens.

Method (``run_perf``): a few warm-up requests (not measured), then for each concurrency level c
and each repetition, c closed-loop users share `requests` streamed greedy completions of
`max_tokens` tokens over a fixed prompt subset. Output tokens are the server's own count unless the caller gives
a host-side counter (``count_tokens``: the runtime A/B counts the streamed text with the model's tokenizer, never the
server's `usage`), and never more than `max_tokens`. Per request: TTFT = time from sending to the
first streamed token; prefill tok/s = prompt tokens / TTFT; decode tok/s = (output tokens - 1) /
(time of the last token - time of the first). Per repetition: aggregate tok/s = all output tokens
/ the repetition's wall time. A level reports medians over requests (TTFT p50/p99 by linear
interpolation), the median aggregate over repetitions and its spread ((max - min) / median).
Cost per 1M output tokens = hourly_usd / (aggregate tok/s x 3600 x utilisation) x 1e6, at the
level with the highest aggregate tok/s; the rate and the utilisation are shown with it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from skupin.clients.openai import Completion, ServeClient
from skupin.common.model import Frozen


class PerfSettings(Frozen):
    """How much load to generate."""

    concurrency: tuple[int, ...] = Field((1, 2, 4), min_length=1)
    requests: int = Field(8, ge=1, description="Measured requests per level and repetition")
    repetitions: int = Field(3, ge=1)
    warmup: int = Field(2, ge=0, description="Unmeasured requests before the first level")
    max_tokens: int = Field(32, ge=2)
    prompts: int = Field(8, ge=1, description="How many reference prompts the load cycles through")


@dataclass(frozen=True)
class Sample:
    """One measured request."""

    ttft_s: float
    prompt_tokens: int
    output_tokens: int
    decode_s: float


class LevelResult(Frozen):
    """One concurrency level over all repetitions."""

    concurrency: int
    repetitions: int
    requests: int
    output_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    prefill_tok_s: float = Field(description="Median over requests of prompt tokens / TTFT")
    decode_tok_s_per_request: float = Field(description="Median over requests of (tokens - 1) / decode time")
    aggregate_tok_s: float = Field(description="Median over repetitions of output tokens / wall time")
    aggregate_tok_s_reps: tuple[float, ...]
    spread: float = Field(description="(max - min) / median of aggregate tok/s over repetitions")
    ttft_s: tuple[float, ...] = Field(description="Every request's TTFT (for merging and plots)")
    decode_tok_s: tuple[float, ...] = Field(description="Every request's decode tok/s")


class PerfResult(Frozen):
    """A full load run."""

    settings: PerfSettings
    levels: tuple[LevelResult, ...]
    wall_s: float

    def headline(self) -> LevelResult:
        """The level with the highest aggregate tok/s (the one an operator would run at)."""
        return max(self.levels, key=lambda lv: lv.aggregate_tok_s)

    def level(self, concurrency: int) -> LevelResult | None:
        return next((lv for lv in self.levels if lv.concurrency == concurrency), None)


class CostSummary(Frozen):
    """Cost per 1M output tokens at the headline level, with its inputs."""

    hourly_usd: float
    utilisation: float
    concurrency: int
    aggregate_tok_s: float
    usd_per_1m_output_tokens: float
    formula: str = "hourly_usd / (aggregate_tok_s * 3600 * utilisation) * 1e6"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100, linear interpolation); NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def cost_per_million(*, hourly_usd: float, utilisation: float, tok_s: float) -> float:
    """USD per 1M output tokens for a device costing `hourly_usd`, busy `utilisation` of the time at `tok_s`."""
    if tok_s <= 0 or utilisation <= 0:
        return float("inf")
    return hourly_usd / (tok_s * 3600.0 * utilisation) * 1e6


def cost_summary(*, perf: PerfResult, hourly_usd: float | None, utilisation: float | None) -> CostSummary | None:
    """The cost at the headline level; None when the SKU states no hourly rate."""
    if hourly_usd is None:
        return None
    util = utilisation if utilisation is not None else 0.6
    head = perf.headline()
    return CostSummary(hourly_usd=hourly_usd, utilisation=util, concurrency=head.concurrency,
                       aggregate_tok_s=head.aggregate_tok_s,
                       usd_per_1m_output_tokens=cost_per_million(hourly_usd=hourly_usd, utilisation=util,
                                                                 tok_s=head.aggregate_tok_s))


TokenCounter = Callable[[str], int]


def tokenizer_counter(tokenizer: Any) -> TokenCounter:
    """Output tokens counted on the host: the streamed text encoded with the model's tokenizer (a tokenizers.Tokenizer),
    no special tokens. What the user received, whatever the server says in `usage`.

    A re-encoding is not the generated sequence: a model may emit a non-canonical split ('c', 'x') that encodes back as
    one token, or pieces that encode as more. Measured on the tiny-llama fixture's greedy continuations (96 prompts of 16,
    64 and 256 tokens, 4 to 64 output tokens): the host count was below the generated count for 1 prompt of 96, by at
    most 6 tokens (its continuation repeats two-letter pieces the tokenizer merges back), and often above it
    (capped at max_tokens): see HOST_COUNT_SLACK in skupin/ab/decision.py."""

    @functools.lru_cache(maxsize=256)  # each completion is counted twice: by the A/B's record, then by sample_of
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids) if text else 0

    return count


def sample_of(completion: Completion, max_tokens: int | None = None,
              count_tokens: TokenCounter | None = None) -> Sample | None:
    """A Sample from a serve.Completion; None when nothing was streamed. The output tokens are `count_tokens` of the
    streamed text when given (the host's count), else the server's own count (usage.completion_tokens, else the streamed
    pieces); never more than the `max_tokens` the request asked for: a server that claims more cannot inflate its
    tok/s, and one that streams less than it claims is credited with what it streamed."""
    if completion.ttft_s is None or not completion.piece_times:
        return None
    n = count_tokens(completion.text) if count_tokens is not None else completion.n_tokens
    n = n if max_tokens is None else min(n, max_tokens)
    decode_s = completion.piece_times[-1] - completion.piece_times[0]
    return Sample(ttft_s=completion.ttft_s, prompt_tokens=int(completion.prompt_tokens or 0), output_tokens=n,
                  decode_s=decode_s)


def summarize_level(*, concurrency: int, reps: Sequence[tuple[Sequence[Sample], float]]) -> LevelResult:
    """A LevelResult from each repetition's (samples, wall seconds)."""
    samples = [s for rep, _ in reps for s in rep]
    ttft = [s.ttft_s for s in samples]
    prefill = [s.prompt_tokens / s.ttft_s for s in samples if s.ttft_s > 0 and s.prompt_tokens]
    decode = [(s.output_tokens - 1) / s.decode_s for s in samples if s.output_tokens > 1 and s.decode_s > 0]
    aggregate = [sum(s.output_tokens for s in rep) / wall for rep, wall in reps if wall > 0]
    med = float(np.median(aggregate)) if aggregate else 0.0
    return LevelResult(
        concurrency=concurrency, repetitions=len(reps), requests=len(samples),
        output_tokens=sum(s.output_tokens for s in samples), ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99), prefill_tok_s=float(np.median(prefill)) if prefill else 0.0,
        decode_tok_s_per_request=float(np.median(decode)) if decode else 0.0, aggregate_tok_s=med,
        aggregate_tok_s_reps=tuple(round(a, 3) for a in aggregate),
        spread=(max(aggregate) - min(aggregate)) / med if med > 0 and len(aggregate) > 1 else 0.0,
        ttft_s=tuple(round(t, 6) for t in ttft), decode_tok_s=tuple(round(d, 3) for d in decode))


def merge_levels(levels: Sequence[LevelResult]) -> LevelResult:
    """One LevelResult from several of the same concurrency (e.g. the rounds of an A/B)."""
    reps = [a for lv in levels for a in lv.aggregate_tok_s_reps]
    ttft = [t for lv in levels for t in lv.ttft_s]
    decode = [d for lv in levels for d in lv.decode_tok_s]
    med = float(np.median(reps)) if reps else 0.0
    return LevelResult(
        concurrency=levels[0].concurrency, repetitions=sum(lv.repetitions for lv in levels),
        requests=sum(lv.requests for lv in levels), output_tokens=sum(lv.output_tokens for lv in levels),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        prefill_tok_s=float(np.median([lv.prefill_tok_s for lv in levels])),
        decode_tok_s_per_request=float(np.median(decode)) if decode else 0.0, aggregate_tok_s=med,
        aggregate_tok_s_reps=tuple(reps), spread=(max(reps) - min(reps)) / med if med > 0 and len(reps) > 1 else 0.0,
        ttft_s=tuple(ttft), decode_tok_s=tuple(decode))


def merge_perf(results: Sequence[PerfResult]) -> PerfResult:
    """All runs' levels merged per concurrency."""
    levels = []
    for lv in results[0].levels:
        same = [r.level(lv.concurrency) for r in results]
        levels.append(merge_levels([s for s in same if s is not None]))
    settings = results[0].settings.model_copy(update={"repetitions": sum(r.settings.repetitions for r in results)})
    return PerfResult(settings=settings, levels=tuple(levels), wall_s=sum(r.wall_s for r in results))


def measure_level(*, client: ServeClient, prompts: Sequence[str | list[int]], concurrency: int, requests: int, max_tokens: int,
                  on_completion: Callable[[int, Any], None] | None = None,
                  prompt_tokens: Sequence[int] | None = None,
                  count_tokens: TokenCounter | None = None) -> tuple[list[Sample], float]:
    """`requests` completions shared by `concurrency` closed-loop users; (samples, wall seconds). `on_completion`
    gets (prompt index, Completion) of every request, also those that streamed nothing. `prompt_tokens` (per prompt,
    counted by the host) replaces the server's own prompt count in prefill tok/s; `count_tokens` (sample_of) its
    output count."""
    jobs = iter([(i % len(prompts), prompts[i % len(prompts)]) for i in range(requests)])
    lock = threading.Lock()

    def user(http: Any) -> list[Sample]:  # the worker's HTTP client (skupin/clients/openai.py)
        mine: list[Sample] = []
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return mine
            index, prompt = job
            completion = client.complete(http, prompt=prompt, max_tokens=max_tokens)
            if on_completion is not None:
                on_completion(index, completion)
            sample = sample_of(completion, max_tokens, count_tokens)
            if sample is not None and prompt_tokens is not None:
                sample = dataclasses.replace(sample, prompt_tokens=int(prompt_tokens[index]))
            if sample is not None:
                mine.append(sample)

    start = time.perf_counter()
    futures = [client.submit(user) for _ in range(concurrency)]
    samples = [s for f in futures for s in f.result()]
    return samples, time.perf_counter() - start


def run_perf(*, client: ServeClient, prompts: Sequence[str | list[int]], settings: PerfSettings,
             on_completion: Callable[[int, Any], None] | None = None,
             prompt_tokens: Sequence[int] | None = None, count_tokens: TokenCounter | None = None) -> PerfResult:
    """Warm up, then measure every concurrency level `repetitions` times (see the module docstring)."""
    start = time.perf_counter()
    if max(settings.concurrency) > 0 and settings.warmup:
        measure_level(client=client, prompts=prompts, concurrency=1, requests=settings.warmup,
                      max_tokens=settings.max_tokens)
    levels = []
    for c in settings.concurrency:
        reps = [measure_level(client=client, prompts=prompts, concurrency=c, requests=max(settings.requests, c),
                              max_tokens=settings.max_tokens, on_completion=on_completion,
                              prompt_tokens=prompt_tokens, count_tokens=count_tokens)
                for _ in range(settings.repetitions)]
        levels.append(summarize_level(concurrency=c, reps=reps))
    return PerfResult(settings=settings, levels=tuple(levels), wall_s=round(time.perf_counter() - start, 3))


__all__ = ["PerfSettings", "Sample", "LevelResult", "PerfResult", "CostSummary", "percentile", "cost_per_million",
           "cost_summary", "TokenCounter", "tokenizer_counter",
           "sample_of", "summarize_level", "merge_levels", "merge_perf", "measure_level", "run_perf"]
