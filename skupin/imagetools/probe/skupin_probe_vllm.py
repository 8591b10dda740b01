"""The probe's vLLM adapter: prompt logprobs and greedy continuations through vLLM's offline LLM API, final hidden
states through its pooling runner.

An Adapter of the probe (skupin_probe.py): the standard library at import, torch and vllm inside `run`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .skupin_probe import Collector, Options

NEEDS_TORCH = True


def _hidden(model_dir: str, ids: list[list[int]], opts: Options, col: Collector) -> str:
    """Final hidden states of every prompt position through vLLM's own pooling runner, then the engine is shut down.

    The causal LM is loaded as a token-embedding model (runner "pooling", convert "embed") with ALL-token
    pooling and no activation (no normalisation): each output row is the decoder's last hidden state after
    the final norm, the same tensor the transformers adapter stores. This engine runs eagerly (same weights,
    loader and kernels; no graph compilation, which on a CPU costs about a minute per engine): the compiled
    graph the server runs is what the logprob statistics and the greedy check measure.
    """
    from vllm import LLM, PoolingParams
    from vllm.config import PoolerConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, tokenizer=model_dir, dtype=opts["dtype"], seed=0, runner="pooling", convert="embed",
              max_num_seqs=opts["batch_size"], max_model_len=max(map(len, ids)) + opts["new_tokens"] + 8, enforce_eager=True,
              pooler_config=PoolerConfig(task="token_embed", pooling_type="ALL", use_activation=False))
    try:
        outs = llm.encode([TokensPrompt(prompt_token_ids=p) for p in ids], pooling_task="token_embed",
                          pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        for prompt, out in zip(ids, outs, strict=True):
            hidden = out.outputs.data
            if tuple(hidden.shape[:1]) != (len(prompt),):
                raise RuntimeError(f"vLLM's pooling runner returned hidden states of shape {tuple(hidden.shape)} "
                                   f"for a prompt of {len(prompt)} tokens")
            col.add("hidden", hidden.float().cpu())
    finally:
        _shutdown(llm)
    return "vLLM pooling runner, eager: all tokens, no activation (decoder output after the final norm)"


def _shutdown(llm: Any) -> None:
    """Stop an offline vLLM engine's core process before the next one starts (its memory is reserved per engine)."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm, engine, core
    gc.collect()


def run(model_dir: str, ids: list[list[int]], opts: Options, device: str, col: Collector) -> dict[str, Any]:
    """The same outputs through vLLM's own engine: prompt logprobs (top-k and full vocabulary), greedy
    continuations with the offline LLM API, final hidden states with its pooling runner."""
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older vLLM
        TokensPrompt = dict
    vocab = opts["vocab"]
    t0 = time.perf_counter()
    hidden_how = _hidden(model_dir, ids, opts, col)
    hidden_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, tokenizer=model_dir, dtype=opts["dtype"], seed=0, max_num_seqs=opts["batch_size"],
              max_logprobs=max(opts["top_k"], vocab if opts["full_logprobs"] else 0, 2),
              max_model_len=max(map(len, ids)) + opts["new_tokens"] + 8, enforce_eager=opts["attn"] == "eager")
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    t1 = time.perf_counter()
    teacher = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=opts["top_k"]),
                           use_tqdm=False)
    full = (llm.generate(prompts[: opts["full_logprobs"]],
                         SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab), use_tqdm=False)
            if opts["full_logprobs"] else [])
    forward_s = time.perf_counter() - t1
    for i, (prompt, out) in enumerate(zip(ids, teacher, strict=True)):
        per_pos = [[(lp.logprob, tid) for tid, lp in d.items() if lp.rank <= opts["top_k"]] for d in out.prompt_logprobs[1:]]
        target = [d[prompt[t + 1]].logprob for t, d in enumerate(out.prompt_logprobs[1:])]
        dense = ([[(lp.logprob, tid) for tid, lp in d.items()] for d in full[i].prompt_logprobs[1:]]
                 if i < len(full) else None)
        col.engine_prompt(i, per_pos, target, dense, vocab)
    t2 = time.perf_counter()
    greedy = llm.generate(prompts, SamplingParams(max_tokens=opts["new_tokens"], temperature=0.0, logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)
    for out in greedy:
        seq = out.outputs[0]
        col.greedy(list(seq.token_ids), [[(lp.logprob, tid) for tid, lp in d.items()] for d in seq.logprobs])
    generate_s = time.perf_counter() - t2
    _shutdown(llm)
    info = {"attn_implementation": os.environ.get("VLLM_ATTENTION_BACKEND", "vllm-default"),
            "compiled": opts["attn"] != "eager", "hidden_states": hidden_how,
            "logprobs": f"vLLM prompt_logprobs: top-{opts['top_k']} for every prompt, the full vocabulary ({vocab}) "
                        f"for the first {opts['full_logprobs']}",
            "greedy": "vLLM temperature 0, ignore_eos", "load_s": load_s, "hidden_s": hidden_s,
            "forward_s": forward_s, "generate_s": generate_s}
    return info
