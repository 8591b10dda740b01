"""The module ops, judged on the host: each module of the model the engine loaded against float64 math of its
definition with the model's own weights.

The probe fed every module of the loaded model seeded inputs (skupin/imagetools/probe/skupin_probe_ops.py
`module_plan`, `module_inputs`); the host regenerates the inputs and takes the weights from the fixture it generated
itself (gates/refdata/fixture.py, never from the image), so a fault that lives in one loaded model -- an expert
quantized at load, a norm, router, rotary table or attention patched on the instance, a weight the loader mangles --
is measured where it lives, named by layer and expert, with the op battery's measures (gates/judge/ops.py: rms, max
and bias in units of the dtype's rounding) and bounds of the same kind: hard bounds always, the class's calibrated
ones where its entry has them.

A router is judged in two parts so that the rounding of its logits (a correct engine may keep them in bfloat16 or
float32) does not hide its arithmetic: its logits against x @ G^T, then its weights and expert ids against the exact
softmax, top-k and renormalisation *of the logits it returned*.

An engine whose modules cannot be fed seeded inputs (llama.cpp: skupin/engines MODULE_INPUTS "captured") returns
each module's input and outputs as its own forward computed them (skupin_probe_ops.py CAPTURE_POSITIONS): the host
recomputes each module from that input (the embedding from the token ids it regenerates, attention and the rotary
embedding at the positions of the spec) with the same measures and hard bounds. The rotary embedding is judged as
applied to the layer-0 queries, in the GGUF's interleaved layout (gates/refdata/gguf.py permutes Q's rows); an
expert from the rows of the tokens its engine routed to it. A captured module op takes calibrated bounds only from
the engine's own entry (calibrated on its own forward; a class's were calibrated on the seeded inputs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from skupin.gates.judge.ops import (
    HARD,
    NEAR_TIE,
    TF32_ALLOWANCE,
    TF32_UNIT,
    UNIT,
    Battery,
    OpResult,
    measure,
    not_of_dtype,
    printable_text,
)
from skupin.gates.refdata.fixture import SPECS, config, weights
from skupin.gates.refdata.tensorio import bf16_round
from skupin.imagetools.probe import skupin_probe_ops as spec

# Hard (rms, max, bias) bounds per layer kind at a 16-bit dtype, in its units: the op battery's for the one-step
# kinds; a module of several products (attention, an expert's MLP) rounds to the dtype after each of them.
MODULE_HARD: dict[str, tuple[float, float, float]] = {
    "embed": (1e-3, 1e-3, 1e-3),  # a lookup: the stored rows exactly
    "rotary": HARD["rope.long"], "norm": HARD["rmsnorm"], "attention": (8.0, 48.0, 8.0),
    "router.logits": HARD["moe.route"], "router": HARD["moe.route"], "expert": (6.0, 48.0, 6.0),
    "mlp": (6.0, 48.0, 6.0), "moe": HARD["moe.block"], "lm_head": HARD["matmul"],
}


PRODUCTS = ("attention", "router.logits", "expert", "mlp", "moe", "lm_head")  # kinds whose float32 products TF32 takes


@dataclass(frozen=True)
class HostModel:
    """What the host knows of the model the gate serves: its config.json and its weights (bfloat16 values, float32)."""

    name: str
    config: dict[str, Any]
    weights: Mapping[str, np.ndarray]

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    def plan(self) -> list[tuple[str, str]]:
        return spec.module_plan(self.config)


@functools.lru_cache(maxsize=2)
def host_model(fixture: str) -> HostModel | None:
    """The HostModel of fixture `fixture` (generated here, bit for bit as shipped), or None for a model that is no
    fixture (its module ops cannot be judged: the check says so)."""
    if fixture not in SPECS:
        return None
    # stored as BF16 (gates/refdata/fixture.py): the weights the engine loads are their bfloat16 roundings, kept as
    # float32 (exact for them; the definitions compute in float64)
    found = {k: bf16_round(np.asarray(v, dtype=np.float32)) for k, v in weights(SPECS[fixture]).items()}
    for array in found.values():
        array.setflags(write=False)
    return HostModel(name=fixture, config=config(SPECS[fixture]), weights=found)


def hard_bounds(kind: str, dtype: str, model: HostModel, *, tf32: bool = False) -> dict[str, float]:
    """The hard bounds of a module op of `kind` at `dtype`: MODULE_HARD plus float32 accumulation over the op's longest
    reduction, and the rotary angle's size for the table and attention (p * inv_freq rounds to 2^-24 of itself). With
    TF32 declared (gate.reduced_precision) a float32 module of products may carry TF32's input rounding, as the
    battery's products may."""
    rms, mx, bias = MODULE_HARD[kind]
    c = model.config
    angle = float(max(spec.LONG[: spec.LT]))
    reduction = {"embed": 0.0, "rotary": float(max(spec.ROTARY_POSITIONS)), "norm": math.sqrt(model.hidden),
                 "attention": angle + math.sqrt(model.hidden * spec.LT), "router.logits": math.sqrt(model.hidden),
                 "router": 4.0, "expert": math.sqrt(model.hidden * int(c["intermediate_size"])),
                 "mlp": math.sqrt(model.hidden * int(c["intermediate_size"])),
                 "moe": math.sqrt(model.hidden * int(c["intermediate_size"])), "lm_head": math.sqrt(model.hidden)}[kind]
    cond = reduction * UNIT["float32"] / UNIT[dtype]
    bounds = {"rms": rms + 4 * cond, "max": mx + 16 * cond, "bias": bias + 4 * cond}
    if dtype == "float32" and tf32 and kind in PRODUCTS:
        units = TF32_UNIT / UNIT["float32"]
        bounds = {m: b + TF32_ALLOWANCE[m] * units for m, b in bounds.items()}
    return bounds


# ---------------------------------------------------------------- definitions in float64


def _inputs(key: str, kind: str, dtype: str, config: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: np.asarray(vals, dtype=np.float64).reshape(shape)
            for name, (shape, vals) in spec.module_inputs(key, kind, dtype, config).items()}


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _table(model: HostModel, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, head_dim] of the neox rotary embedding at `positions` with the model's base."""
    c = model.config
    head = int(c.get("head_dim") or model.hidden // int(c["num_attention_heads"]))
    theta = float((c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta") or 10000.0)
    inv = theta ** (-np.arange(0, head, 2, dtype=np.float64) / head)
    angle = positions[:, None] * inv[None, :]
    both = np.concatenate([angle, angle], -1)
    return np.cos(both), np.sin(both)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin[:, None, :]


def _attention(model: HostModel, p: str, x: np.ndarray, positions: np.ndarray,
               segments: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of rows `x` at `positions`; with `segments` (a sequence id per row) a row sees only the earlier
    rows of its own sequence."""
    c, w = model.config, model.weights
    heads, kv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    head = int(c.get("head_dim") or model.hidden // heads)
    t = x.shape[0]
    q = (x @ w[p + "q_proj.weight"].T).reshape(t, heads, head)
    k = (x @ w[p + "k_proj.weight"].T).reshape(t, kv, head)
    v = (x @ w[p + "v_proj.weight"].T).reshape(t, kv, head)
    cos, sin = _table(model, positions)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(head)
    mask = np.tril(np.ones((t, t), bool))
    if segments is not None:
        mask &= segments[:, None] == segments[None, :]
    scores = np.where(mask[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * head)
    return out @ w[p + "o_proj.weight"].T


def _rope_interleaved(model: HostModel, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The rotary embedding applied to query rows `x` [T, heads * head_dim] laid out as the GGUF stores them (each
    head's rows interleaved, gates/refdata/gguf.py permute): back to transformers' halves, rotated, and interleaved
    again, so the result is in the layout the engine returned."""
    c = model.config
    heads = int(c["num_attention_heads"])
    head = int(c.get("head_dim") or model.hidden // heads)
    t = x.shape[0]
    halves = x.reshape(t, heads, head // 2, 2).swapaxes(-1, -2).reshape(t, heads, head)
    cos, sin = _table(model, positions)
    return _rotate(halves, cos, sin).reshape(t, heads, 2, head // 2).swapaxes(-1, -2).reshape(t, heads * head)


def _segments(positions: np.ndarray) -> np.ndarray:
    """A sequence id per row: rows whose positions run on by one are one sequence."""
    return np.concatenate([[0], np.cumsum(np.diff(positions) != 1)])


def _captured_inputs(model: HostModel, key: str, kind: str, dtype: str,
                     got: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """The inputs of a captured module op -- the token ids and positions the host knows (the spec's), and the hidden
    states the engine's forward gave the module (its in_x) -- and '' or why they cannot be used."""
    found: dict[str, np.ndarray] = {}
    if kind == "embed":
        shape, vals = spec.module_inputs(key, kind, dtype, model.config)["ids"]
        found["ids"] = np.asarray(vals, dtype=np.float64).reshape(shape)
    else:
        c = model.config
        heads = int(c["num_attention_heads"])
        width = heads * int(c.get("head_dim") or model.hidden // heads) if kind == "rotary" else model.hidden
        shape = (len(spec.CAPTURE_POSITIONS), width)
        g = got.get("in_x")
        if g is None:
            return found, "no input in_x (the module's input as the engine's forward computed it)"
        if kind == "expert":  # the rows the engine routed to this expert (it computes an expert on those only)
            if g.ndim != 2 or g.shape[1] != width or not 1 <= g.shape[0] <= MAX_EXPERT_ROWS:
                return found, (f"input in_x has shape {list(g.shape)}, not [rows, {width}] with 1 to "
                               f"{MAX_EXPERT_ROWS} rows")
        elif tuple(g.shape) != shape:
            return found, f"input in_x has shape {list(g.shape)}, not {list(shape)}"
        if not np.isfinite(g.astype(np.float64)).all():
            return found, "NaN/Inf in input in_x"
        wrong = not_of_dtype(g, "float32")
        if wrong:
            return found, f"input in_x: {wrong}"
        found["x"] = np.asarray(g, dtype=np.float64)
    if kind in ("rotary", "attention"):
        found["positions"] = np.asarray(spec.CAPTURE_POSITIONS, dtype=np.float64)
    return found, ""


def _captured_note(calibrated: Mapping[str, float], rows: int | None = None) -> str:
    """What a captured module op was judged with: hard bounds, or also bounds calibrated on the engine's own forward
    (an engine-keyed entry's: the gate passes a captured engine no other entry's); `rows`: an expert's routed tokens."""
    routed = f" ({rows} tokens routed to it)" if rows is not None else ""
    return f"the engine's own forward: its input as captured{routed}, " + (
        "bounds calibrated on this engine's own forward" if calibrated else "hard bounds only")


# A captured expert's rows: those of the captured tokens its engine routed to it, never more than one per token.
MAX_EXPERT_ROWS = spec.CAPTURE_EXPERT_ROWS


def _route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(probs, ids, -1)
    return top / top.sum(-1, keepdims=True), ids


def _near_ties(logits: np.ndarray, k: int, dtype: str) -> np.ndarray:
    """Rows whose k-th and (k+1)-th logits are closer than NEAR_TIE units of the dtype (of the row's largest)."""
    if logits.shape[-1] <= k:  # every expert is chosen: no (k+1)-th to tie with
        return np.zeros(logits.shape[:-1], bool)
    ordered = -np.sort(-logits, axis=-1)
    return np.asarray(ordered[:, k - 1] - ordered[:, k] < NEAR_TIE * UNIT[dtype] * np.abs(logits).max(-1))


def _swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def reference(model: HostModel, key: str, kind: str, x: dict[str, np.ndarray], *,
              captured: bool = False) -> dict[str, np.ndarray]:
    """The float64 output of module op `key` on inputs `x` (the router's: its logits; its routing is judged on what the
    engine returned, see the module docstring); `captured`: inputs of the engine's own forward (the rotary embedding
    applied to its queries, attention per captured sequence)."""
    w, eps = model.weights, float(model.config.get("rms_norm_eps", 1e-5))
    if captured and kind in ("rotary", "attention"):
        return _captured_reference(model, key, kind, x)
    if kind == "embed":
        return {"out": w["model.embed_tokens.weight"][x["ids"].astype(np.int64)].astype(np.float64)}
    if kind == "rotary":
        cos, sin = _table(model, x["positions"])
        return {"cos": cos, "sin": sin}
    if key == "final_norm":
        return {"out": _rms(x["x"], w["model.norm.weight"], eps)}
    if key == "lm_head":
        return {"out": x["x"] @ w["lm_head.weight"].T}
    _, index, part, *rest = key.split(".")
    p = f"model.layers.{index}."
    m = p + "block_sparse_moe."
    if kind == "norm":
        name = "input_layernorm" if part == "input_norm" else "post_attention_layernorm"
        return {"out": _rms(x["x"], w[f"{p}{name}.weight"], eps)}
    if kind == "attention":
        return {"out": _attention(model, p + "self_attn.", x["x"], x["positions"])}
    if kind == "mlp":
        return {"out": _swiglu(x["x"], w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                               w[p + "mlp.down_proj.weight"])}
    if kind == "expert":
        e = f"{m}experts.{rest[0]}."
        return {"out": _swiglu(x["x"], w[e + "w1.weight"], w[e + "w3.weight"], w[e + "w2.weight"])}
    if kind == "router":
        return {"logits": x["x"] @ w[m + "gate.weight"].T}
    if kind == "moe":
        _, ids = _route(x["x"] @ w[m + "gate.weight"].T, int(model.config["num_experts_per_tok"]))
        return {"out": _moe_block(model, m, x["x"], ids)}
    raise KeyError(key)


def _captured_reference(model: HostModel, key: str, kind: str, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A captured forward's rotary embedding (applied to its queries) and attention (per captured sequence)."""
    if kind == "rotary":
        return {"out": _rope_interleaved(model, x["x"], x["positions"])}
    index = key.split(".")[1]
    return {"out": _attention(model, f"model.layers.{index}.self_attn.", x["x"], x["positions"],
                              _segments(x["positions"]))}


def _moe_block(model: HostModel, m: str, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The MoE block's output in float64 with each token routed to `ids` (its weights: the softmax of its logits over
    those experts, renormalised, as top-k then renormalisation gives)."""
    w = model.weights
    logits = x @ w[m + "gate.weight"].T
    chosen = np.take_along_axis(logits, ids, -1)
    top = np.exp(chosen - chosen.max(-1, keepdims=True))
    top /= top.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for slot in range(ids.shape[1]):
        for e in np.unique(ids[:, slot]):
            rows = ids[:, slot] == e
            ew = f"{m}experts.{e}."
            out[rows] += top[rows, slot, None] * _swiglu(x[rows], w[ew + "w1.weight"], w[ew + "w3.weight"],
                                                         w[ew + "w2.weight"])
    return out


def _moe_nearest(model: HostModel, key: str, x: np.ndarray, got: np.ndarray, dtype: str) -> tuple[dict[str, np.ndarray], int]:
    """The MoE block's reference where each near-tie token (its k-th and (k+1)-th exact logits within NEAR_TIE units)
    takes whichever of its two routings -- the exact top-k, or the same with the k-th expert swapped for the (k+1)-th
    -- is nearer to what the engine returned; and how many tokens were near-ties."""
    m = f"model.layers.{key.split('.')[1]}.block_sparse_moe."
    k = int(model.config["num_experts_per_tok"])
    logits = x @ model.weights[m + "gate.weight"].T
    order = np.argsort(-logits, axis=-1, kind="stable")
    exact = _moe_block(model, m, x, order[:, :k])
    ties = _near_ties(logits, k, dtype)
    if not ties.any():
        return {"out": exact}, 0
    swapped = order[:, :k].copy()
    swapped[:, k - 1] = order[:, k]
    other = _moe_block(model, m, x, swapped)
    nearer = ties & (np.abs(got - other).sum(-1) < np.abs(got - exact).sum(-1))
    return {"out": np.where(nearer[:, None], other, exact)}, int(ties.sum())


# ---------------------------------------------------------------- judging


def _usable(got: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]], dtype: str, *,
            stored: str = "") -> str:
    """'' or why the engine's outputs cannot be judged: one missing, misshaped or non-finite; a module's output (its
    `out`, rotary table or router logits) that is not values of the dtype it ran at (a module computed in float64 and
    stored as float32 is not the engine's module); expert ids that are not integers."""
    for name, shape in shapes.items():
        g = got.get(name)
        if g is None:
            return f"no output {name}"
        if tuple(g.shape) != tuple(shape):
            return f"output {name} has shape {list(g.shape)}, not {list(shape)}"
        if not np.isfinite(g.astype(np.float64)).all():
            return f"NaN/Inf in output {name}"
        if name == "ids" and not np.array_equal(g.astype(np.float64), np.round(g.astype(np.float64))):
            return "expert ids that are not integers"
        wrong = not_of_dtype(g, stored or dtype) if name in ("out", "cos", "sin", "logits") else ""
        if wrong:
            return f"output {name}: {wrong}"
    return ""


def judge_module(model: HostModel, key: str, kind: str, dtype: str, got: Mapping[str, np.ndarray],
                 calibrated: Mapping[str, Mapping[str, float]] | None = None, *, tf32: bool = False,
                 captured: bool = False) -> list[OpResult]:
    """One module op at `dtype`: the engine's outputs (`got`, by output name) against float64 with the model's weights
    (a router gives two results, see _judge_router), with the calibrated bounds of `calibrated` (key.dtype -> measure
    -> bound) where given. `captured`: the module's input is the engine's own (got["in_x"], see the module docstring),
    its outputs are float32 values (ggml keeps activations in F32) measured in units of `dtype`; `calibrated` must then
    come from the engine's own entry (the gate passes no other)."""
    if captured:
        x, problem = _captured_inputs(model, key, kind, dtype, got)
        if problem:
            return [OpResult(op=key, dtype=dtype, errors={}, nmse=None, hard=hard_bounds(kind, dtype, model, tf32=tf32),
                             problem=problem)]
    else:
        x = _inputs(key, kind, dtype, model.config)
    ref = reference(model, key, kind, x, captured=captured)
    hard = hard_bounds(kind, dtype, model, tf32=tf32)

    def result(**kw: Any) -> OpResult:
        return OpResult(op=key, dtype=dtype, hard=hard, calibrated=dict((calibrated or {}).get(f"{key}.{dtype}") or {}),
                        **kw)

    shapes = {name: r.shape for name, r in ref.items()}
    if kind == "router":
        k = int(model.config["num_experts_per_tok"])
        shapes |= {"weights": (spec.LT, k), "ids": (spec.LT, k)}
    problem = _usable(got, shapes, dtype, stored="float32" if captured else "")
    if problem:
        return [result(errors={}, nmse=None, problem=problem)] + ([
            OpResult(op=key + ".logits", dtype=dtype, errors={}, nmse=None, problem=problem,
                     hard=hard_bounds("router.logits", dtype, model, tf32=tf32))] if kind == "router" else [])
    if kind == "router":
        first, second = _judge_router(model, key, dtype, got, ref["logits"], result, tf32=tf32)
        logit_bounds = (calibrated or {}).get(f"{first.key}")
        first = replace(first, calibrated=dict(logit_bounds or {}))
        if captured:
            first, second = (replace(r, note=_captured_note(r.calibrated)) for r in (first, second))
        return [first, second]
    note = ""
    if kind == "moe":  # a token whose exact top-k is a near-tie is judged against the routing it is closest to
        ref, ties = _moe_nearest(model, key, x["x"], got["out"].astype(np.float64), dtype)
        note = f"{ties} of {spec.LT} tokens judged against the nearer of two routings (a near-tie at {dtype})" if ties else ""
    if captured:
        note = _captured_note(dict((calibrated or {}).get(f"{key}.{dtype}") or {}),
                              len(x["x"]) if kind == "expert" else None) + (f"; {note}" if note else "")
    errors = dict.fromkeys(("rms", "max", "bias"), 0.0)
    nmse = 0.0
    for name, r in ref.items():
        m, n = measure(got[name].astype(np.float64), r, UNIT[dtype])
        errors = {k2: max(errors[k2], m[k2]) for k2 in errors}
        nmse = max(nmse, n)
    return [result(errors=errors, nmse=nmse, note=note)]


def _judge_router(model: HostModel, key: str, dtype: str, got: Mapping[str, np.ndarray], logits_ref: np.ndarray,
                  result: Callable[..., OpResult], *, tf32: bool = False) -> list[OpResult]:
    """The router as two results: `<key>.logits` against x @ G^T (a product's bounds), and `<key>` -- its expert ids
    against the exact top-k of x @ G^T and against the top-k of the logits it returned, and its weights against the
    exact softmax of its own logits over the experts it chose, renormalised (so the rounding of its logits does not
    hide its arithmetic). Every token is judged: where the exact k-th and (k+1)-th logits are a near-tie (the host's
    call, from the exact logits), either of the two is accepted."""
    k = int(model.config["num_experts_per_tok"])
    logits = got["logits"].astype(np.float64)
    ids = got["ids"].astype(np.int64)
    m_logits, n_logits = measure(logits, logits_ref, UNIT[dtype])
    first = OpResult(op=key + ".logits", dtype=dtype, errors=m_logits, nmse=n_logits,
                     hard=hard_bounds("router.logits", dtype, model, tf32=tf32))
    experts = logits_ref.shape[-1]
    chosen = np.sort(ids, -1)
    if ids.min() < 0 or ids.max() >= experts or (chosen[:, 1:] == chosen[:, :-1]).any():
        return [first, result(errors={}, nmse=None,
                              problem=f"expert ids that are not {k} distinct ids in [0, {experts}) per token")]
    off = ~_top_k_either(chosen, logits_ref, k, _near_ties(logits_ref, k, dtype))
    if off.any():
        return [first, result(errors={}, nmse=None,
                              problem=f"routed {int(off.sum())} of {len(ids)} tokens to other experts than the exact "
                                      f"top-{k}")]
    own = np.sort(logits, -1)[:, ::-1]
    if (~_top_k_either(chosen, logits, k, own[:, k - 1] == own[:, k])).any():
        return [first, result(errors={}, nmse=None, problem="expert ids that are not the top-k of its own logits")]
    picked = np.take_along_axis(logits, ids, -1)
    expected = np.exp(picked - picked.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    m_weights, n_weights = measure(got["weights"].astype(np.float64), expected, UNIT[dtype])
    return [first, result(errors=m_weights, nmse=n_weights)]


def _top_k_either(chosen: np.ndarray, logits: np.ndarray, k: int, tied: np.ndarray) -> np.ndarray:
    """Per token: whether the sorted ids `chosen` are the top-k of `logits`, or, where `tied`, that set with its k-th
    expert swapped for the (k+1)-th."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    exact = np.sort(order[:, :k], -1)
    swapped = order[:, :k].copy()
    swapped[:, k - 1] = order[:, k]
    return (chosen == exact).all(-1) | (tied & (chosen == np.sort(swapped, -1)).all(-1))


def captured_moe_consistency(tensors: Mapping[str, np.ndarray], model: HostModel, dtype: str) -> list[OpResult]:
    """One failing result (op layer.N.capture) per MoE layer whose captured tensors contradict each other. The module
    ops are each judged on their own input; these tie them to one forward, so an image cannot pass a layer with rows
    it made up for one module: the router's and the block's inputs are the post-attention norm's output (one graph
    tensor); its rows are normalised rows (rms of input / norm weight within 0.5-2: not zeros, not tiny); each expert's
    first rows are the block's tokens the router routed to it, in order, and every row of it (the extra tokens' too)
    is a normalised row the exact router sends to it (either of a near-tie); the block's output is the routing weights
    times those experts' outputs, summed in slot order in float32 as ggml sums them (to a float32 rounding of the
    terms). A layer whose tensors are absent or misshapen is left to its modules' own checks."""
    c = model.config
    experts, k = int(c.get("num_local_experts") or 0), int(c.get("num_experts_per_tok") or 0)
    found: list[OpResult] = []
    for i in range(int(c["num_hidden_layers"]) if experts else 0):
        def get(module: str, name: str, i: int = i) -> np.ndarray | None:
            value = tensors.get(f"ops.layer.{i}.{module}.{dtype}.{name}")
            return None if value is None else np.asarray(value)

        post, r_in, m_in = get("post_norm", "out"), get("router", "in_x"), get("moe", "in_x")
        ids, weights, out = get("router", "ids"), get("router", "weights"), get("moe", "out")
        if any(v is None for v in (post, r_in, m_in, ids, weights, out)):
            continue
        assert post is not None and r_in is not None and m_in is not None
        assert ids is not None and weights is not None and out is not None
        try:
            problem = _moe_layer_problem(model, i, post, r_in, m_in, ids.astype(np.float64), weights, out,
                                         {e: (get(f"expert.{e}", "in_x"), get(f"expert.{e}", "out"))
                                          for e in range(experts)}, k, dtype)
        except (ValueError, IndexError, TypeError) as exc:
            problem = f"its captured tensors do not fit together ({type(exc).__name__}: {printable_text(str(exc), 120)})"
        if problem:
            found.append(OpResult(op=f"layer.{i}.capture", dtype=dtype, errors={}, nmse=None, hard={},
                                  problem=f"not one forward: {problem}"))
    return found


def _moe_layer_problem(model: HostModel, i: int, post: np.ndarray, r_in: np.ndarray, m_in: np.ndarray,
                       ids: np.ndarray, weights: np.ndarray, out: np.ndarray,
                       per_expert: Mapping[int, tuple[np.ndarray | None, np.ndarray | None]], k: int,
                       dtype: str) -> str:
    """'' or what contradicts in one captured MoE layer (captured_moe_consistency)."""
    if not (np.array_equal(post, r_in) and np.array_equal(r_in, m_in)):
        return "the router's and the block's inputs are not the post-attention norm's output (ffn_norm-N)"
    if not np.isfinite(ids).all() or not np.array_equal(ids, np.round(ids)):
        return "router ids that are not integers"
    if ids.shape != (len(out), k) or weights.shape != ids.shape:
        return f"router ids and weights of shape {list(ids.shape)}, {list(weights.shape)}, not [{len(out)}, {k}]"
    whole = ids.astype(np.int64)
    norm = model.weights[f"model.layers.{i}.post_attention_layernorm.weight"].astype(np.float64)
    if not _normalised(r_in, norm):
        return "rows of the block's input that are not normalised (rms of input / norm weight outside 0.5-2)"
    gate = model.weights[f"model.layers.{i}.block_sparse_moe.gate.weight"].astype(np.float64)
    for e, (x_e, out_e) in per_expert.items():
        problem = _expert_rows_problem(e, x_e, out_e, whole, r_in, norm, gate, k, dtype)
        if problem:
            return problem
    return _block_sum_problem(whole, weights, out, per_expert, k)


def _normalised(rows: np.ndarray, norm: np.ndarray) -> bool:
    """Whether `rows` are an RMSNorm's output with weight `norm`: the rms of row / weight about 1 (0.5-2)."""
    used = np.abs(norm) > 0
    unit = np.sqrt(np.mean((rows.astype(np.float64)[:, used] / norm[used]) ** 2, axis=-1))
    return bool(((unit > 0.5) & (unit < 2.0)).all())


def _expert_rows_problem(e: int, x_e: np.ndarray | None, out_e: np.ndarray | None, ids: np.ndarray, r_in: np.ndarray,
                         norm: np.ndarray, gate: np.ndarray, k: int, dtype: str) -> str:
    """'' or why expert `e`'s captured rows are not the forward's: its first rows must be the block's tokens the router
    sent it, in order, and every row (the extra tokens' too) a normalised row the exact router sends to it (either of a
    near-tie). An expert that returned no rows, or more than a capture has, is its own check's to report."""
    if x_e is None or out_e is None or x_e.ndim != 2 or not 0 < len(x_e) <= MAX_EXPERT_ROWS:
        return ""  # its own check says what is wrong (and nothing here computes on more rows than a capture has)
    routed = np.nonzero((ids == e).any(-1))[0]
    if len(x_e) < len(routed) or len(out_e) != len(x_e):
        return f"expert {e} does not hold a row for each of the {len(routed)} tokens routed to it"
    if not np.array_equal(x_e[:len(routed)], r_in[routed]):
        return f"expert {e}'s first rows are not the block's tokens routed to it, in order"
    if not _normalised(x_e, norm):
        return f"rows of expert {e}'s input that are not normalised (rms of input / norm weight outside 0.5-2)"
    logits = x_e.astype(np.float64) @ gate.T
    if logits.shape[1] <= k:  # every expert is chosen for every token
        return ""
    order = np.argsort(-logits, axis=-1, kind="stable")
    if not ((order[:, :k] == e).any(-1) | (_near_ties(logits, k, dtype) & (order[:, k] == e))).all():
        return f"rows of expert {e}'s input that the router does not send to expert {e}"
    return ""


def _block_sum_problem(ids: np.ndarray, weights: np.ndarray, out: np.ndarray,
                       per_expert: Mapping[int, tuple[np.ndarray | None, np.ndarray | None]], k: int) -> str:
    """'' or why the block's output is not its experts' outputs times the routing weights, summed as ggml sums them:
    each slot's product in float32, added in slot order (to a float32 rounding of the terms)."""
    expected = np.zeros(out.shape, np.float32)
    slack = np.zeros(out.shape, np.float64)
    for slot in range(k):
        for e in np.unique(ids[:, slot]):
            x_e, out_e = per_expert.get(int(e), (None, None))
            routed = np.nonzero((ids == e).any(-1))[0]
            if out_e is None or out_e.ndim != 2 or len(out_e) < len(routed) or out_e.shape[1:] != out.shape[1:]:
                return f"expert {int(e)} does not hold a row for each of the {len(routed)} tokens routed to it"
            rows = ids[:, slot] == e
            term = (out_e[np.searchsorted(routed, np.nonzero(rows)[0])].astype(np.float32)
                    * weights[rows, slot, None].astype(np.float32))
            expected[rows] = expected[rows] + term
            slack[rows] += np.abs(term.astype(np.float64))
    # ggml's order gives the same bits; a backend that fuses or reorders the k-term sum stays within k+1 roundings
    if (np.abs(expected.astype(np.float64) - out.astype(np.float64)) > max(4, k + 1) * 2.0**-24 * slack + 1e-30).any():
        return "the block's output is not the routing weights times its experts' outputs"
    return ""


def judge_modules(tensors: Mapping[str, np.ndarray], report: Mapping[str, Any], model: HostModel, *,
                  dtype: str, calibrated: Mapping[str, Mapping[str, float]] | None = None,
                  tf32: bool = False, captured: bool = False) -> list[OpResult]:
    """Every module op of the model's plan the probe ran at `dtype` (its report's checks.ops.modules.ops), in plan order;
    one the engine could not run is a problem. Keys the probe returned that are not in the plan are ignored.
    `captured`: the engine's declaration (never the report's) that each module's input is its own (in_x)."""
    rows = report.get("ops")
    found: Mapping[str, Any] = rows if isinstance(rows, dict) else {}
    results = []
    for key, kind in model.plan():
        row = found.get(f"{key}.{dtype}")
        if row is None:
            continue
        if not isinstance(row, dict) or row.get("status") != "ok":
            error = printable_text(row.get("error") if isinstance(row, dict) else row)
            for op, hard_kind in [(key, kind)] + ([(key + ".logits", "router.logits")] if kind == "router" else []):
                results.append(OpResult(op=op, dtype=dtype, errors={}, nmse=None,
                                        hard=hard_bounds(hard_kind, dtype, model, tf32=tf32),
                                        calibrated=dict((calibrated or {}).get(f"{op}.{dtype}") or {}),
                                        problem=f"the engine's module failed: {error}"))
            continue
        names = (*spec.CAPTURED_OUTPUTS[kind], "in_x") if captured else spec.MODULE_OUTPUTS[kind]
        got = {n: np.asarray(tensors[f"ops.{key}.{dtype}.{n}"]) for n in names if f"ops.{key}.{dtype}.{n}" in tensors}
        results += judge_module(model, key, kind, dtype, got, calibrated=calibrated, tf32=tf32, captured=captured)
    return results + (captured_moe_consistency(tensors, model, dtype) if captured else [])


def missing_modules(results: list[OpResult], model: HostModel, *, dtype: str,
                    uncovered: Mapping[str, Any] | None = None) -> list[str]:
    """<key>.<dtype> of every module op of the plan the candidate did not return (what the image calls unreachable
    does not excuse it: the engine's declaration, skupin/engines MODULES, says its adapter reaches every module), with
    the image's own account of why where it gave one (shown, not trusted)."""
    ran = {r.key for r in results}
    why = {str(k): printable_text(v, 120) for k, v in (uncovered or {}).items()}
    return [f"{key}.{dtype}" + (f" (the probe says: {why[key]})" if key in why else "")
            for key, _ in model.plan() if f"{key}.{dtype}" not in ran]


def with_modules(battery: Battery, tensors: Mapping[str, np.ndarray], report: Mapping[str, Any], model: HostModel, *,
                 dtypes: tuple[str, ...], calibrated: Mapping[str, Mapping[str, float]] | None = None,
                 tf32: bool = False, captured: bool = False) -> Battery:
    """`battery` with the module ops of the probe's ops report (its `modules`) judged at `dtypes` and added to its
    results; a modules report that failed as a whole, or none, adds one failing result naming why. `captured`: the
    engine's modules were captured from its own forward (judge_modules)."""
    modules = report.get("modules")
    if not isinstance(modules, dict) or modules.get("status") != "ok":
        why = printable_text(modules.get("error") if isinstance(modules, dict) else "the probe returned no module ops")
        failed = OpResult(op="modules", dtype=dtypes[0], errors={}, nmse=None, hard={},
                          problem=f"the engine's model could not be probed module by module: {why}")
        return Battery(results=(*battery.results, failed), uncovered=battery.uncovered)
    results = [r for dtype in dtypes
               for r in judge_modules(tensors, modules, model, dtype=dtype, calibrated=calibrated, tf32=tf32,
                                      captured=captured)]
    return Battery(results=(*battery.results, *results), uncovered=battery.uncovered)
