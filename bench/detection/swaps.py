"""Swaps the detection benchmark applies in-process: the derived test images' quantizers plus partial and kernel swaps.

The weight quantizers (INT4 RTN g128, INT8 per-channel, FP8 e4m3 per-tensor, INT4 with nibbles
swapped in 5% of groups) and the SiLU patch are the very functions the gate's integration test
bakes into derived images (tests/integration/derived/swap.py, loaded here by path so there
is one copy of them). Added here: FP8 e4m3 per output channel, partial swaps (INT8 in one quarter
of the layers, INT4 in the MLP only) and a softmax off by a small factor. Needs torch only (it
also runs on the NVIDIA reference machine, which has no skupin dependencies).

Weight swaps change a loaded model in place (`apply_weight_swap`); kernel swaps patch torch
functions for the duration of a ``with kernel_swap(name):`` block and restore them after.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
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

# name -> (quantizer, which linear layers: "all" | "quarter" (every 4th decoder layer) | "mlp")
WEIGHT_SWAPS = {
    "int4": (derived.int4, "all"),
    "int8": (derived.int8, "all"),
    "fp8-tensor": (derived.fp8, "all"),
    "fp8-channel": (fp8_channel, "all"),
    "int8-quarter": (derived.int8, "quarter"),
    "int4-mlp": (derived.int4, "mlp"),
    "int4-nibble": (derived.int4_nibble, "all"),
}
KERNEL_SWAPS = ("silu", "softmax")
SWAPS = (*WEIGHT_SWAPS, *KERNEL_SWAPS)
DESCRIPTIONS = {
    "int4": "INT4 RTN, symmetric, group 128, every linear layer (lm_head kept)",
    "int8": "INT8 per output channel, every linear layer",
    "fp8-tensor": "FP8 e4m3, one scale per tensor, every linear layer",
    "fp8-channel": "FP8 e4m3, one scale per output channel, every linear layer",
    "int8-quarter": "INT8 per channel in one decoder layer of every four (layers 0, 4, ...)",
    "int4-mlp": "INT4 g128 in the MLP (gate/up/down) only, attention kept",
    "int4-nibble": "INT4 g128 with the nibble order swapped in 5% of groups (a broken dequant)",
    "silu": "SiLU output x (1 + 2^-7) (a subtly wrong kernel)",
    "softmax": "softmax / attention probabilities x (1 + 2^-7) (a subtly wrong kernel)",
}


def selected(name: str, scope: str, num_layers: int) -> bool:
    """Whether the linear layer `name` is swapped under `scope`."""
    if name.endswith("lm_head"):
        return False
    if scope == "all":
        return True
    if scope == "mlp":
        return name.rsplit(".", 1)[-1] in MLP
    if scope == "quarter":
        m = _LAYER.search(name + ".")
        return bool(m) and int(m.group(1)) % 4 == 0 and num_layers > 0
    raise ValueError(f"unknown scope {scope}")


def apply_weight_swap(model, swap: str) -> list[str]:
    """Quantize the selected linear weights of `model` in place; return the names of the swapped layers."""
    import torch

    quantize, scope = WEIGHT_SWAPS[swap]
    num_layers = int(getattr(model.config, "num_hidden_layers", 0))
    done = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and selected(name, scope, num_layers):
                w = module.weight.data
                # the nibble swap draws its broken groups from a CPU generator: quantize that one on the CPU
                q = quantize(w.cpu()).to(w.device) if swap == "int4-nibble" else quantize(w)
                module.weight.copy_(q)
                done.append(name)
    if not done:
        raise ValueError(f"swap {swap} matched no linear layer")
    return done


@contextlib.contextmanager
def kernel_swap(swap: str | None):
    """Patch torch so SiLU or softmax (and SDPA's attention probabilities) are off by KERNEL_FACTOR; restore after."""
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
        elif swap not in (None, "", *WEIGHT_SWAPS):
            raise ValueError(f"unknown swap {swap}")
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)
