#!/usr/bin/env python3
"""The op battery's bench job: honest runs and bf16-path faults of the engine's ops, written as probe outputs.

Runs where torch and transformers are (this CPU, or the lent H200 through the `run` tool) with the probe's own
code (skupin/imagetools/probe/: the transformers adapter's `op_battery`, skupin_probe_ops.run_battery) and
nothing of skupin's host side; `bench/ops/analyse.py` then judges every variant on the host with the gate's own
code (gates/judge/ops.py). Each variant is one folder OUT/<variant>/ with probe.json and tensors.safetensors.

    python3 bench/ops/job.py --out OUT [--device cuda] [--dtype bfloat16]

Variants: honest (sdpa and eager attention; on CUDA also with TF32 allowed, which is honest hardware behaviour the
SKU must declare) and one fault per class below, each replacing one op's implementation with a plausible bug of
the bf16 path: a missing upcast, a reduction accumulated in bf16, a table computed in low precision, a routing
change, one badly quantized expert.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "..", "..", "skupin", "imagetools", "probe")
sys.path.insert(0, os.path.abspath(PROBE))

import skupin_probe as probe  # noqa: E402
import skupin_probe_ops as spec  # noqa: E402
import skupin_probe_transformers as adapter  # noqa: E402
import torch  # noqa: E402

Impl = Callable[[dict[str, Any]], dict[str, Any]]


def _bf16_sum(x: Any, chunks: int = 16) -> Any:
    """A last-axis sum accumulated in the input's dtype chunk by chunk (what a kernel without an fp32 accumulator does)."""
    parts = x.reshape(*x.shape[:-1], chunks, -1).sum(-1).to(x.dtype)
    acc = parts[..., 0]
    for j in range(1, chunks):
        acc = (acc + parts[..., j]).to(x.dtype)
    return acc


def rmsnorm_bf16_variance(x: dict[str, Any]) -> dict[str, Any]:
    """The variance accumulated in bf16 (no fp32 accumulator), the rest as transformers does."""
    h = x["x"]
    var = (_bf16_sum((h * h).to(h.dtype)) / h.shape[-1]).to(h.dtype)[..., None]
    return {"out": x["weight"] * (h.float() * torch.rsqrt(var.float() + spec.EPS)).to(h.dtype)}


def rmsnorm_no_upcast(x: dict[str, Any]) -> dict[str, Any]:
    """Every step in the input dtype (a kernel that skipped the fp32 upcast)."""
    h = x["x"]
    var = (h * h).mean(-1, keepdim=True)
    return {"out": x["weight"] * (h * torch.rsqrt(var + spec.EPS))}


def silu_low_exp(x: dict[str, Any]) -> dict[str, Any]:
    """SiLU with its exponential and reciprocal rounded to the dtype between steps."""
    g, u = x["x"].chunk(2, dim=-1)
    e = torch.exp(-g).to(g.dtype)
    s = (1 / (1 + e).to(g.dtype)).to(g.dtype)
    return {"out": ((g * s).to(g.dtype) * u)}


def _rope_with(x: dict[str, Any], table_dtype: Any) -> dict[str, Any]:
    half = spec.HD // 2
    inv = 1.0 / (spec.THETA ** (torch.arange(0, spec.HD, 2, dtype=torch.float32, device=x["q"].device) / spec.HD))
    angle = (x["positions"].to(table_dtype)[:, None] * inv.to(table_dtype)[None, :]).float()
    emb = torch.cat((angle, angle), -1)[:, None, :]
    cos, sin = emb.cos().to(x["q"].dtype), emb.sin().to(x["q"].dtype)

    def rot(t: Any) -> Any:
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    return {"q": rot(x["q"]), "k": rot(x["k"])}


def rope_bf16_table(x: dict[str, Any]) -> dict[str, Any]:
    """The rotary angles p * inv_freq computed in bf16 (a table in low precision)."""
    return _rope_with(x, torch.bfloat16)


def rope_fp16_table(x: dict[str, Any]) -> dict[str, Any]:
    """The rotary angles computed in fp16 (a narrower table)."""
    return _rope_with(x, torch.float16)


def attention_low_softmax(x: dict[str, Any]) -> dict[str, Any]:
    """Attention whose softmax runs in the dtype (exp and its sum rounded), products as usual."""
    q, k, v = x["q"], x["k"], x["v"]
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = (q @ k.transpose(1, 2)) * spec.HD**-0.5
    if q.shape[1] == k.shape[1] and q.shape[1] > 1:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    z = torch.exp((s - s.amax(-1, keepdim=True)).to(q.dtype)).to(q.dtype)
    p = (z / _bf16_sum(z, chunks=z.shape[-1] // 16 if z.shape[-1] % 16 == 0 else 1)[..., None]).to(q.dtype)
    return {"out": p @ v}


def matmul_low_accum(x: dict[str, Any]) -> dict[str, Any]:
    """x @ W^T with the K reduction split in 8 and the partial sums added in the dtype (split-K without fp32)."""
    a, w = x["x"], x["weight"]
    parts = [(a[:, i:i + 64] @ w[:, i:i + 64].T).to(a.dtype) for i in range(0, a.shape[1], 64)]
    acc = parts[0]
    for p in parts[1:]:
        acc = (acc + p).to(a.dtype)
    return {"out": acc}


def _tf32(t: Any) -> Any:
    """float32 values with their mantissa cut to TF32's 10 explicit bits (round to nearest)."""
    i = t.float().contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def matmul_tf32(x: dict[str, Any]) -> dict[str, Any]:
    """A float32 product with TF32 inputs (what allow_tf32 gives on tensor cores), as a fault on any device."""
    return {"out": _tf32(x["x"]) @ _tf32(x["weight"]).T}


def route_no_renorm(x: dict[str, Any]) -> dict[str, Any]:
    """Top-k weights left unnormalised (a routing change)."""
    probs = torch.softmax(x["logits"].float(), -1)
    w, ids = torch.topk(probs, spec.TOPK, -1)
    return {"weights": w.to(x["logits"].dtype), "ids": ids.to(torch.int32)}


def route_low_softmax(x: dict[str, Any]) -> dict[str, Any]:
    """The router softmax in the dtype, then top-k and renormalisation."""
    probs = torch.softmax(x["logits"], -1)
    w, ids = torch.topk(probs, spec.TOPK, -1)
    return {"weights": (w / w.sum(-1, keepdim=True)).to(x["logits"].dtype), "ids": ids.to(torch.int32)}


def _q4(w: Any) -> Any:
    """Symmetric int4 per row (the badly quantized expert)."""
    scale = w.float().abs().amax(-1, keepdim=True) / 7
    return ((w.float() / scale).round().clamp(-8, 7) * scale).to(w.dtype)


def moe_block_with(honest: Impl, expert: int | None = None, renorm: bool = True) -> Impl:
    def run(x: dict[str, Any]) -> dict[str, Any]:
        y = dict(x)
        if expert is not None:
            for name in ("w1", "w3", "w2"):
                w = y[name].clone()
                w[expert] = _q4(w[expert])
                y[name] = w
        if not renorm:  # routing weights without renormalisation: the block's output, by hand
            logits = y["x"] @ y["gate"].T
            probs = torch.softmax(logits.float(), -1)
            w, ids = torch.topk(probs, spec.TOPK, -1)
            out = torch.zeros_like(y["x"])
            for t in range(y["x"].shape[0]):
                for slot in range(spec.TOPK):
                    e = int(ids[t, slot])
                    h = torch.nn.functional.silu(y["x"][t] @ y["w1"][e].T) * (y["x"][t] @ y["w3"][e].T)
                    out[t] += (w[t, slot] * (h @ y["w2"][e].T)).to(out.dtype)
            return {"out": out}
        return honest(y)

    return run


def faults(honest: dict[str, Impl]) -> dict[str, tuple[str, Impl, str]]:
    """variant -> (op, implementation, class)."""
    out = {
        "rmsnorm.bf16_variance": ("rmsnorm", rmsnorm_bf16_variance, "bf16 path precision"),
        "rmsnorm.no_upcast": ("rmsnorm", rmsnorm_no_upcast, "bf16 path precision"),
        "silu.low_exp": ("silu_mul", silu_low_exp, "bf16 path precision"),
        "rope.bf16_table": ("rope.long", rope_bf16_table, "bf16 path precision"),
        "rope.fp16_table": ("rope.long", rope_fp16_table, "bf16 path precision"),
        "attention.low_softmax.prefill": ("attention.prefill", attention_low_softmax, "bf16 path precision"),
        "attention.low_softmax.decode": ("attention.decode", attention_low_softmax, "bf16 path precision"),
        "matmul.low_accum": ("matmul", matmul_low_accum, "bf16 path precision"),
        "matmul.tf32": ("matmul", matmul_tf32, "reduced float32 precision"),
    }
    if "moe.route" in honest:
        out.update({
            "route.no_renorm": ("moe.route", route_no_renorm, "routing"),
            "route.low_softmax": ("moe.route", route_low_softmax, "routing"),
            "moe.no_renorm": ("moe.block", moe_block_with(honest["moe.block"], renorm=False), "routing"),
            "moe.q4_expert0": ("moe.block", moe_block_with(honest["moe.block"], expert=0), "quantized expert"),
            "moe.q4_expert5": ("moe.block", moe_block_with(honest["moe.block"], expert=5), "quantized expert"),
        })
    return out


def write(out: str, name: str, tensors: dict[str, Any], report: dict[str, Any], meta: dict[str, Any]) -> None:
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    probe.write_safetensors(os.path.join(folder, "tensors.safetensors"), tensors, {"variant": name})
    with open(os.path.join(folder, "probe.json"), "w", encoding="utf-8") as fh:
        json.dump({"format": probe.FORMAT, "checks": {"ops": report}, "variant": meta}, fh, indent=1, default=str)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--model", default=HERE, help="folder with config.json (default: bench/ops, a Mixtral config)")
    args = p.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        import shutil

        os.makedirs(os.path.join(args.out, "_model"), exist_ok=True)
        shutil.copy(os.path.join(HERE, "config-mixtral.json"), os.path.join(args.out, "_model", "config.json"))
        args.model = os.path.join(args.out, "_model")
    dtypes = (args.dtype, "float32")
    env = probe.environment(args.device.split(":")[0] if args.device != "cpu" else "cpu")
    with open(os.path.join(args.out, "env.json"), "w", encoding="utf-8") as fh:
        json.dump({k: env.get(k) for k in ("torch", "cuda", "device", "cpu_model", "threads", "engines")}, fh, indent=1)
    runs = 0
    t0 = time.time()
    for attn in ("sdpa", "eager"):
        opts = {"dtype": args.dtype, "batch_size": 1, "top_k": 2, "attn": attn, "full_logprobs": 0, "new_tokens": 0,
                "vocab": 0, "cpu_threads": 1}
        impls, uncovered = adapter.op_battery(args.model, opts, args.device, spec)  # type: ignore[arg-type]
        for boot in (1, 2):  # the same code twice in one process: run-to-run determinism
            tensors, report = spec.run_battery(impls, uncovered, dtypes, args.device)
            write(args.out, f"honest.{attn}.{boot}", tensors, report, {"kind": "honest", "attn": attn})
            runs += 1
        if args.device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            tensors, report = spec.run_battery(impls, uncovered, dtypes, args.device)
            write(args.out, f"tf32.{attn}", tensors, report, {"kind": "tf32", "attn": attn,
                                                             "setting": "torch.backends.cuda.matmul.allow_tf32=True"})
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            runs += 1
        if attn != "sdpa":
            continue
        for name, (op, impl, kind) in faults(impls).items():
            tensors, report = spec.run_battery({**impls, op: impl}, uncovered, dtypes, args.device)
            write(args.out, f"fault.{name}", tensors, report, {"kind": "fault", "class": kind, "op": op})
            runs += 1
    print(f"{runs} battery runs in {time.time() - t0:.1f} s on {args.device} -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
