"""The engine op battery, judged on the host: every op's definition in float64 against what the image's engine computed.

The probe ran the engine's own implementation of each op (skupin/imagetools/probe/skupin_probe_ops.py) on inputs
this module regenerates from the same spec, bit for bit; nothing computed inside the image is trusted but the
outputs themselves. Each output is measured in the units of its dtype's rounding u (bfloat16 2^-8, float16 2^-11,
float32 2^-24):

- rms error: sqrt(NMSE) / u, NMSE = sum((y - r)^2) / sum(r^2) (llama.cpp's test-backend-ops measure, in units);
- max error: max_i |y_i - r_i| / (u * max(|r_i|, rms(r))) (elementwise, floored at the output's rms scale so an
  output near zero cannot dominate);
- bias: the largest, over the output's rows (its last axis), |sum(d * r)| / (u * sum(r^2)): the part of the error
  that is a scale of the row. Honest rounding is uncorrelated with the value and averages out over a row; a
  normaliser computed in low precision (an RMSNorm variance, a softmax sum) scales the whole row.

Two kinds of bound. Hard bounds (HARD, CONDITION) need no calibration: what any correct kernel can reach, rounding
to its dtype a few times with float32 accumulation, whose error grows with the op's conditioning (the reduction
length, a rotary angle's size); a non-finite or misshaped output, wrong expert ids, a table in low precision or a
float32 product in TF32 (~2^13 float32 units, named as such) fail them. Calibrated bounds (the tolerance entry's
`ops`, margin x the class's honest maximum: OP_MARGINS) catch what sits inside the hard bounds: a missing upcast or
a bf16 accumulation moves rms or bias 1.2-15x above the class's honest value (docs/GATE.md "The engine op battery").
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from skupin.gates.judge.tolerance import MODULE_MARGINS, OP_MARGINS
from skupin.gates.judge.verdict import CALIBRATION_FREE, CheckResult
from skupin.gates.refdata.tensorio import bf16_round
from skupin.imagetools.probe import skupin_probe_ops as spec

UNIT = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
TF32_UNIT = 2.0**-11  # TF32 keeps 10 explicit mantissa bits of each product's inputs
MEASURES = ("rms", "max", "bias")
# Hard (rms, max, bias) bounds of a correct kernel at a 16-bit dtype, in units: a few roundings to the dtype, wide
# enough for every honest implementation measured (transformers' eager attention rounds its probabilities to the
# dtype before the value product: rms 2.7, bias 4.0 at decode on the CPU; docs/GATE.md "The engine op battery").
HARD: dict[str, tuple[float, float, float]] = {
    "rmsnorm": (2.0, 6.0, 1.0), "add_rmsnorm": (2.0, 6.0, 1.0), "silu_mul": (2.0, 6.0, 2.0),
    "rope.short": (2.0, 8.0, 2.0), "rope.long": (2.0, 8.0, 2.0), "attention.prefill": (6.0, 24.0, 8.0),
    "attention.decode": (6.0, 24.0, 8.0), "moe.route": (2.0, 6.0, 2.0), "moe.block": (6.0, 48.0, 6.0),
    "matmul": (2.0, 6.0, 1.0),
}
# How far float32 accumulation and angle rounding move a correct float32 result, in float32 units: ~sqrt(K) for a
# K-term reduction, |angle| for a rotary embedding computed in float32 (p * inv_freq rounds to 2^-24 of itself).
CONDITION: dict[str, float] = {
    "rmsnorm": math.sqrt(spec.H), "add_rmsnorm": math.sqrt(spec.H), "silu_mul": 4.0, "rope.short": float(spec.T),
    "rope.long": float(max(spec.LONG)), "attention.prefill": math.sqrt(spec.HD * spec.TP),
    "attention.decode": math.sqrt(spec.HD * spec.LD), "moe.route": 4.0,
    "moe.block": math.sqrt(spec.HM * spec.IM), "matmul": math.sqrt(spec.MK),
}
# Calibrated bound = margin x the class's largest honest value, per measure: OP_MARGINS for an op of the battery,
# MODULE_MARGINS for a module op (both in gates/judge/tolerance.py, which also reads them back: within_ruler).
# ... and never under a quarter of the module's hard bound: one host's runs are bit-identical, so 2x its value would
# hold another CPU's kernel blocking (AVX2, AMX) to this host's rounding (an honest lm_head moved 2.3x between this
# CPU and the H200 at float32)
MODULE_FLOOR = 0.25
OP_FLOORS = {"rms": 0.1, "max": 0.5, "bias": 0.1}
TF32_ALLOWANCE = {"rms": 2.0, "max": 16.0, "bias": 4.0}  # in TF32 roundings, for a SKU that declares TF32
REDUCED_FP32 = ("matmul", "attention.prefill", "attention.decode", "moe.block")  # float32 products TF32 would take
NEAR_TIE = 8.0  # moe.block rows whose 2nd and 3rd router logits are closer than this many units are left out


@dataclass(frozen=True)
class OpResult:
    """One op at one dtype: its error in the dtype's units against float64 and its bound."""

    op: str
    dtype: str
    errors: dict[str, float]  # measure (MEASURES) -> error in units; empty when the op could not be compared
    nmse: float | None
    hard: dict[str, float]  # measure -> hard bound
    calibrated: dict[str, float] = field(default_factory=dict)  # measure -> calibrated bound (empty: none)
    problem: str = ""
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.op}.{self.dtype}"

    def ratios(self, bounds: dict[str, float]) -> dict[str, float]:
        return {m: self.errors[m] / b for m, b in bounds.items() if m in self.errors and b > 0}

    @property
    def hard_ratio(self) -> float:
        """The worst error / hard bound (inf when the op could not be compared)."""
        return math.inf if self.problem or not self.errors else max(self.ratios(self.hard).values())

    @property
    def ratio(self) -> float:
        """The worst error / bound over both kinds of bound (inf when the op could not be compared)."""
        if self.problem or not self.errors:
            return math.inf
        return max([self.hard_ratio, *self.ratios(self.calibrated).values()])

    @property
    def failed(self) -> bool:
        return self.ratio > 1.0

    def worst(self) -> str:
        """The measure and bound that decided, as text."""
        if self.problem:
            return self.problem
        kind, bounds = max((("hard", self.hard), ("calibrated", self.calibrated)),
                           key=lambda kb: max(self.ratios(kb[1]).values(), default=0.0))
        m, r = max(self.ratios(bounds).items(), key=lambda mr: mr[1])
        return f"{m} error {self.errors[m]:.3g} units of {self.dtype} rounding vs {kind} bound {bounds[m]:.3g} ({r:.3g}x)"

    def row(self) -> dict[str, Any]:
        return {**{f"{m}_units": _r(v) for m, v in self.errors.items()}, "nmse": _r(self.nmse),
                "hard": {m: _r(v) for m, v in self.hard.items()},
                **({"calibrated": {m: _r(v) for m, v in self.calibrated.items()}} if self.calibrated else {}),
                "ratio": _r(self.ratio),
                **({"problem": self.problem} if self.problem else {}), **({"note": self.note} if self.note else {})}


@dataclass(frozen=True)
class Battery:
    """The whole battery of one run: each op's result, and the engine path's ops it did not reach (with why)."""

    results: tuple[OpResult, ...]
    uncovered: dict[str, str] = field(default_factory=dict)

    def failures(self) -> list[OpResult]:
        return sorted((r for r in self.results if r.failed), key=lambda r: -r.ratio)


@functools.cache
def spec_sha256(*, captured: bool = False) -> str:
    """sha256 of the battery's spec as the host regenerates it: every op's inputs at every dtype, bit for bit, and the
    constants of its definitions, with the module ops' spec (gates/judge/modules.py). A calibrated `ops` table records
    it (ToleranceEntry.ops_spec); bounds calibrated on other inputs are not applied. `captured`: the spec of module
    ops captured from an engine's own forward (tolerance.py: captured_ops), which also hashes what that forward is fed
    (the capture's positions and segments, the experts' extra token ids)."""
    h = hashlib.sha256()
    h.update(json.dumps({"EPS": spec.EPS, "THETA": spec.THETA, "TOPK": spec.TOPK, "LONG": spec.LONG,
                         "OUTPUTS": spec.OUTPUTS}, sort_keys=True).encode())
    # the module ops' spec too (their bounds live in the same table): its version, sizes and outputs, and the inputs
    # the generator gives a small model of every module kind (a generator change shows here)
    probe = {"num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1, "hidden_size": 8,
             "vocab_size": 97}
    h.update(json.dumps({"MODULES_VERSION": spec.MODULES_VERSION, "LT": spec.LT, "ROTARY": spec.ROTARY_POSITIONS,
                         "MODULE_OUTPUTS": spec.MODULE_OUTPUTS,
                         "inputs": [spec.module_inputs(key, kind, dtype, probe) for key, kind in spec.module_plan(probe)
                                    for dtype in UNIT]}, sort_keys=True).encode())
    for op in spec.OPS:
        for dtype in UNIT:
            for name, array in sorted(host_inputs(op, dtype).items()):
                h.update(f"{op}.{dtype}.{name}{array.shape}".encode())
                h.update(np.ascontiguousarray(array, dtype="<f8").tobytes())
    if captured:
        h.update(json.dumps({"CAPTURE_SEGMENTS": spec.CAPTURE_SEGMENTS, "CAPTURE_POSITIONS": spec.CAPTURE_POSITIONS,
                             "CAPTURED_OUTPUTS": spec.CAPTURED_OUTPUTS,
                             "CAPTURE_EXPERT_SEGMENTS": spec.CAPTURE_EXPERT_SEGMENTS,
                             "experts": [spec.expert_capture_ids(dtype, probe) for dtype in UNIT]},
                            sort_keys=True).encode())
    return h.hexdigest()


def hard_bounds(op: str, dtype: str, *, tf32: bool = False) -> dict[str, float]:
    """The hard (rms, max, bias) bounds of `op` at `dtype` in that dtype's units. At float32 the conditioning
    dominates; with TF32 declared (gate.reduced_precision) a float32 product may carry TF32's input rounding."""
    rms, mx, bias = HARD[op]
    cond = CONDITION[op] * UNIT["float32"] / UNIT[dtype]
    bounds = {"rms": rms + 4 * cond, "max": mx + 16 * cond, "bias": bias + 4 * cond}
    if dtype == "float32" and tf32 and op in REDUCED_FP32:
        # TF32 on the H200 measured rms <= 1.2, max <= 10.4, bias <= 2.2 TF32 roundings; bfloat16 products, rms ~4.4
        units = TF32_UNIT / UNIT["float32"]
        bounds = {m: b + TF32_ALLOWANCE[m] * units for m, b in bounds.items()}
    return bounds


# ---------------------------------------------------------------- inputs and definitions in float64


@functools.cache
def host_inputs(op: str, dtype: str) -> dict[str, np.ndarray]:
    """The inputs the probe fed `op` at `dtype`, exactly, as float64 arrays (the spec's integer hashing). Made once per
    process (spec_sha256 and every judgement read the same arrays; they are read-only)."""
    out = {name: np.asarray(vals, dtype=np.float64).reshape(shape) for name, (shape, vals) in spec.inputs(op, dtype).items()}
    for array in out.values():
        array.setflags(write=False)
    return out


def _rmsnorm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + spec.EPS) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [T, heads, HD] rotated in the neox layout at `positions`."""
    half = spec.HD // 2
    inv = spec.THETA ** (-np.arange(0, spec.HD, 2, dtype=np.float64) / spec.HD)
    angle = positions[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angle, angle], -1))[:, None, :], np.sin(np.concatenate([angle, angle], -1))[:, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [NH, Tq, HD], k/v [NKV, Tk, HD]; causal when Tq == Tk > 1."""
    groups = q.shape[0] // k.shape[0]
    kk, vv = np.repeat(k, groups, axis=0), np.repeat(v, groups, axis=0)
    scores = q @ kk.transpose(0, 2, 1) / math.sqrt(spec.HD)
    tq, tk = q.shape[1], k.shape[1]
    if tq == tk and tq > 1:
        scores = np.where(np.tril(np.ones((tq, tk), bool))[None], scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    return (p / p.sum(-1, keepdims=True)) @ vv


def _route(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, : spec.TOPK]
    w = np.take_along_axis(probs, ids, -1)
    return w / w.sum(-1, keepdims=True), ids


def reference(op: str, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The op's definition in float64 on its inputs `x`."""
    if op == "rmsnorm":
        return {"out": _rmsnorm(x["x"], x["weight"])}
    if op == "add_rmsnorm":
        s = x["x"] + x["residual"]
        return {"out": _rmsnorm(s, x["weight"]), "residual": s}
    if op == "silu_mul":
        g, u = np.split(x["x"], 2, axis=-1)
        return {"out": _silu(g) * u}
    if op.startswith("rope."):
        return {"q": _rope(x["q"], x["positions"]), "k": _rope(x["k"], x["positions"])}
    if op.startswith("attention."):
        return {"out": _attention(x["q"], x["k"], x["v"])}
    if op == "moe.route":
        w, ids = _route(x["logits"])
        return {"weights": w, "ids": ids.astype(np.float64)}
    if op == "moe.block":
        logits = x["x"] @ x["gate"].T
        w, ids = _route(logits)
        out = np.zeros_like(x["x"])
        for t in range(x["x"].shape[0]):
            for slot in range(spec.TOPK):
                e = ids[t, slot]
                hidden = _silu(x["x"][t] @ x["w1"][e].T) * (x["x"][t] @ x["w3"][e].T)
                out[t] += w[t, slot] * (hidden @ x["w2"][e].T)
        return {"out": out}
    if op == "matmul":
        return {"out": x["x"] @ x["weight"].T}
    raise KeyError(op)


def _unusable(candidate: dict[str, np.ndarray], ref: dict[str, np.ndarray], dtype: str) -> str:
    """'' or why the candidate's outputs cannot be compared: one missing, misshaped, non-finite or not of its dtype."""
    for name, r in ref.items():
        got = candidate.get(name)
        if got is None:
            return f"no output {name}"
        if tuple(got.shape) != tuple(r.shape):
            return f"output {name} has shape {list(got.shape)}, not {list(r.shape)}"
        if not np.isfinite(got.astype(np.float64)).all():
            return f"NaN/Inf in output {name}"
        wrong = not_of_dtype(got, "ids" if name == "ids" else dtype)
        if wrong:
            return f"output {name}: {wrong}"
    return ""


def not_of_dtype(values: np.ndarray, dtype: str) -> str:
    """'' or why `values` are not what an op at `dtype` returns: values of that dtype (an op computed in float64 and
    stored as float32 is not a bfloat16 kernel), or, for expert ids, integers in [0, E)."""
    v = values.astype(np.float64)
    if dtype == "ids":
        return "" if (np.all(v == np.round(v)) and v.min() >= 0 and v.max() < spec.E) else \
            f"expert ids that are not integers in [0, {spec.E})"
    if dtype == "bfloat16":
        exact = bf16_round(v.astype(np.float32)).astype(np.float64)
    elif dtype == "float16":
        exact = v.astype(np.float16).astype(np.float64)
    else:
        exact = v.astype(np.float32).astype(np.float64)
    return "" if np.array_equal(exact, v) else f"values that are not {dtype} values"


def tied_rows(x: dict[str, np.ndarray], dtype: str) -> np.ndarray:
    """moe.block's rows whose router choice the dtype's rounding may flip: the k-th and (k+1)-th logits closer than
    NEAR_TIE units of the dtype (of the row's largest logit)."""
    logits = x["x"] @ x["gate"].T
    ordered = -np.sort(-logits, axis=-1)
    gap = ordered[:, spec.TOPK - 1] - ordered[:, spec.TOPK]
    return np.asarray(gap < NEAR_TIE * UNIT[dtype] * np.abs(logits).max(-1))


# ---------------------------------------------------------------- measuring and judging


def measure(y: np.ndarray, r: np.ndarray, unit: float) -> tuple[dict[str, float], float]:
    """({rms, max, bias} in units, NMSE) of `y` against `r` (see the module docstring)."""
    d = y.astype(np.float64) - r
    ref2 = float((r * r).sum())
    nmse = float((d * d).sum()) / ref2 if ref2 > 0 else float((d * d).sum())
    if not d.size:
        return {"rms": 0.0, "max": 0.0, "bias": 0.0}, 0.0
    rms = math.sqrt(float((r * r).mean()))
    floor = np.maximum(np.abs(r), rms if rms > 0 else 1.0)
    rows_d, rows_r = d.reshape(-1, d.shape[-1]), r.reshape(-1, r.shape[-1])
    bias = np.abs((rows_d * rows_r).sum(-1)) / np.maximum((rows_r * rows_r).sum(-1), np.finfo(np.float64).tiny)
    return {"rms": math.sqrt(nmse) / unit, "max": float((np.abs(d) / (unit * floor)).max()),
            "bias": float(bias.max()) / unit}, nmse


def judge_op(op: str, dtype: str, candidate: dict[str, np.ndarray], *, tf32: bool = False,
             calibrated: Mapping[str, float] | None = None) -> OpResult:
    """One op at one dtype: the candidate's outputs (ops.<op>.<dtype>.<output>, float) against float64, with its
    hard bounds and, when given, the class's calibrated ones."""
    x = host_inputs(op, dtype)
    ref = reference(op, x)

    def result(**kw: Any) -> OpResult:
        return OpResult(op=op, dtype=dtype, hard=hard_bounds(op, dtype, tf32=tf32), calibrated=dict(calibrated or {}),
                        **kw)

    problem = _unusable(candidate, ref, dtype)
    if problem:
        return result(errors={}, nmse=None, problem=problem)
    note = ""
    keep = np.ones(next(iter(ref.values())).shape[0], bool)
    if op == "moe.route":  # the top-k as a set per token (an engine may return it unsorted), weights in id order
        cand_ids, ref_ids = candidate["ids"].astype(np.int64), ref["ids"].astype(np.int64)
        c_order, r_order = np.argsort(cand_ids, axis=-1), np.argsort(ref_ids, axis=-1)
        cand_ids, ref_ids = np.take_along_axis(cand_ids, c_order, -1), np.take_along_axis(ref_ids, r_order, -1)
        routed = int((cand_ids != ref_ids).any(-1).sum())
        if routed:
            return result(errors={}, nmse=None,
                          problem=f"routed {routed} of {len(keep)} tokens to other experts than the exact top-{spec.TOPK}")
        candidate = {**candidate, "weights": np.take_along_axis(candidate["weights"], c_order, -1)}
        ref = {**ref, "weights": np.take_along_axis(ref["weights"], r_order, -1)}
    if op == "moe.block":
        keep = ~tied_rows(x, dtype)
        if not keep.all():
            note = f"{int((~keep).sum())} of {len(keep)} tokens left out: their router choice is a near-tie at {dtype}"
    errors, nmse = dict.fromkeys(MEASURES, 0.0), 0.0
    for name, r in ref.items():
        if name == "ids":
            continue
        m, n = measure(candidate[name].astype(np.float64)[keep], r[keep], UNIT[dtype])
        errors = {k: max(errors[k], m[k]) for k in MEASURES}
        nmse = max(nmse, n)
    return result(errors=errors, nmse=nmse, note=note)


def judge_battery(tensors: dict[str, np.ndarray], report: dict[str, Any], *, tf32: bool = False,
                  calibrated: Mapping[str, Mapping[str, float]] | None = None,
                  dtypes: tuple[str, ...] | None = None) -> Battery:
    """Every op the probe ran (its report's checks.ops.ops) against float64, with the calibrated bounds of
    `calibrated` (op.dtype -> measure -> bound) where given; an op the probe could not run is a problem, and the ops
    the adapter did not reach are carried over as uncovered."""
    found = report.get("ops")
    rows: dict[str, Any] = found if isinstance(found, dict) else {}
    results = []
    for key, row in sorted(rows.items()):
        op, _, dtype = str(key).rpartition(".")
        if op not in spec.OUTPUTS or dtype not in UNIT or (dtypes is not None and dtype not in dtypes):
            continue  # only the battery's ops at the dtypes the gate runs are judged (others are the image's noise)
        bounds = (calibrated or {}).get(key)
        if not isinstance(row, dict) or row.get("status") != "ok":
            error = printable_text(row.get("error") if isinstance(row, dict) else row)
            results.append(OpResult(op=op, dtype=dtype, errors={}, nmse=None, hard=hard_bounds(op, dtype, tf32=tf32),
                                    calibrated=dict(bounds or {}), problem=f"the engine's op failed: {error}"))
            continue
        got = {name: tensors[f"ops.{key}.{name}"] for name in spec.OUTPUTS[op] if f"ops.{key}.{name}" in tensors}
        results.append(judge_op(op, dtype, got, tf32=tf32, calibrated=bounds))
    listed = report.get("uncovered")
    uncovered: dict[str, Any] = listed if isinstance(listed, dict) else {}
    return Battery(results=tuple(results),
                   uncovered={k: printable_text(v) for k, v in uncovered.items() if k in spec.OUTPUTS})


def printable_text(value: Any, limit: int = 300) -> str:
    """Text the image wrote, shortened and stripped of control characters (it is shown, never trusted)."""
    text = value if isinstance(value, str) else reprlib.repr(value)  # a container is not rendered whole
    return "".join(ch if ch.isprintable() else " " for ch in text[:limit])


SETTINGS = ("cuda_matmul_allow_tf32", "float32_matmul_precision", "mkldnn_matmul_fp32_precision")


def reduced_settings(settings: Mapping[str, Any], *, tf32_declared: bool) -> list[str]:
    """The reduced-precision float32 switches `settings` (the probe's, after the battery ran) has on that the SKU does
    not allow, as `name=value`: TF32 (cuda_matmul_allow_tf32, float32_matmul_precision=high, mkldnn tf32) unless
    declared, and bfloat16 products (float32_matmul_precision=medium, mkldnn bf16) always. What the image reports
    can only count against it."""
    out = []
    tf32 = {("cuda_matmul_allow_tf32", True), ("float32_matmul_precision", "high"), ("mkldnn_matmul_fp32_precision", "tf32")}
    bf16 = {("float32_matmul_precision", "medium"), ("mkldnn_matmul_fp32_precision", "bf16")}
    for key, value in sorted(settings.items(), key=lambda kv: str(kv[0])):
        if key not in SETTINGS or not isinstance(value, str | bool):
            continue
        if (key, value) in bf16 or ((key, value) in tf32 and not tf32_declared):
            out.append(f"{printable_text(key, 60)}={printable_text(value, 30)}")
    return out


def reduced_precision(result: OpResult) -> str:
    """'' or the name of what a failing float32 product's error looks like: TF32 (or another reduced-precision
    float32 reduction), with its size in TF32 units."""
    if result.dtype != "float32" or result.op not in REDUCED_FP32 or "rms" not in result.errors:
        return ""
    tf32_units = result.errors["rms"] * UNIT["float32"] / TF32_UNIT
    if result.hard_ratio > 1.0 and 0.02 <= tf32_units <= 50:
        return (f"reduced-precision float32 arithmetic (TF32 or a reduced-precision reduction): its error is "
                f"{tf32_units:.2g} TF32 roundings ({result.errors['rms']:.3g} float32 units)")
    return ""


def derive_bounds(batteries: list[Battery]) -> dict[str, dict[str, float]]:
    """Calibrated bounds from honest runs' batteries: per op.dtype and measure, OP_MARGINS x the largest honest error
    (MODULE_MARGINS for a module op, and at least MODULE_FLOOR of its hard bound), at least OP_FLOORS (an op exact on
    the calibration host still tolerates a last-bit difference elsewhere in its class). ValueError when an honest run
    has an op that could not be compared or breaks a hard bound."""
    worst: dict[str, dict[str, float]] = {}
    floors: dict[str, dict[str, float]] = {}  # module ops: at least MODULE_FLOOR of the hard bound
    for battery in batteries:
        for r in battery.results:
            if r.op not in spec.OUTPUTS:
                floors[r.key] = {m: MODULE_FLOOR * b for m, b in r.hard.items()}
            if r.problem or not r.errors:
                raise ValueError(f"honest run: op {r.key}: {r.problem or 'not compared'}")
            if r.hard_ratio > 1.0:
                raise ValueError(f"honest run: op {r.key} breaks its hard bound: {r.worst()}")
            row = worst.setdefault(r.key, {})
            for m, v in r.errors.items():
                row[m] = max(row.get(m, 0.0), v)
    def bound(key: str, m: str, v: float) -> float:
        value = max(v * (MODULE_MARGINS if key in floors else OP_MARGINS)[m], OP_FLOORS[m], floors.get(key, {}).get(m, 0.0))
        return float(f"{value:.4g}")

    return {key: {m: bound(key, m, v) for m, v in row.items()} for key, row in sorted(worst.items())}


def _r(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.4g}")


# ---------------------------------------------------------------- the check


def missing_ops(battery: Battery, *, expected: frozenset[str], dtypes: tuple[str, ...]) -> list[str]:
    """<op>.<dtype> of every op the engine's adapter reaches (`expected`, from skupin/engines) at every dtype the
    gate runs that the candidate did not return: what the image reports uncovered or leaves out does not decide."""
    ran = {r.key for r in battery.results}
    return [f"{op}.{dtype}" for op in spec.OPS if op in expected for dtype in dtypes if f"{op}.{dtype}" not in ran]


def battery_bounds(calibrated: Mapping[str, Mapping[str, float]]) -> dict[str, Mapping[str, float]]:
    """The bounds of `calibrated` (op.dtype -> measure -> bound) that are the battery's ops', not the module ops'."""
    return {key: row for key, row in calibrated.items() if key.rpartition(".")[0] in spec.OUTPUTS}


def judge_ops(battery: Battery, *, calibrated: Mapping[str, Mapping[str, float]] | None, entry_key: str, why: str = "",
              tf32_declared: bool = False, settings: dict[str, Any] | None = None, engine: str = "",
              missing: list[str] | None = None, hard_only_why: str = "") -> CheckResult:
    """The ops check from a judged battery: fail on any op over a bound (TF32 named, with the setting the probe
    reported); `uncalibrated` when the SKU's class has no calibrated entry at all (`why`); a pass says whether the
    calibrated op bounds applied or the hard bounds alone (an entry calibrated before the battery, or `hard_only_why`:
    modules no bound of `calibrated` may judge). Every op checked and every op of the engine's path not reached are in
    the details."""
    rows = {r.key: r.row() for r in battery.results}
    on_path = {r.op for r in battery.results} | set(battery.uncovered)
    details: dict[str, Any] = {"ops": rows, "uncovered": battery.uncovered,
                               "not_on_path": [op for op in spec.OPS if op not in on_path],
                               "calibrated": bool(calibrated), "tf32_declared": tf32_declared,
                               "measures": "rms = sqrt(NMSE)/u, max = max |d|/(u max(|r|, rms r)), bias = max over rows "
                                           "|sum d r|/(u sum r^2); u = the dtype's unit roundoff"}
    uncovered = "; ".join(f"{op} ({reason})" for op, reason in battery.uncovered.items())
    if missing:
        return CheckResult(name="ops", status="fail",
                           reason=f"the candidate did not return {', '.join(missing[:6])}"
                                  f"{f' (+{len(missing) - 6} more)' if len(missing) > 6 else ''}, which the "
                                  f"{engine or 'engine'} adapter reaches (skupin/engines/{engine or '<engine>'}.py OPS, "
                                  "MODULES): "
                                  "an op would go unchecked, so the check fails instead of skipping it",
                           details={**details, "missing": missing})
    switched = reduced_settings(settings or {}, tf32_declared=tf32_declared)
    if switched:
        return CheckResult(name="ops", status="fail",
                           reason=f"reduced-precision float32 arithmetic is switched on in the image: "
                                  f"{', '.join(switched)}, which the SKU does not declare (gate.reduced_precision: "
                                  f"[tf32] allows TF32; bfloat16 float32 products are never allowed)",
                           details={**details, "settings": {k: printable_text(v, 30) for k, v in (settings or {}).items()
                                                            if k in SETTINGS}})
    if not battery.results:
        return CheckResult(name="ops", status="skipped",
                           reason=f"the {engine or 'engine'} adapter reaches none of its engine's ops: "
                                  f"{uncovered or 'none on its path'}", details=details)
    failures = battery.failures()
    if failures:
        worst = failures[0]
        text = f"{worst.key}: {worst.worst()}"
        named = reduced_precision(worst)
        if named and not tf32_declared:
            on = reduced_settings(settings or {}, tf32_declared=False)
            text += (f"; {named}, which the SKU does not declare (gate.reduced_precision: [tf32])"
                     + (f"; the probe reports {', '.join(on)}" if on else ""))
        more = f" (+{len(failures) - 1} more: {', '.join(f.key for f in failures[1:6])})" if len(failures) > 1 else ""
        return CheckResult(name="ops", status="fail", reason=text + more,
                           details={**details, "failures": [f"{f.key}: {f.worst()}" for f in failures]})
    closest = max(battery.results, key=lambda r: r.ratio)
    tail = f"; uncovered: {uncovered}" if uncovered else ""
    summary = f"{len(battery.results)} engine ops within their bounds (closest: {closest.key} at {closest.ratio:.2g}x)"
    if why:
        return CheckResult(name="ops", status="uncalibrated",
                           reason=f"{why} ({summary} of the hard bounds){tail}",
                           details={**details, "why": why, "calibration_free": CALIBRATION_FREE["ops"]})
    if not calibrated:
        return CheckResult(name="ops", status="pass",
                           reason=f"{summary}; hard bounds only: "
                                  f"{hard_only_why or f'{entry_key} has no calibrated op bounds (skupin calibrate adds them)'}"
                                  f"{tail}", details=details)
    # a module op without a bound of its own is uncalibrated where the entry has module bounds at all; an entry made
    # before the module ops has none, and its modules are judged by their hard bounds (said below)
    has_modules = any(key.rpartition(".")[0] not in spec.OUTPUTS for key in calibrated)
    missing = [r.key for r in battery.results if not r.calibrated and (r.op in spec.OUTPUTS or has_modules)]
    if missing:
        gap = f"{entry_key} has no calibrated op bound for {', '.join(missing[:6])}; fix: skupin calibrate"
        return CheckResult(name="ops", status="uncalibrated", reason=f"{gap} ({summary} of the hard bounds){tail}",
                           details={**details, "why": gap, "calibration_free": CALIBRATION_FREE["ops"]})
    hard_only = [r.key for r in battery.results if not r.calibrated]
    if hard_only:  # the module ops of an entry calibrated before them: their hard bounds decided
        tail = f"; {len(hard_only)} module ops on their hard bounds alone ({hard_only_why or f'{entry_key} predates them'}){tail}"
    return CheckResult(name="ops", status="pass", reason=f"{summary}{tail}", details=details)

