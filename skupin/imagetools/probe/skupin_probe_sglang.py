"""The probe's SGLang adapter: prompt logprobs, final hidden states and greedy continuations through SGLang's offline
Engine (checked against sglang 0.5.23's source).

An Adapter of the probe (skupin_probe.py): the standard library at import, torch and sglang inside `run`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .skupin_probe import Array, Collector, Entries, Options

NEEDS_TORCH = True


def _hidden(meta: dict[str, Any], prompt: list[int]) -> Array:
    """One prompt's final hidden states, [T, H] float32, from SGLang's meta_info["hidden_states"].

    SGLang 0.5.23 returns a list whose first entry is the prefill block (one row per prompt position
    the prefill computed) and then one row per decode step (managers/scheduler_components/
    batch_result_processor.py: _append_prefill_hidden_states, _append_decode_hidden_states). The
    teacher-forced pass generates one token, so there is no decode row, and it asks for logprobs from
    position 0, which keeps the radix cache from serving any of the prompt (schedule_batch.py:
    _compute_max_prefix_len): the block covers every position. Anything else is an error, not a guess.
    """
    import torch

    rows: list[list[float]] = []
    for block in meta.get("hidden_states") or []:
        rows.extend(block if block and isinstance(block[0], list) else [block])
    if len(rows) != len(prompt) or len({len(r) for r in rows}) != 1:
        raise RuntimeError(f"SGLang returned hidden states for {len(rows)} positions of a {len(prompt)}-token prompt")
    return torch.tensor(rows, dtype=torch.float32)


def _prompt_logprobs(meta: dict[str, Any], prompt: list[int], key: str) -> list[Entries]:
    """Positions 0..T-2 of an SGLang input logprob list (`input_top_logprobs`), as (logprob, token id) pairs.

    With logprob_start_len=0 entry t is the distribution that predicted prompt token t, entry 0 is None
    (scheduler_components/logprob_result_processor.py: _process_input_top_logprobs prepends None and drops
    the row of the sampled token); items are (logprob, token id, text or None).
    """
    rows = meta[key]
    if len(rows) != len(prompt) or rows[0] is not None:
        raise RuntimeError(f"SGLang's {key} has {len(rows)} rows for a {len(prompt)}-token prompt (logprob_start_len "
                           "0 gives one per token, the first None)")
    return [[(float(e[0]), int(e[1])) for e in pos] for pos in rows[1:]]


def _target(meta: dict[str, Any], prompt: list[int]) -> list[float]:
    """The logprob of each prompt token 1..T-1 given its prefix (SGLang's input_token_logprobs, entry 0 None)."""
    rows = meta["input_token_logprobs"]
    if len(rows) != len(prompt) or rows[0][0] is not None:
        raise RuntimeError(f"SGLang's input_token_logprobs has {len(rows)} rows for a {len(prompt)}-token prompt")
    # the ids are not compared with the prompt: SGLang reports an id >= vocab_size - 1 as 0 there
    return [float(e[0]) for e in rows[1:]]


def run(model_dir: str, ids: list[list[int]], opts: Options, device: str, col: Collector) -> dict[str, Any]:
    """The same outputs through SGLang's offline Engine (checked against sglang 0.5.23's source): prompt logprobs
    (top-k, and the full vocabulary for the first prompts) and final hidden states from one teacher-forced pass,
    greedy continuations with the chosen token's logprob and the top-2 margin.

    Hidden states: the engine is started with return_hidden_states_mode="full" (the server flag
    --return-hidden-states-mode; without it a request asking for them is refused) and the top-k pass asks
    return_hidden_states=True. The rows are the tensor the model hands its LogitsProcessor
    (layers/logits_processor.py: _get_hidden_states_to_store, FULL mode), which for LlamaForCausalLM
    (models/llama.py) is LlamaModel's output after the final RMSNorm: the decoder's last hidden state, as the
    transformers adapter stores it. (Models that pass hidden_states_before_norm, none of the Llama family,
    would return the pre-norm state instead.) Capturing them keeps a tensor the forward pass computes anyway; the
    logits and the decode graphs are the same.
    """
    import sglang

    vocab = opts["vocab"]
    t0 = time.perf_counter()
    engine = sglang.Engine(model_path=model_dir, dtype=opts["dtype"], random_seed=0,
                           max_running_requests=opts["batch_size"], log_level="error",
                           return_hidden_states_mode="full")
    load_s = time.perf_counter() - t0

    def teacher(prompts: list[list[int]], k: int, hidden: bool) -> list[dict[str, Any]]:
        # logprob_start_len=0: input logprobs from the first prompt token on (default -1: output tokens only)
        return engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               return_logprob=True, logprob_start_len=0, top_logprobs_num=k,
                               return_hidden_states=hidden)

    try:
        t1 = time.perf_counter()
        outs = teacher(ids, opts["top_k"], True)
        full = teacher(ids[: opts["full_logprobs"]], vocab, False) if opts["full_logprobs"] else []
        forward_s = time.perf_counter() - t1
        for i, (prompt, out) in enumerate(zip(ids, outs, strict=True)):
            meta = out["meta_info"]
            dense = (_prompt_logprobs(full[i]["meta_info"], prompt, "input_top_logprobs")
                     if i < len(full) else None)
            col.engine_prompt(i, _prompt_logprobs(meta, prompt, "input_top_logprobs"), _target(meta, prompt), dense,
                              vocab)
            col.add("hidden", _hidden(meta, prompt))
        t2 = time.perf_counter()
        greedy = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": opts["new_tokens"],
                                                                 "temperature": 0.0, "ignore_eos": True},
                                 return_logprob=True, top_logprobs_num=2)
        for out in greedy:
            tokens, steps = [int(t) for t in out["output_ids"]], out["meta_info"]["output_top_logprobs"]
            if len(steps) != len(tokens):
                raise RuntimeError(f"SGLang returned top logprobs for {len(steps)} of {len(tokens)} generated tokens")
            col.greedy(tokens, [[(float(e[0]), int(e[1])) for e in pos] for pos in steps])
        generate_s = time.perf_counter() - t2
    finally:
        engine.shutdown()
    info = {"attn_implementation": "sglang-default",
            "hidden_states": "SGLang return_hidden_states on the teacher-forced pass: the model's output after "
                             "the final norm, every prompt position",
            "logprobs": f"SGLang input logprobs (logprob_start_len 0): top-{opts['top_k']} for every prompt, the "
                        f"full vocabulary ({vocab}) for the first {opts['full_logprobs']}",
            "greedy": "SGLang temperature 0, ignore_eos", "load_s": load_s, "forward_s": forward_s,
            "generate_s": generate_s}
    return info


# ---------------------------------------------------------------- the op battery (skupin_probe_ops.py)

SGLANG_UNREACHED = {
    "attention.prefill": "SGLang's attention backends run only inside a running engine's forward batch (radix KV "
                         "cache); checked end to end by the model check",
    "attention.decode": "SGLang's decode attention runs only inside a running engine's forward batch; checked end to "
                        "end by the model check",
    "moe.block": "SGLang's FusedMoE layer needs the engine's parallel and quantization config; checked end to end by "
                 "the model check",
}


def op_battery(model_dir: str, opts: Options, device: str, spec: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """SGLang's own layers (sglang.srt.layers: RMSNorm with and without the fused residual add, SiluAndMul, get_rope;
    their CUDA forms call the sgl_kernel package) for the ops it can run outside an engine. Each is built and run
    once on the battery's inputs before it is offered: one that cannot be is uncovered, with why (this adapter has
    not yet run on a GPU with SGLang installed)."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        moe = bool(json.load(fh).get("num_local_experts"))
    impls: dict[str, Any] = {}
    uncovered = {op: why for op, why in SGLANG_UNREACHED.items() if op != "moe.block" or moe}
    if moe:
        uncovered["moe.route"] = "SGLang's router (select_experts) needs its TopK config; checked by the model check"
    makers = {"rmsnorm": _sg_rmsnorm, "add_rmsnorm": _sg_rmsnorm, "silu_mul": _sg_silu_mul, "rope.short": _sg_rope,
              "rope.long": _sg_rope, "matmul": _sg_matmul}
    for op, make in makers.items():
        try:
            impl = make(device, spec)
            impl(spec.torch_inputs(op, opts["dtype"], device))  # smoke: it runs here, or it is uncovered
            impls[op] = impl
        except Exception as exc:
            uncovered[op] = f"could not run outside an engine: {type(exc).__name__}: {exc}"[:300]
    return impls, uncovered


def _sg_rmsnorm(device: str, spec: Any) -> Any:
    from sglang.srt.layers.layernorm import RMSNorm

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = RMSNorm(x["x"].shape[-1], eps=spec.EPS).to(device=device, dtype=x["x"].dtype)
        layer.weight.data.copy_(x["weight"])
        if "residual" in x:
            out, residual = layer(x["x"].clone(), x["residual"].clone())
            return {"out": out, "residual": residual}
        return {"out": layer(x["x"].clone())}

    return run


def _sg_silu_mul(device: str, spec: Any) -> Any:
    from sglang.srt.layers.activation import SiluAndMul

    layer = SiluAndMul()
    return lambda x: {"out": layer(x["x"])}


def _sg_rope(device: str, spec: Any) -> Any:
    from sglang.srt.layers.rotary_embedding import get_rope

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = get_rope(spec.HD, rotary_dim=spec.HD, max_position=8192, base=int(spec.THETA), is_neox_style=True,
                         dtype=x["q"].dtype).to(device)
        t = x["q"].shape[0]
        q, k = layer(x["positions"], x["q"].reshape(t, -1).clone(), x["k"].reshape(t, -1).clone())
        return {"q": q.reshape(x["q"].shape), "k": k.reshape(x["k"].shape)}

    return run


def _sg_matmul(device: str, spec: Any) -> Any:
    import torch

    # SGLang's unquantized linear method is torch's F.linear (UnquantizedLinearMethod.apply)
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod  # noqa: F401

    return lambda x: {"out": torch.nn.functional.linear(x["x"], x["weight"])}
