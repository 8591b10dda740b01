"""The probe's transformers adapter (the reference path: every committed H200 bundle was captured through it).

Teacher-forced forward passes through the decoder and lm_head in batches (ragged batches left-padded with an
attention mask), greedy continuations with the KV cache. An Adapter of the probe (skupin_probe.py): the
standard library at import, torch and transformers inside `run`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .skupin_probe import Array, Collector, Options

NEEDS_TORCH = True


def torch_dtype(name: str) -> Any:
    """The torch dtype named `name` (--dtype)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _chunks(items: list[list[int]], size: int) -> Iterator[tuple[int, list[list[int]]]]:
    for i in range(0, len(items), size):
        yield i, items[i : i + size]


def run(model_dir: str, ids: list[list[int]], opts: Options, device: str, col: Collector) -> dict[str, Any]:
    """Teacher-forced logprobs, final hidden states and greedy continuations through transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(opts["dtype"]),
                                                 attn_implementation=opts["attn"])
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type `.to` through a decorator
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.inference_mode():
        teacher_forced(model, ids, batch_size=opts["batch_size"], device=device, col=col)
        forward_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        for _, batch in _chunks(ids, opts["batch_size"]):
            if len({len(p) for p in batch}) == 1:
                _greedy(model, torch.tensor(batch, dtype=torch.long, device=device), opts["new_tokens"],
                                     col)
            else:  # ragged prompts decode one by one (a left-padded decode would shift their positions)
                for prompt in batch:
                    _greedy(model, torch.tensor([prompt], dtype=torch.long, device=device),
                                         opts["new_tokens"], col)
        generate_s = time.perf_counter() - t2
    info = {
        "attn_implementation": getattr(model.config, "_attn_implementation", opts["attn"]),
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "hidden_states": "decoder last_hidden_state (after final norm)",
        "greedy": "KV-cache decode, argmax, EOS not special",
        "load_s": load_s,
        "forward_s": forward_s,
        "generate_s": generate_s,
    }
    return info


def teacher_forced(model: Any, ids: list[list[int]], *, batch_size: int, device: str, col: Collector) -> None:
    """Teacher-forced forward passes in batches of `batch_size` prompts. A batch of ragged prompts is left-padded
    with id 0, as generation batches are, with an attention mask over the padding and position ids counted from each
    prompt's first real token: the mask is what keeps every prompt's numbers its own, so a kernel that ignores it
    shows. Each prompt keeps only its own positions."""
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for start, batch in _chunks(ids, batch_size):
        lengths = [len(p) for p in batch]
        longest = max(lengths)
        x = torch.tensor([[0] * (longest - len(p)) + p for p in batch], dtype=torch.long, device=device)
        if len(set(lengths)) == 1:
            hidden = decoder(input_ids=x).last_hidden_state
        else:
            mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            hidden = decoder(input_ids=x, attention_mask=mask, position_ids=positions).last_hidden_state
        logprobs = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)
        _collect_teacher(col, start, x, logprobs[:, :-1], hidden, lengths=lengths)


def _collect_teacher(col: Collector, start: int, x: Array, pred_logprobs: Array, hidden: Array | None,
                     lengths: list[int] | None = None) -> None:
    """Store target logprobs, top-k and (first prompts) full logprobs of positions 0..T-2 (with `lengths`, of each
    left-padded row's own last lengths[row] positions only)."""
    import torch

    target = pred_logprobs.gather(-1, x[:, 1:, None])[..., 0]
    top = pred_logprobs.topk(col.top_k, dim=-1)
    for row in range(x.shape[0]):
        pad = 0 if lengths is None else x.shape[1] - lengths[row]
        col.add("target_logprob", target[row, pad:].cpu())
        col.add("topk_logprobs", top.values[row, pad:].cpu())
        col.add("topk_ids", top.indices[row, pad:].to(torch.int32).cpu())
        if hidden is not None:
            col.add("hidden", hidden[row, pad:].cpu())
        if start + row < col.n_full:
            col.add("logprobs_full", pred_logprobs[row, pad:].cpu())


def _greedy(model: Any, x: Array, new_tokens: int, col: Collector) -> None:
    import inspect

    import torch

    # transformers >= 5.2x names the KV cache `cache`; earlier releases `past_key_values`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=x, use_cache=True)
    step_logits, past = out.logits[:, -1], getattr(out, key)
    picked, chosen, margins = [], [], []
    for step in range(new_tokens):
        top = torch.log_softmax(step_logits.float(), dim=-1).topk(2, dim=-1)
        nxt = top.indices[:, 0]
        picked.append(nxt)
        chosen.append(top.values[:, 0])
        margins.append(top.values[:, 0] - top.values[:, 1])
        if step + 1 < new_tokens:
            out = model(input_ids=nxt[:, None], use_cache=True, **{key: past})
            step_logits, past = out.logits[:, -1], getattr(out, key)
    ids, lps, mgs = (torch.stack(v, dim=1) for v in (picked, chosen, margins))
    for row in range(x.shape[0]):
        col.add("greedy_ids", ids[row].to(torch.int32).cpu())
        col.add("greedy_logprob", lps[row].cpu())
        col.add("greedy_margin", mgs[row].cpu())


# ---------------------------------------------------------------- the op battery (skupin_probe_ops.py)


def op_battery(model_dir: str, opts: Options, device: str, spec: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The model's own modules for each op on its path, fed the battery's inputs: (op -> implementation, op of the
    path not reached -> why). The modules come from the model's modeling file (transformers.models.<type>), built
    from its config with the battery's sizes (`spec`: the skupin_probe_ops module); the attention function is the
    one the model runs (opts["attn"])."""
    import importlib

    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(model_dir)
    kind = base.model_type
    modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    prefix = next(n[: -len("RMSNorm")] for n in dir(modeling) if n.endswith("RMSNorm") and not n.startswith("_"))

    def config(**sizes: Any) -> Any:
        """The model's config with the battery's sizes (and its rotary base)."""
        c = AutoConfig.from_pretrained(model_dir)
        for key, value in {"num_attention_heads": spec.NH, "num_key_value_heads": spec.NKV, "head_dim": spec.HD,
                           "rms_norm_eps": spec.EPS, "max_position_embeddings": 8192, **sizes}.items():
            setattr(c, key, value)
        if hasattr(c, "rope_parameters"):
            c.rope_parameters = {**(c.rope_parameters or {}), "rope_type": "default", "rope_theta": spec.THETA}
        else:
            c.rope_theta = spec.THETA
        return c

    impls = _dense_ops(modeling, prefix, base, config, device, opts["attn"], spec)
    uncovered: dict[str, str] = {}
    if getattr(base, "num_local_experts", 0):
        block_cls = getattr(modeling, prefix + "SparseMoeBlock", None)
        if block_cls is None:
            uncovered["moe.block"] = uncovered["moe.route"] = f"{kind} has no {prefix}SparseMoeBlock"
        else:
            impls.update(_moe_ops(block_cls, config, device, spec))
    return impls, uncovered


def _dense_ops(modeling: Any, prefix: str, base: Any, config: Any, device: str, attn: str, spec: Any) -> dict[str, Any]:
    """RMSNorm, the MLP's gated activation, the rotary embedding, attention and the linear product, as the model's
    modeling file computes them."""
    import torch
    from transformers.activations import ACT2FN

    act = ACT2FN[base.hidden_act]

    def rmsnorm(x: dict[str, Any]) -> dict[str, Any]:
        norm = getattr(modeling, prefix + "RMSNorm")(x["x"].shape[-1], eps=spec.EPS).to(device=device,
                                                                                         dtype=x["x"].dtype)
        norm.weight.data.copy_(x["weight"])
        return {"out": norm(x["x"])}

    def silu_mul(x: dict[str, Any]) -> dict[str, Any]:  # the MLP's act_fn(gate_proj(x)) * up_proj(x)
        gate, up = x["x"].chunk(2, dim=-1)
        return {"out": act(gate) * up}

    def rope(x: dict[str, Any]) -> dict[str, Any]:
        rotary = getattr(modeling, prefix + "RotaryEmbedding")(config(hidden_size=spec.NH * spec.HD)).to(device)
        q, k = x["q"].transpose(0, 1)[None], x["k"].transpose(0, 1)[None]  # [1, heads, T, HD]
        cos, sin = rotary(q, x["positions"][None])
        q2, k2 = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        return {"q": q2[0].transpose(0, 1), "k": k2[0].transpose(0, 1)}

    def attention(x: dict[str, Any]) -> dict[str, Any]:
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = spec.NH // spec.NKV, True  # type: ignore[assignment]
        module.eval()
        q, k, v = x["q"][None], x["k"][None], x["v"][None]
        if attn == "eager":  # the model's additive causal mask (sdpa takes is_causal)
            t = q.shape[2]
            mask = (torch.full((t, t), torch.finfo(q.dtype).min, dtype=q.dtype, device=device).triu(1)[None, None]
                    if t > 1 else None)
            out, _ = modeling.eager_attention_forward(module, q, k, v, mask, scaling=spec.HD**-0.5)
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=spec.HD**-0.5)
        return {"out": out[0].transpose(0, 1)}  # [T, heads, HD] -> [heads, T, HD]

    def matmul(x: dict[str, Any]) -> dict[str, Any]:  # the model's projections are nn.Linear
        return {"out": torch.nn.functional.linear(x["x"], x["weight"])}

    return {"rmsnorm": rmsnorm, "silu_mul": silu_mul, "rope.short": rope, "rope.long": rope,
            "attention.prefill": attention, "attention.decode": attention, "matmul": matmul}


def _moe_ops(block_cls: Any, config: Any, device: str, spec: Any) -> dict[str, Any]:
    """The model's sparse MoE block: its router alone (moe.route) and the whole block (moe.block)."""
    import torch

    def block(hidden: int, dtype: Any) -> Any:
        c = config(hidden_size=hidden, intermediate_size=spec.IM, num_local_experts=spec.E,
                   num_experts_per_tok=spec.TOPK)
        return block_cls(c).to(device=device, dtype=dtype).eval()

    def route(x: dict[str, Any]) -> dict[str, Any]:  # the block's router with hidden = the logits and W = I
        b = block(spec.E, x["logits"].dtype)
        b.gate.weight.data.copy_(torch.eye(spec.E, dtype=x["logits"].dtype))
        _, weights, ids = b.gate(x["logits"])
        return {"weights": weights.to(x["logits"].dtype), "ids": ids.to(torch.int32)}

    def moe(x: dict[str, Any]) -> dict[str, Any]:
        b = block(spec.HM, x["x"].dtype)
        b.gate.weight.data.copy_(x["gate"])
        experts = b.experts
        if hasattr(experts, "gate_up_proj"):
            experts.gate_up_proj.data.copy_(torch.cat((x["w1"], x["w3"]), dim=1))
            experts.down_proj.data.copy_(x["w2"])
        else:  # older transformers: one module per expert
            for j, expert in enumerate(experts):
                expert.w1.weight.data.copy_(x["w1"][j])
                expert.w3.weight.data.copy_(x["w3"][j])
                expert.w2.weight.data.copy_(x["w2"][j])
        out = b(x["x"][None])
        return {"out": (out[0] if isinstance(out, tuple) else out)[0]}

    return {"moe.route": route, "moe.block": moe}


# ---------------------------------------------------------------- the module ops (skupin_probe_ops.py MODULE_OUTPUTS)


def module_ops(model_dir: str, opts: Options, device: str, spec: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The modules of the model as transformers loads it (at opts["dtype"], with the gate's attention), one
    implementation per key of spec.module_plan: (key -> implementation, key -> why it is not reached)."""
    import json
    import os

    import torch
    from transformers import AutoModelForCausalLM

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        plan = spec.module_plan(json.load(fh))
    dtype = torch_dtype(opts["dtype"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=opts["attn"])
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type `.to` through a decorator
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def table(x: Any, positions: Any) -> tuple[Any, Any]:
        return decoder.rotary_emb(x[None], positions[None])

    def rotary(x: dict[str, Any]) -> dict[str, Any]:
        cos, sin = table(torch.zeros(spec.LT, 1, dtype=dtype, device=device), x["positions"])
        return {"cos": cos[0], "sin": sin[0]}

    embedding = model.get_input_embeddings()
    impls: dict[str, Any] = {"embed": lambda x: {"out": embedding(x["ids"])}, "rotary": rotary,
                             "final_norm": _apply(decoder.norm), "lm_head": _apply(model.lm_head)}
    uncovered: dict[str, str] = {}
    for key, _ in plan:
        if key.startswith("layer."):
            _, index, part, *rest = key.split(".")
            found = _layer_module(decoder.layers[int(index)], part, rest, table)
            if isinstance(found, str):
                uncovered[key] = found
            else:
                impls[key] = found
    return impls, uncovered


def _layer_module(layer: Any, part: str, rest: list[str], table: Any) -> Any:
    """The implementation of one part of a decoder layer (input_norm, attention, post_norm, mlp, router, expert.<j>,
    moe), or why it cannot be reached (a string)."""
    import torch

    if part in ("input_norm", "post_norm"):
        return _apply(layer.input_layernorm if part == "input_norm" else layer.post_attention_layernorm)
    if part == "attention":
        def attention(x: dict[str, Any]) -> dict[str, Any]:
            h = x["x"]
            t = h.shape[0]
            mask = torch.full((t, t), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)[None, None]
            out = layer.self_attn(hidden_states=h[None], position_embeddings=table(h, x["positions"]), attention_mask=mask)
            return {"out": _first(out)[0]}
        return attention
    mlp = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
    if mlp is None:
        return f"the layer has no MLP module to call for {part}"
    if part == "mlp":
        return _apply(mlp)
    if part == "moe":
        return lambda x: {"out": _first(mlp(x["x"][None]))[0]}
    if part == "router":
        if isinstance(mlp.gate, torch.nn.Linear):
            return "this transformers routes inside the MoE block (no router module to call)"
        return lambda x: _routed(mlp.gate(x["x"]))
    if part == "expert":
        return _expert(mlp.experts, int(rest[0]))
    return f"no module for {part}"


def _apply(module: Any) -> Any:
    return lambda x: {"out": _first(module(x["x"]))}


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def _routed(out: Any) -> dict[str, Any]:
    import torch

    logits, weights, ids = out
    return {"logits": logits, "weights": weights.float(), "ids": ids.to(torch.int32)}


def _expert(experts: Any, j: int) -> Any:
    """Expert j of a MoE block on every token with routing weight 1: the fused experts module (transformers 5) called
    with every token routed to j, or the j-th expert module (older transformers)."""
    import torch

    def run(x: dict[str, Any]) -> dict[str, Any]:
        h = x["x"]
        if isinstance(experts, torch.nn.ModuleList):
            return {"out": experts[j](h)}
        index = torch.full((h.shape[0], 1), j, dtype=torch.long, device=h.device)
        return {"out": experts(h, index, torch.ones((h.shape[0], 1), dtype=torch.float32, device=h.device))}

    return run
