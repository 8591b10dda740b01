"""Test fixture: silently change what an image computes, at load time (the swaps the gate must catch).

Installed as ``sitecustomize.py`` into the site-packages of a thin image derived FROM an honest
one; the mode is read from /etc/skupin-test-swap (baked at build time) or, for runs on the host,
the SKUPIN_TEST_SWAP environment variable. Nothing changes on disk: the weights are quantized when
transformers loads them and SiLU is patched when torch.nn.functional is imported, exactly the kind
of change that leaves an image loading and running at normal speed.

Modes:
  int4         linear weights round-to-nearest INT4, symmetric, group 128 (lm_head and embeddings kept)
  int8         linear weights INT8, symmetric, one scale per output channel
  fp8          linear weights cast to float8 e4m3 with one scale per tensor
  int4-nibble  INT4 group 128 packed two per byte, dequantized with the nibble order swapped in 5% of groups
  silu         torch.nn.functional.silu off by a factor 1 + 2**-7
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MODES = ("int4", "int8", "fp8", "int4-nibble", "silu")


def _mode() -> str:
    value = os.environ.get("SKUPIN_TEST_SWAP", "")
    if not value:
        try:
            with open("/etc/skupin-test-swap", encoding="utf-8") as fh:
                value = fh.read().strip()
        except OSError:
            return ""
    return value if value in MODES else ""


def _int4_codes(w, group: int = 128):
    import torch

    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(g / scale), -8, 7)
    return q, scale


def int4(w):
    q, scale = _int4_codes(w)
    return (q * scale).reshape(w.shape).to(w.dtype)


def int4_nibble(w, fraction: float = 0.05):
    """INT4 group 128 where a broken dequant reads the two nibbles of each byte in the wrong order in some groups."""
    import torch

    q, scale = _int4_codes(w)
    rows, groups, size = q.shape
    gen = torch.Generator().manual_seed(1234)
    broken = torch.rand(rows, groups, generator=gen) < fraction
    swapped = q.reshape(rows, groups, size // 2, 2).flip(-1).reshape(rows, groups, size)
    q = torch.where(broken[..., None], swapped, q)
    return (q * scale).reshape(w.shape).to(w.dtype)


def int8(w):
    import torch

    scale = (w.float().abs().amax(1, keepdim=True) / 127.0).clamp_min(1e-12)
    return (torch.clamp(torch.round(w.float() / scale), -127, 127) * scale).to(w.dtype)


def fp8(w):
    import torch

    scale = (w.float().abs().max() / 448.0).clamp_min(1e-12)
    return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


QUANT = {"int4": int4, "int8": int8, "fp8": fp8, "int4-nibble": int4_nibble}


def quantize_model(model, mode: str) -> None:
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(QUANT[mode](module.weight.data))


def _patch_modeling_utils(module, mode: str) -> None:
    original = module.PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        quantize_model(model, mode)
        return model

    module.PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _patch_functional(module, mode: str) -> None:
    original = module.silu
    factor = 1.0 + 2.0**-7

    def silu(input, inplace=False):  # noqa: A002 - torch's own argument name
        return original(input, inplace=inplace) * factor

    module.silu = silu


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run a patch right after one module has executed."""

    def __init__(self, target: str, patch) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install(mode: str) -> None:
    if mode in QUANT:
        sys.meta_path.insert(0, _AfterImport("transformers.modeling_utils", lambda m: _patch_modeling_utils(m, mode)))
    elif mode == "silu":
        sys.meta_path.insert(0, _AfterImport("torch.nn.functional", lambda m: _patch_functional(m, mode)))


install(_mode())
