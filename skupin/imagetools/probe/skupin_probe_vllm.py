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


# ---------------------------------------------------------------- the op battery (skupin_probe_ops.py)

# The ops of a vLLM decoder's path the battery cannot call outside a running engine, and why.
UNREACHED = {
    "attention.prefill": "vLLM's attention backends run only inside a running engine's forward context (paged KV "
                         "cache, attention metadata); checked end to end by the model check",
    "attention.decode": "vLLM's paged decode attention runs only inside a running engine's forward context; checked "
                        "end to end by the model check",
    "moe.block": "vLLM's FusedMoE layer needs the engine's parallel and quantization config; checked end to end by "
                 "the model check",
}


def op_battery(model_dir: str, opts: Options, device: str, spec: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's own layers for each op on a decoder's path it can run outside an engine: RMSNorm (alone and with the
    fused residual add), SiluAndMul, its rotary embedding (get_rope, cache at the serving dtype as vLLM builds it),
    the router's fused_topk, the unquantized linear layer's GEMM. Built under a vLLM config whose compilation mode is
    the model check's (compiled unless --attn eager), so each CustomOp dispatches as it does in the engine: its own
    kernel or the native torch code its compiled graph is built from."""
    import json

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        moe = bool(json.load(fh).get("num_local_experts"))
    config = _vllm_config(eager=opts["attn"] == "eager")
    impls: dict[str, Any] = {}
    uncovered = {op: why for op, why in UNREACHED.items() if op != "moe.block" or moe}
    makers = {"rmsnorm": _rmsnorm, "add_rmsnorm": _rmsnorm, "silu_mul": _silu_mul, "rope.short": _rope,
              "rope.long": _rope, "matmul": _matmul, **({"moe.route": _route} if moe else {})}
    for op, make in makers.items():
        try:
            with _config_scope(config):
                impls[op] = _scoped(config, make(device, spec))
        except Exception as exc:  # a layer that cannot be built outside an engine is uncovered, with why
            uncovered[op] = f"could not be built outside an engine: {type(exc).__name__}: {exc}"[:300]
    return impls, uncovered


def _rmsnorm(device: str, spec: Any) -> Any:
    from vllm.model_executor.layers.layernorm import RMSNorm

    RMSNorm(8, eps=spec.EPS)  # importable and buildable here, or the op is uncovered

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = RMSNorm(x["x"].shape[-1], eps=spec.EPS).to(device=device, dtype=x["x"].dtype)
        layer.weight.data.copy_(x["weight"])
        if "residual" in x:
            out, residual = layer(x["x"].clone(), x["residual"].clone())
            return {"out": out, "residual": residual}
        return {"out": layer(x["x"].clone())}

    return run


def _silu_mul(device: str, spec: Any) -> Any:
    from vllm.model_executor.layers.activation import SiluAndMul

    layer = SiluAndMul()
    return lambda x: {"out": layer(x["x"])}


def _rope(device: str, spec: Any) -> Any:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = get_rope(spec.HD, 8192, is_neox_style=True, dtype=x["q"].dtype,
                         rope_parameters={"rope_theta": spec.THETA, "rope_type": "default"}).to(device)
        t = x["q"].shape[0]
        q, k = layer(x["positions"], x["q"].reshape(t, -1).clone(), x["k"].reshape(t, -1).clone())
        return {"q": q.reshape(x["q"].shape), "k": k.reshape(x["k"].shape)}

    return run


def _route(device: str, spec: Any) -> Any:
    """The router the platform's MoE experts use: CPURouter's select_experts on a CPU, fused_topk elsewhere."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts

        def topk(hidden: Any, logits: Any) -> Any:
            return select_experts(hidden, logits, spec.TOPK, use_grouped_topk=False, renormalize=True)
    else:
        from vllm.model_executor.layers.fused_moe import fused_topk

        def topk(hidden: Any, logits: Any) -> Any:
            return fused_topk(hidden, logits, spec.TOPK, True)

    def run(x: dict[str, Any]) -> dict[str, Any]:
        hidden = torch.zeros((x["logits"].shape[0], 8), dtype=x["logits"].dtype, device=device)
        weights, ids, *_ = topk(hidden, x["logits"])
        return {"weights": weights.to(x["logits"].dtype), "ids": ids.to(torch.int32)}

    return run


def _matmul(device: str, spec: Any) -> Any:
    """The unquantized linear layer's GEMM as the platform dispatches it (on a CPU: the layer's prepared cpu_linear)."""
    import torch
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    gemm = utils.dispatch_unquantized_gemm()

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(x["weight"].clone(), requires_grad=False)
        if current_platform.is_cpu():
            utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        return {"out": gemm(layer, x["x"], layer.weight, None)}

    return run


def _vllm_config(*, eager: bool) -> Any:
    """A vLLM config whose compilation mode is the model check's (None when this vLLM has no such config)."""
    try:
        from vllm.config import CompilationConfig, VllmConfig

        try:
            from vllm.config import CompilationMode

            compilation = CompilationConfig(mode=CompilationMode.NONE if eager else CompilationMode.VLLM_COMPILE)
        except ImportError:
            compilation = CompilationConfig()
        return VllmConfig(compilation_config=compilation)
    except Exception:
        return None


def _config_scope(config: Any) -> Any:
    import contextlib

    if config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


def _scoped(config: Any, impl: Any) -> Any:
    """`impl` run under the vLLM config (layers read it when they are built and when they run)."""
    def run(x: dict[str, Any]) -> Any:
        with _config_scope(config):
            return impl(x)

    return run
