"""Swaps the detection benchmark applies in-process: the derived test images' quantizers plus partial and kernel swaps.

The weight quantizers (INT4 RTN g128, INT8 per-channel, FP8 e4m3 per-tensor, INT4 with nibbles
swapped in 5% of groups) and the SiLU patch are the very functions the gate's integration test
bakes into derived images (tests/integration/derived/swap.py, loaded here by path so there
is one copy of them). Added here: FP8 e4m3 per output channel, partial swaps (INT8 in one quarter
of the layers, INT8 in the last decoder layer only, INT4 in the MLP only), a softmax off by a small
factor, the attention scale off by 1% (the derived images' `attn-scale`), linear layers whose
products accumulate in bfloat16, a RoPE base changed by 2x, and for mixture-of-experts models one expert's
output 10% too large and top-1 instead of top-2 routing; for ragged prompt sets, the attention mask
dropped (left-padded prompts then attend to padding). Weight quantizers reach MoE experts too
(transformers 5 keeps them as 3-D `experts.*_proj` parameters, not nn.Linear). The faults of issue 29 are the
derived images' too, applied to one loaded model's modules instead of their classes: the bf16 path (rotary table
and RMSNorm in the model's dtype: `PRECISION_SWAPS`), the router without its float32 upcast and one INT4 expert;
added here, top-2 weights left unnormalised. Needs torch only (it also runs on the NVIDIA reference machine, which
has no skupin dependencies).

Weight swaps change a loaded model in place (`apply_weight_swap`); kernel swaps patch torch
functions for the duration of a ``with kernel_swap(name):`` block and restore them after.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import types
from pathlib import Path

DERIVED = Path(__file__).resolve().parents[2] / "tests" / "integration" / "derived" / "swap.py"
KERNEL_FACTOR = 1.0 + 2.0**-7


def _load_derived():
    """The derived images' swap module, imported by path with no swap installed (SKUPIN_TEST_SWAP unset)."""
    saved = os.environ.pop("SKUPIN_TEST_SWAP", None)
    try:
        spec = importlib.util.spec_from_file_location("skupin_derived_swaps", DERIVED)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is not None:
            os.environ["SKUPIN_TEST_SWAP"] = saved
    return module


derived = _load_derived()


def fp8_channel(w):
    """FP8 e4m3 with one scale per output channel (row)."""
    import torch

    scale = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
    return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


_LAYER = re.compile(r"\.layers\.(\d+)\.")
MLP = ("gate_proj", "up_proj", "down_proj")

# name -> (quantizer, which linear layers: "all" | "quarter" (every 4th decoder layer) | "last" (the last decoder
# layer) | "mlp")
WEIGHT_SWAPS = {
    "int4": (derived.int4, "all"),
    "int8": (derived.int8, "all"),
    "fp8-tensor": (derived.fp8, "all"),
    "fp8-channel": (fp8_channel, "all"),
    "int8-quarter": (derived.int8, "quarter"),
    "int8-last": (derived.int8, "last"),
    "int4-mlp": (derived.int4, "mlp"),
    "int4-nibble": (derived.int4_nibble, "all"),
}
# changes made to a loaded model (its modules' attributes), not to its weights
MODEL_SWAPS = ("attn-scale", "rope-base")
# faults in the precision of the serving dtype's own code path (issue 29): each computes what an honest kernel computes
# in float32 in the model's dtype instead, so a float32 run is unchanged by construction and only the bf16 check sees it
PRECISION_SWAPS = ("rope-table-bf16", "norm-no-upcast")
MOE_SWAPS = ("moe-expert-scale", "moe-top1", "moe-no-renorm", "router-no-upcast", "expert-int4-one")
RAGGED_SWAPS = ("pad-attended",)  # need a ragged prompt set: batches that pad
KERNEL_SWAPS = ("silu", "softmax", "accum-bf16")
SWAPS = (*WEIGHT_SWAPS, *MODEL_SWAPS, *KERNEL_SWAPS)
EXPERT_SCALE, SCALED_EXPERT = 1.1, 3
ACCUM_CHUNK = 64
DESCRIPTIONS = {
    "int4": "INT4 RTN, symmetric, group 128, every linear layer (lm_head kept)",
    "int8": "INT8 per output channel, every linear layer",
    "fp8-tensor": "FP8 e4m3, one scale per tensor, every linear layer",
    "fp8-channel": "FP8 e4m3, one scale per output channel, every linear layer",
    "int8-quarter": "INT8 per channel in one decoder layer of every four (layers 0, 4, ...)",
    "int8-last": "INT8 per channel in the last decoder layer only (one of eight in llama-1k)",
    "int4-mlp": "INT4 g128 in the MLP (gate/up/down) only, attention kept",
    "int4-nibble": "INT4 g128 with the nibble order swapped in 5% of groups (a broken dequant)",
    "silu": "SiLU output x (1 + 2^-7) (a subtly wrong kernel)",
    "softmax": "softmax / attention probabilities x (1 + 2^-7) (a subtly wrong kernel)",
    "attn-scale": "attention softmax scale 1% too large (1.01 / sqrt(head_dim))",
    "rope-base": "RoPE base (theta) doubled",
    "accum-bf16": "every linear layer's product (F.linear; attention's own products untouched) accumulated in "
                  "bfloat16: partial sums of 64-wide slices rounded to bf16",
    "moe-expert-scale": "expert 3 of every MoE layer outputs 10% too much (a wrong per-expert scale)",
    "moe-top1": "top-1 instead of top-2 expert routing (a routing change)",
    "pad-attended": "the attention mask dropped: left-padded prompts attend to their batch's padding",
    "rope-table-bf16": "RoPE angles (position x inverse frequency) and their cos/sin computed in the model's dtype (a "
                       "rotary table in low precision; float32 runs unchanged)",
    "norm-no-upcast": "RMSNorm computed in the model's dtype, no float32 upcast (float32 runs unchanged)",
    "moe-no-renorm": "the top-2 routing weights not renormalised to sum to 1 (a routing change)",
    "router-no-upcast": "the router's softmax, top-k and renormalisation in the model's dtype, no float32 upcast (near "
                        "ties route differently; float32 runs unchanged)",
    "expert-int4-one": "one expert (3) of one MoE layer (1) quantized INT4 RTN g128, every other weight exact",
}
ONE_EXPERT, ONE_EXPERT_LAYER = 3, 1  # as the derived images' expert-int4


def selected(name: str, scope: str, num_layers: int) -> bool:
    """Whether the linear layer `name` is swapped under `scope`."""
    if name.endswith("lm_head"):
        return False
    if scope == "all":
        return True
    if scope == "mlp":  # dense MLP projections, or every expert's
        return name.rsplit(".", 1)[-1] in MLP or ".experts." in name
    m = _LAYER.search(name + ".")
    if scope == "quarter":
        return bool(m) and int(m.group(1)) % 4 == 0 and num_layers > 0
    if scope == "last":
        return bool(m) and int(m.group(1)) == num_layers - 1
    raise ValueError(f"unknown scope {scope}")


def matrices(model):
    """(name, 2-D weight tensor) of every matrix product of `model`: nn.Linear weights, and each expert's slice of
    the 3-D `experts.*` parameters of transformers 5's MoE blocks (named `<module>.<param>.<expert>`)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            yield name, module.weight.data
        elif name.endswith("experts"):
            for pname, param in module.named_parameters(recurse=False):
                if param.dim() == 3:
                    for e in range(param.shape[0]):
                        yield f"{name}.{pname}.{e}", param.data[e]


def apply_weight_swap(model, swap: str) -> list[str]:
    """Quantize the selected weight matrices of `model` in place; return the names of the swapped ones."""
    import torch

    quantize, scope = WEIGHT_SWAPS[swap]
    num_layers = int(getattr(model.config, "num_hidden_layers", 0))
    done = []
    with torch.no_grad():
        for name, w in matrices(model):
            if selected(name, scope, num_layers):
                # the nibble swap draws its broken groups from a CPU generator: quantize that one on the CPU
                q = quantize(w.cpu()).to(w.device) if swap == "int4-nibble" else quantize(w)
                w.copy_(q)
                done.append(name)
    if not done:
        raise ValueError(f"swap {swap} matched no linear layer")
    return done


def _drop_attention_mask(model) -> int:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    forward = decoder.forward
    decoder.forward = lambda *a, **k: forward(*a, **{n: v for n, v in k.items() if n != "attention_mask"})
    return 1


def _double_rope_base(module) -> int:
    """inv_freq[i] = base^(-2i/d); with the base doubled: x 2^(-2i/d)."""
    import torch

    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
        return 0
    d = 2 * module.inv_freq.shape[-1]
    factor = 2.0 ** (-torch.arange(0, d, 2, device=module.inv_freq.device, dtype=torch.float32) / d)
    for attr in ("inv_freq", "original_inv_freq"):
        if isinstance(getattr(module, attr, None), torch.Tensor):
            getattr(module, attr).mul_(factor.to(getattr(module, attr).dtype))
    return 1


def _scale_expert(module) -> int:
    changed = 0
    for pname, param in module.named_parameters(recurse=False):
        if param.dim() == 3 and "down" in pname:
            param.data[SCALED_EXPERT].mul_(EXPERT_SCALE)
            changed += 1
    return changed


def _route_top1(module) -> int:
    if getattr(module, "top_k", None) != 2:
        return 0
    module.top_k = 1
    return 1


def _bf16_path(module, forward, suffix: str) -> int:
    """Give one module of class `*suffix` the derived images' forward that computes in the model's dtype."""
    if not type(module).__name__.endswith(suffix):
        return 0
    module.forward = types.MethodType(forward, module)
    return 1


def _router_no_renorm(module) -> int:
    """A top-k router (transformers 5's `*TopKRouter`) whose top-k weights are not renormalised to sum to 1."""
    import torch
    import torch.nn.functional as F

    if not type(module).__name__.endswith("TopKRouter"):
        return 0

    def forward(hidden_states):
        logits = F.linear(hidden_states.reshape(-1, module.weight.shape[1]), module.weight)
        top_value, top_index = torch.topk(torch.softmax(logits.float(), dim=-1), module.top_k, dim=-1)
        return logits, top_value, top_index

    module.forward = forward
    return 1


def apply_model_swap(model, swap: str) -> int:
    """Change a loaded model's attention scale, attention mask, RoPE base, expert scale or routing in place; return how
    many modules changed (ValueError when none: a swap that changes nothing must not be counted as caught or missed)."""
    import torch

    if swap == "pad-attended":
        changed = _drop_attention_mask(model)
    elif swap == "expert-int4-one":
        changed = derived.quantize_one_expert(model, expert=ONE_EXPERT, layer=ONE_EXPERT_LAYER)
    elif swap == "attn-scale":  # the derived images' own function (tests/integration/derived/swap.py)
        changed = derived.scale_attention(model)
    else:
        per_module = {"rope-base": _double_rope_base, "moe-top1": _route_top1,
                      "moe-expert-scale": lambda m: _scale_expert(m) if m is not model else 0,
                      "rope-table-bf16": lambda m: _bf16_path(m, derived.rope_forward, "RotaryEmbedding"),
                      "norm-no-upcast": lambda m: _bf16_path(m, derived.norm_forward, "RMSNorm"),
                      "router-no-upcast": lambda m: _bf16_path(m, derived.router_forward, "TopKRouter"),
                      "moe-no-renorm": _router_no_renorm}[swap]
        with torch.no_grad():
            changed = sum(per_module(m) for name, m in model.named_modules()
                          if swap != "moe-expert-scale" or name.endswith("experts"))
    if not changed:
        raise ValueError(f"swap {swap} matched nothing in {type(model).__name__}")
    return changed


def applies_to(swap: str, *, moe: bool, ragged: bool) -> bool:
    """Whether `swap` means anything for a dense (moe=False) or MoE model, with a ragged prompt set or not."""
    return (swap not in MOE_SWAPS or moe) and (swap not in RAGGED_SWAPS or ragged)


def _accumulate_bf16(f_linear):
    import torch

    def linear(input, weight, bias=None):
        k = weight.shape[-1]
        if k <= ACCUM_CHUNK:
            return f_linear(input, weight, bias)
        total = None
        for s in range(0, k, ACCUM_CHUNK):
            part = f_linear(input[..., s:s + ACCUM_CHUNK], weight[..., s:s + ACCUM_CHUNK]).float()
            total = part.to(torch.bfloat16) if total is None else (total.float() + part).to(torch.bfloat16)
        out = total.to(input.dtype)
        return out if bias is None else out + bias
    return linear


@contextlib.contextmanager
def kernel_swap(swap: str | None):
    """Patch torch so SiLU or softmax (and SDPA's attention probabilities) are off by KERNEL_FACTOR, or matrix
    products accumulate in bfloat16; restore after."""
    import torch
    import torch.nn.functional as F

    saved: list[tuple[object, str, object]] = []

    def patch(owner, attr, new):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    try:
        if swap == "silu":
            silu = F.silu
            patch(F, "silu", lambda input, inplace=False: silu(input, inplace=inplace) * KERNEL_FACTOR)
        elif swap == "softmax":
            f_softmax, t_softmax, sdpa = F.softmax, torch.softmax, F.scaled_dot_product_attention
            patch(F, "softmax", lambda *a, **k: f_softmax(*a, **k) * KERNEL_FACTOR)
            patch(torch, "softmax", lambda *a, **k: t_softmax(*a, **k) * KERNEL_FACTOR)
            # softmax(QK^T) V scaled by c == softmax probabilities scaled by c
            patch(F, "scaled_dot_product_attention", lambda *a, **k: sdpa(*a, **k) * KERNEL_FACTOR)
        elif swap == "accum-bf16":
            patch(F, "linear", _accumulate_bf16(F.linear))
        elif swap not in (None, "", *WEIGHT_SWAPS, *MODEL_SWAPS, *PRECISION_SWAPS, *MOE_SWAPS, *RAGGED_SWAPS):
            raise ValueError(f"unknown swap {swap}")
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)
