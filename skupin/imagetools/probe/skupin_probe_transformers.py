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
