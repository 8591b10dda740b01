"""The engine op battery: the spec of every op on a model's path, its seeded inputs, and the probe's runner.

The engine adapters (skupin_probe_<engine>.py) give their *own* implementation of each op (the layer classes and
custom ops the engine serves with, or the model's own modules); the runner feeds them the inputs below, in the
SKU's serving dtype and in float32, and stores what came out as ops.<op>.<dtype>.<output> tensors. Nothing is
judged here: the gate host regenerates the same inputs from this spec and computes each op's definition in
float64 (gates/judge/ops.py), so no arithmetic of the image decides.

Inputs come from integer hashing, exactly: a value is sign * m * 2^(e - bits + 1) with m an integer of `bits`
bits, so at bits=8 every value is exactly a bfloat16 (and a float16 and a float32) and at bits=24 a float32 whose
low mantissa bits are set (not representable in TF32 or bfloat16: a reduced-precision float32 product cannot hold
it exactly, which is what makes TF32 visible). The host and the image compute the same list of Python floats.

Standard library at import; torch only inside the functions that make tensors. Imports nothing of skupin.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable
from typing import Any

# Shapes: small enough for a float64 reference on the host in well under a second, large enough that a
# reduction (K = 512, attention over 160 keys) shows an accumulation done in low precision.
T, H, IW = 32, 256, 128  # tokens, hidden size, MLP half width
NH, NKV, HD = 4, 2, 64  # query heads, key/value heads (GQA), head size
TP, LD = 48, 160  # prefill length, decode context length
E, TOPK, HM, IM = 8, 2, 128, 64  # experts, experts per token, MoE hidden size, MoE expert width
MK, MN = 512, 64  # matmul reduction length and output width
EPS, THETA = 1e-5, 10000.0
SHORT = tuple(range(T))
LONG = tuple(4096 + 61 * t for t in range(T))  # positions up to 5987: angles where float32 rounding of p*f shows

OUTPUTS: dict[str, tuple[str, ...]] = {
    "rmsnorm": ("out",),
    "add_rmsnorm": ("out", "residual"),
    "silu_mul": ("out",),
    "rope.short": ("q", "k"),
    "rope.long": ("q", "k"),
    "attention.prefill": ("out",),
    "attention.decode": ("out",),
    "moe.route": ("weights", "ids"),
    "moe.block": ("out",),
    "matmul": ("out",),
}
OPS = tuple(OUTPUTS)
WHAT = {
    "rmsnorm": "RMS normalisation x / sqrt(mean(x^2) + eps) * w",
    "add_rmsnorm": "fused residual add + RMS normalisation (returns the normalised sum and the new residual)",
    "silu_mul": "gated activation silu(x[:, :128]) * x[:, 128:]",
    "rope.short": "rotary embedding (neox halves) at positions 0..31",
    "rope.long": "rotary embedding (neox halves) at positions 4096..5987",
    "attention.prefill": "causal attention, 48 queries, grouped KV heads",
    "attention.decode": "one query over 160 cached keys, grouped KV heads",
    "moe.route": "router softmax over 8 experts, top-2, renormalised",
    "moe.block": "mixture-of-experts block: router, top-2, renormalised, SwiGLU experts, weighted sum",
    "matmul": "a dense product x @ W^T (the engine's linear layer), K = 512",
}


def _mix(z: int) -> int:
    """splitmix64's finaliser."""
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def values(count: int, salt: int, *, bits: int, exp: tuple[int, int], positive: bool = False) -> list[float]:
    """`count` exact values sign * m * 2^(e - bits + 1): m of `bits` bits (top bit set), e in [exp[0], exp[1]]."""
    lo, span = exp[0], exp[1] - exp[0] + 1
    top = 1 << (bits - 1)
    out = []
    for i in range(count):
        h = _mix((salt << 32) ^ i)
        m = top | (h & (top - 1))
        e = lo + (h >> 40) % span
        sign = 1.0 if positive or (h >> 63) == 0 else -1.0
        out.append(sign * math.ldexp(m, e - bits + 1))
    return out


def bits_of(dtype: str) -> int:
    """Significant bits of the inputs of an op run at `dtype`: exact in the dtype; at float32 past TF32's 11."""
    return 24 if dtype == "float32" else 8


def permutation_logits(rows: int, cols: int, salt: int) -> list[float]:
    """Router logits: each row a permutation of 0..cols-1 times 0.375 minus 1.25, so no two are ever equal (a top-k
    without ties) and each is exact in every dtype."""
    out: list[float] = []
    for r in range(rows):
        keys = sorted(range(cols), key=lambda j: _mix((salt << 40) ^ (r << 16) ^ j))
        rank = [0] * cols
        for pos, j in enumerate(keys):
            rank[j] = pos
        out += [0.375 * k - 1.25 for k in rank]
    return out


def inputs(op: str, dtype: str) -> dict[str, tuple[tuple[int, ...], list[float]]]:
    """Each input of `op` at `dtype`: name -> (shape, values, row-major). Positions and ids are exact integers."""
    b = bits_of(dtype)
    salt = 1000 * (OPS.index(op) + 1) + (0 if dtype == "float32" else 7)

    def v(name: str, shape: tuple[int, ...], exp: tuple[int, int], positive: bool = False) -> None:
        found[name] = (shape, values(math.prod(shape), salt + len(found), bits=b, exp=exp, positive=positive))

    found: dict[str, tuple[tuple[int, ...], list[float]]] = {}
    if op in ("rmsnorm", "add_rmsnorm"):
        v("x", (T, H), (-2, 1))
        if op == "add_rmsnorm":
            v("residual", (T, H), (-2, 1))
        v("weight", (H,), (-1, 0), positive=True)
    elif op == "silu_mul":
        v("x", (T, 2 * IW), (-3, 2))
    elif op.startswith("rope."):
        v("q", (T, NH, HD), (-2, 1))
        v("k", (T, NKV, HD), (-2, 1))
        found["positions"] = ((T,), [float(p) for p in (SHORT if op == "rope.short" else LONG)])
    elif op.startswith("attention."):
        tq, tk = (TP, TP) if op == "attention.prefill" else (1, LD)
        v("q", (NH, tq, HD), (-1, 1))  # |q.k| / sqrt(HD) up to ~10: peaked attention, as in trained models
        v("k", (NKV, tk, HD), (-1, 1))
        v("v", (NKV, tk, HD), (-2, 1))
    elif op == "moe.route":
        found["logits"] = ((T, E), permutation_logits(T, E, salt))
    elif op == "moe.block":
        v("x", (T, HM), (-2, 1))
        v("gate", (E, HM), (-4, -2))
        v("w1", (E, IM, HM), (-5, -3))
        v("w3", (E, IM, HM), (-5, -3))
        v("w2", (E, HM, IM), (-5, -3))
    elif op == "matmul":
        v("x", (T, MK), (-2, 1))
        v("weight", (MN, MK), (-4, -2))
    else:
        raise KeyError(op)
    return found


# ---------------------------------------------------------------- the probe's side (torch)

# One op's implementation: its inputs as torch tensors (at the op's dtype; positions int64) -> its outputs by name.
Impl = Callable[[dict[str, Any]], dict[str, Any]]


def torch_inputs(op: str, dtype: str, device: str) -> dict[str, Any]:
    """The inputs of `op` as tensors on `device` (positions int64, every other input at `dtype`)."""
    import torch

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    out = {}
    for name, (shape, vals) in inputs(op, dtype).items():
        t = torch.tensor(vals, dtype=torch.float64).reshape(shape)
        out[name] = t.to(torch.int64 if name == "positions" else tdt).to(device)
    return out


def _run_one(key: str, outputs: tuple[str, ...], impl: Impl, make_inputs: Callable[[], dict[str, Any]], device: str,
             tensors: dict[str, Any]) -> dict[str, Any]:
    """Run one op (`key` = <op>.<dtype>) on its inputs; its outputs go to tensors ops.<key>.<output>; its report row."""
    import torch

    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            got = impl(make_inputs())
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        for name in outputs:
            tensors[f"ops.{key}.{name}"] = got[name].detach().to("cpu").contiguous()
        return {"status": "ok", "seconds": round(time.perf_counter() - t0, 4)}
    except Exception as exc:  # an op that cannot run is a result (the host fails it), recorded per op
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:1000]}


def run_battery(impls: dict[str, Impl], uncovered: dict[str, str], dtypes: tuple[str, ...],
                device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run every implemented op at every dtype: (tensors ops.<op>.<dtype>.<output>, the check's report)."""
    tensors: dict[str, Any] = {}
    rows: dict[str, Any] = {}
    for op in OPS:
        if op not in impls:
            continue
        for dtype in dtypes:
            rows[f"{op}.{dtype}"] = _run_one(f"{op}.{dtype}", OUTPUTS[op], impls[op],
                                             functools.partial(torch_inputs, op, dtype, device), device, tensors)
    return tensors, {"status": "ok", "ops": rows, "uncovered": dict(sorted(uncovered.items())),
                     "dtypes": list(dtypes), "settings": precision_settings()}


# ---------------------------------------------------------------- the model's own layers, as the engine loaded them

# The module ops: each module of the model the engine loaded (its weights as loaded, its forward as the engine calls
# it) fed seeded inputs, so a fault that lives in one loaded model -- an expert quantized at load, a module patched on
# the instance, a router or rotary table built differently -- is measured where it lives, against float64 math of the
# module's definition with the model's own weights on the host (gates/judge/modules.py). LT tokens each.
LT = 32
MODULE_OUTPUTS: dict[str, tuple[str, ...]] = {
    "embed": ("out",),  # the embedding rows of seeded token ids (a lookup: exact)
    "rotary": ("cos", "sin"),  # the model's rotary table at ROTARY_POSITIONS
    "norm": ("out",),  # an RMSNorm with its loaded weight
    "attention": ("out",),  # q/k/v projections, rotary at positions LONG, causal attention, o projection
    "router": ("logits", "weights", "ids"),  # a MoE block's router: logits, top-k weights (renormalised), expert ids
    "expert": ("out",),  # one expert's SwiGLU MLP on every token (routing weight 1)
    "mlp": ("out",),  # a dense layer's SwiGLU MLP
    "moe": ("out",),  # the whole MoE block: router, top-k, experts, weighted sum
    "lm_head": ("out",),  # the output projection to the vocabulary
}
# The rotary table is read where a model serves (16 positions spread over 0..511, inside every fixture's
# max_position_embeddings) and where float32 angles lose precision (16 of LONG): a table wrong in either shows.
ROTARY_POSITIONS = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 127, 200, 300, 400, 511, *LONG[: LT // 2])
MODULES_VERSION = 2  # bump with any change to the plan, the inputs or the outputs (gates/judge/ops.py spec_sha256)


def module_plan(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, kind) of every module op of a model with config.json `config`, in order: the embedding and the rotary
    table, then per decoder layer its two norms and attention and its MLP (a MoE layer's router, each expert and the
    whole block), then the final norm and lm_head. Host and probe both derive it from the config."""
    layers, experts = int(config["num_hidden_layers"]), int(config.get("num_local_experts") or 0)
    plan = [("embed", "embed"), ("rotary", "rotary")]
    for i in range(layers):
        p = f"layer.{i}."
        plan += [(p + "input_norm", "norm"), (p + "attention", "attention"), (p + "post_norm", "norm")]
        if experts:
            plan += [(p + "router", "router"), *((f"{p}expert.{j}", "expert") for j in range(experts)), (p + "moe", "moe")]
        else:
            plan.append((p + "mlp", "mlp"))
    return plan + [("final_norm", "norm"), ("lm_head", "lm_head")]


def module_inputs(key: str, kind: str, dtype: str, config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], list[float]]]:
    """The inputs of module op `key` (of `kind`) at `dtype` for a model with config.json `config`: hidden states
    x [LT, hidden] exact in the dtype (at float32 past TF32's precision); token ids for the embedding; positions
    ROTARY_POSITIONS for the rotary table, LONG for attention."""
    salt = 50_000 + int.from_bytes(hashlib.sha256(f"{key}.{dtype}".encode()).digest()[:3], "big")
    found: dict[str, tuple[tuple[int, ...], list[float]]] = {}
    if kind == "embed":
        vocab = int(config["vocab_size"])
        found["ids"] = ((LT,), [float(_mix((salt << 20) ^ t) % vocab) for t in range(LT)])
    elif kind != "rotary":
        hidden = int(config["hidden_size"])
        found["x"] = ((LT, hidden), values(LT * hidden, salt, bits=bits_of(dtype), exp=(-2, 1)))
    if kind in ("rotary", "attention"):
        found["positions"] = ((LT,), [float(p) for p in (ROTARY_POSITIONS if kind == "rotary" else LONG[:LT])])
    return found


def run_modules(impls: dict[str, Impl], plan: list[tuple[str, str]], config: dict[str, Any], dtype: str,
                device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run every module op of `plan` the adapter implements at `dtype`: (tensors ops.<key>.<dtype>.<output>, report rows
    <key>.<dtype> -> status)."""
    tensors: dict[str, Any] = {}
    rows: dict[str, Any] = {}

    def make(key: str, kind: str) -> dict[str, Any]:  # the inputs as tensors on the device
        import torch

        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        out = {}
        for name, (shape, vals) in module_inputs(key, kind, dtype, config).items():
            t = torch.tensor(vals, dtype=torch.float64).reshape(shape)
            out[name] = t.to(torch.int64 if name in ("positions", "ids") else tdt).to(device)
        return out

    for key, kind in plan:
        if key in impls:
            rows[f"{key}.{dtype}"] = _run_one(f"{key}.{dtype}", MODULE_OUTPUTS[kind], impls[key],
                                              functools.partial(make, key, kind), device, tensors)
    return tensors, rows


# The module ops captured from a real forward, for an engine whose modules cannot be fed seeded inputs (llama.cpp:
# its library evaluates whole graphs only). The engine runs the model on the seeded token ids of the `embed` key
# (module_inputs), as CAPTURE_SEGMENTS sequences of LT // 2 tokens, each from an empty KV cache at its positions of
# CAPTURE_POSITIONS: all but its last token as one batch (prefill), its last through the KV cache (decode). Every
# module op's input and output is the engine's own tensor of that forward, ops.<key>.<dtype>.in_x beside its
# outputs; the host recomputes each module in float64 from that input with the fixture's weights (the embedding
# from the ids it regenerates, attention and the rotary embedding at these positions). The rotary embedding is
# captured as applied (there is no table): the layer-0 query projection before and after it (`out`).
CAPTURE_SEGMENTS = 2
CAPTURE_POSITIONS = (*range(LT // 2), *range(LONG[0], LONG[0] + LT // 2))  # short, and long where float32 angles round
CAPTURED_OUTPUTS: dict[str, tuple[str, ...]] = {**MODULE_OUTPUTS, "rotary": ("out",)}
# A peaked router leaves some experts without a token among the LT captured ones, and an engine that computes an expert
# on its routed tokens only (llama.cpp) shows none of it: the experts' module ops also take the rows of this many more
# sequences of LT // 2 seeded tokens (the `embed` ids of keys experts.0, experts.1, ...; positions 0.., each from an
# empty KV cache, prefill then one decode). Only the per-token ops use them: an expert's input is its captured row.
CAPTURE_EXPERT_SEGMENTS = 8
# so an expert has at most this many captured rows (each token routes to it once at most)
CAPTURE_EXPERT_ROWS = LT + CAPTURE_EXPERT_SEGMENTS * (LT // 2)


def expert_capture_ids(dtype: str, config: dict[str, Any]) -> list[int]:
    """The seeded token ids of the experts' extra sequences, CAPTURE_EXPERT_SEGMENTS x LT // 2 of them, in order."""
    needed = CAPTURE_EXPERT_SEGMENTS * (LT // 2)
    keys = -(-needed // LT)
    return [int(v) for n in range(keys) for v in module_inputs(f"experts.{n}", "embed", dtype, config)["ids"][1]][:needed]


def capture_segments() -> list[list[int]]:
    """The positions of each captured sequence (consecutive runs of CAPTURE_POSITIONS), in row order."""
    runs: list[list[int]] = []
    for p in CAPTURE_POSITIONS:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def precision_settings() -> dict[str, Any]:
    """torch's switches for reduced-precision float32 arithmetic, read after the engine's ops were built and run
    (an engine may set them as it loads)."""
    import torch

    out: dict[str, Any] = {"cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if mkldnn is not None and hasattr(mkldnn, "fp32_precision"):
        out["mkldnn_matmul_fp32_precision"] = str(mkldnn.fp32_precision)
    return out


# ---------------------------------------------------------------- plain torch definitions adapters reuse


def rotate_neox(x: Any, cos: Any, sin: Any) -> Any:
    """x * cos + rotate_half(x) * sin over the last dimension (the neox layout the spec uses)."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def route_topk(logits: Any) -> dict[str, Any]:
    """Mixtral's routing in torch: softmax in float32, top-k, renormalised, weights back at the logits' dtype."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, TOPK, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return {"weights": weights.to(logits.dtype), "ids": ids.to(torch.int32)}
