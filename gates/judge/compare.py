"""Compare a candidate's probe tensors with the reference's: kernel errors and per-prompt model statistics.

Pure numpy on arrays read with gates/refdata/tensorio.py; nothing here knows about containers or files.

Kernel battery: for every op present in both, the scale-normalised maximum error
``max|cand - ref| / max|ref|`` (0 when bit-identical).

Model check, one value per prompt (statistics over its teacher-forced positions), each statistic one
``Statistic`` in STATISTICS (how it is computed, its calibration floor per dtype, the probe output it
needs), the registry that calibration (skupin/calibration/calibrate.py), the decision (gates/judge/verdict.py) and
the tolerance entries (gates/judge/tolerance.py) read:

- ``kl``: mean over positions of KL(ref || cand) of the next-token distribution, estimated from the
  stored top-k logprobs with one tail bucket (the reference's top-k ids plus "everything else").
  A candidate value missing from its own top-k is imputed as ``min(cand k-th logprob, ref logprob)``,
  the value closest to the reference that the candidate's top-k allows, so the estimate never
  inflates honest noise;
- ``kl_full``: the exact KL over the whole vocabulary, for prompts where both sides stored full
  logprobs (informational, and used by the hard bound);
- ``one_minus_cos``: mean over positions of 1 - cos(final hidden states) (where both have them);
- ``logprob_l2``: mean over positions of the L2 norm of the logprob differences at the reference's
  top-k ids and the reference (next) token;
- ``max_abs``: the largest absolute logprob difference among those;
- ``top1_agree``: fraction of positions whose most likely next token is the same.

A ragged prompt set (prompts of several lengths, so that batches pad) carries ``model.prompt_lengths``;
each prompt's statistics then cover its own positions only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Final

import numpy as np

from skupin.engines import Output

KERNEL_PREFIX = "kernels."
MODEL_PREFIX = "model."
REQUIRED_MODEL = ("model.input_ids", "model.topk_ids", "model.topk_logprobs", "model.target_logprob")


class CompareError(ValueError):
    """The two sets of tensors cannot be compared (different prompts, shapes or missing tensors)."""


@dataclass(frozen=True)
class KernelResult:
    """One op of the battery: its scale-normalised max error, or why it could not be compared."""

    op: str
    rel_err: float | None
    finite: bool
    problem: str = ""


@dataclass(frozen=True)
class ModelStatistics:
    """Per-prompt statistics (arrays of length num_prompts; NaN where a statistic is unavailable)."""

    per_prompt: dict[str, np.ndarray]
    available: tuple[str, ...]
    nonfinite: tuple[str, ...] = ()
    greedy_same: float | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def num_prompts(self) -> int:
        return int(len(self.per_prompt["kl"]))

    def mean(self, stat: str) -> float | None:
        """Mean over the prompts where the statistic exists, None when it exists nowhere."""
        values = self.per_prompt[stat]
        ok = values[np.isfinite(values)]
        return float(ok.mean()) if ok.size else None


# ---------------------------------------------------------------- kernels


def kernel_ops(tensors: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The battery's op names present in a probe's tensors (``kernels.matmul.float32`` -> ``matmul.float32``)."""
    return tuple(sorted(k.removeprefix(KERNEL_PREFIX) for k in tensors if k.startswith(KERNEL_PREFIX)))


def kernel_errors(ref: dict[str, np.ndarray], cand: dict[str, np.ndarray]) -> tuple[KernelResult, ...]:
    """Scale-normalised max error of every op in the reference (missing, misshaped or mistyped ops say why)."""
    results = []
    for op in kernel_ops(ref):
        r = ref[KERNEL_PREFIX + op]
        c = cand.get(KERNEL_PREFIX + op)
        if c is None:
            results.append(KernelResult(op, None, True, "the candidate did not produce this op"))
        elif _kind(c) != _kind(r):
            results.append(KernelResult(op, None, True, f"dtype {c.dtype} is not of the reference's kind ({_kind(r)})"))
        elif c.shape != r.shape:
            results.append(KernelResult(op, None, True, f"shape {list(c.shape)} differs from the reference's {list(r.shape)}"))
        else:
            c64, r64 = c.astype(np.float64), r.astype(np.float64)
            finite = bool(np.isfinite(c64).all())
            if not finite:
                results.append(KernelResult(op, None, False, "NaN or Inf in the candidate's output"))
                continue
            scale = float(np.abs(r64).max()) or 1.0
            results.append(KernelResult(op, float(np.abs(c64 - r64).max() / scale), True))
    return tuple(results)


# ---------------------------------------------------------------- model


def _require(tensors: dict[str, np.ndarray], side: str) -> None:
    missing = [k for k in REQUIRED_MODEL if k not in tensors]
    if missing:
        raise CompareError(f"the {side} has no {', '.join(missing)} (did its model check run?)")


def _kind(array: np.ndarray) -> str:
    """'float', 'int' (signed or not) or 'bool': what a tensor holds, whatever its width."""
    return {"f": "float", "i": "int", "u": "int", "b": "bool"}.get(array.dtype.kind, array.dtype.name)


def _check_shapes(ref: dict[str, np.ndarray], cand: dict[str, np.ndarray]) -> None:
    """Every model tensor both sides have must be of the reference's kind and shape, before any maths.

    The one exception: full-vocabulary logprobs may cover fewer prompts than the reference's (at least one).
    """
    for name in sorted(k for k in ref if k.startswith(MODEL_PREFIX) and k in cand):
        r, c = ref[name], cand[name]
        if _kind(c) != _kind(r):
            raise CompareError(f"{name}: the candidate's {c.dtype} tensor is not of the reference's kind ({_kind(r)})")
        if name == "model.logprobs_full" and c.ndim == r.ndim >= 1 and c.shape[1:] == r.shape[1:] \
                and 1 <= c.shape[0] <= r.shape[0]:
            continue
        if c.shape != r.shape:
            raise CompareError(f"{name}: candidate shape {list(c.shape)} differs from the reference's {list(r.shape)}")


def nonfinite_tensors(tensors: dict[str, np.ndarray]) -> tuple[str, ...]:
    """Model tensors with NaN or +Inf anywhere, or -Inf outside full logprobs (where it can mean 'never')."""
    bad = []
    for name, value in sorted(tensors.items()):
        if not name.startswith(MODEL_PREFIX) or not np.issubdtype(value.dtype, np.floating):
            continue
        if np.isnan(value).any() or np.isposinf(value).any() or (name != "model.logprobs_full" and np.isneginf(value).any()):
            bad.append(name)
    return tuple(bad)


def _cand_at_ref_ids(ref_ids: np.ndarray, ref_lp: np.ndarray, cand_ids: np.ndarray, cand_lp: np.ndarray
                     ) -> np.ndarray:
    """The candidate's logprob at each of the reference's top-k ids, imputed where it did not store it."""
    match = ref_ids[..., :, None] == cand_ids[..., None, :]
    found = match.any(-1)
    value = np.where(match, cand_lp[..., None, :], 0.0).sum(-1)
    kth = cand_lp.min(-1, keepdims=True)
    return np.where(found, value, np.minimum(kth, ref_lp))


def _log1mexp_sum(lp: np.ndarray) -> np.ndarray:
    """log(1 - sum(exp(lp))) along the last axis, clamped away from log(0)."""
    total = np.exp(lp).sum(-1)
    return np.log(np.clip(1.0 - total, 1e-300, None))


def _topk_kl(ref_lp: np.ndarray, cand_lp: np.ndarray) -> np.ndarray:
    """KL(ref || cand) over the reference's top-k ids plus one tail bucket, per position (>= 0)."""
    p = np.exp(ref_lp)
    head = (p * (ref_lp - cand_lp)).sum(-1)
    ref_tail, cand_tail = _log1mexp_sum(ref_lp), _log1mexp_sum(cand_lp)
    tail = np.exp(ref_tail) * (ref_tail - cand_tail)
    return np.clip(head + tail, 0.0, None)


def _renormalise(logprobs: np.ndarray) -> np.ndarray:
    """Full-vocabulary logprobs re-normalised in float64: float32 log_softmax sums to 1 only within ~1e-7,
    which would otherwise dominate the KL of two honest runs."""
    lp = logprobs.astype(np.float64)
    top = np.max(np.where(np.isfinite(lp), lp, -np.inf), axis=-1, keepdims=True)
    return lp - (top + np.log(np.exp(lp - top).sum(-1, keepdims=True)))


def _one_minus_cos(ref_h: np.ndarray, cand_h: np.ndarray) -> np.ndarray:
    """1 - cos per position, computed as |a/|a| - b/|b||^2 / 2 (no cancellation near 0)."""
    a = ref_h / np.clip(np.linalg.norm(ref_h, axis=-1, keepdims=True), 1e-300, None)
    b = cand_h / np.clip(np.linalg.norm(cand_h, axis=-1, keepdims=True), 1e-300, None)
    return 0.5 * ((a - b) ** 2).sum(-1)


def prompt_lengths(ref: dict[str, np.ndarray], cand: dict[str, np.ndarray]) -> np.ndarray | None:
    """Each prompt's length in ids when the prompt set is ragged (the reference's model.prompt_lengths, which the
    candidate must repeat exactly), None when every prompt fills model.input_ids."""
    r, c = ref.get("model.prompt_lengths"), cand.get("model.prompt_lengths")
    if r is None and c is None:
        return None
    if r is None or c is None or r.shape != c.shape or not np.array_equal(r, c):
        raise CompareError("the candidate ran other prompts than the reference (model.prompt_lengths differ)")
    seq = ref["model.input_ids"].shape
    if r.ndim != 1 or r.shape[0] != seq[0] or _kind(r) != "int" or int(r.min()) < 2 or int(r.max()) != seq[1]:
        raise CompareError(f"model.prompt_lengths {list(r.shape)} does not fit model.input_ids {list(seq)}")
    return r.astype(np.int64)


def _check_widths(ref: dict[str, np.ndarray]) -> None:
    """The reference's per-position tensors span the prompts' positions: T - 1 predicted ones, T hidden rows."""
    prompts, seq = ref["model.input_ids"].shape
    for name in ("model.target_logprob", "model.topk_logprobs", "model.topk_ids", "model.logprobs_full", "model.hidden"):
        want = seq if name == "model.hidden" else seq - 1
        if name in ref and (ref[name].ndim < 2 or ref[name].shape[1] != want):
            raise CompareError(f"{name}: the reference's shape {list(ref[name].shape)} does not span the "
                               f"{want} positions of its {seq}-id prompts")


def model_statistics(ref: dict[str, np.ndarray], cand: dict[str, np.ndarray]) -> ModelStatistics:
    """Every registered statistic (STATISTICS) of the candidate against the reference, per prompt.

    With a ragged prompt set (model.prompt_lengths) each prompt's statistics cover its own positions only: the rows
    are padded at the end, and whatever a candidate put in the padding changes nothing but the NaN/Inf check."""
    _require(ref, "reference")
    _require(cand, "candidate")
    if ref["model.input_ids"].shape != cand["model.input_ids"].shape or \
            not np.array_equal(ref["model.input_ids"], cand["model.input_ids"]):
        raise CompareError("the candidate ran other prompts than the reference (model.input_ids differ)")
    lengths = prompt_lengths(ref, cand)
    _check_widths(ref)
    _check_shapes(ref, cand)
    seq = ref["model.input_ids"].shape[1]
    pair = Pair(ref=ref, cand=cand,
                pos=None if lengths is None else np.arange(seq - 1)[None, :] < (lengths - 1)[:, None],
                tok=None if lengths is None else np.arange(seq)[None, :] < lengths[:, None])
    n = ref["model.input_ids"].shape[0]
    bad = nonfinite_tensors(cand)
    stats: dict[str, np.ndarray] = {}
    available, notes = [], []
    with np.errstate(invalid="ignore", over="ignore"):
        for stat in STATISTICS.values():
            stats[stat.name] = np.full(n, np.nan)
            if stat.needs is not None and not pair.both(stat.needs):
                if stat.unavailable:
                    notes.append(stat.unavailable)
                continue
            values = np.asarray(stat.compute(pair), dtype=np.float64)
            stats[stat.name][:len(values)] = values  # a statistic may cover the first prompts only (kl_full)
            available.append(stat.name)
            if not np.isfinite(values).all():  # NaN from a broken candidate must not read as "unavailable"
                bad = tuple(sorted(set(bad) | {f"statistic {stat.name}"}))
    greedy = None
    if "model.greedy_ids" in ref and "model.greedy_ids" in cand:
        greedy = float((ref["model.greedy_ids"] == cand["model.greedy_ids"]).all(-1).mean())
    return ModelStatistics(per_prompt=stats, available=tuple(available), nonfinite=bad, greedy_same=greedy,
                           notes=tuple(notes))


# ---------------------------------------------------------------- the statistics


@dataclass(frozen=True)
class Pair:
    """A reference and a candidate that model_statistics found comparable, with what several statistics share.

    `pos` and `tok` mask each prompt's own predicted positions (T - 1) and hidden-state positions (T) in a ragged
    prompt set; None when every prompt fills model.input_ids."""

    ref: dict[str, np.ndarray]
    cand: dict[str, np.ndarray]
    pos: np.ndarray | None
    tok: np.ndarray | None

    def both(self, output: str) -> bool:
        """Whether both sides hold model.<output> (of the same shape: _check_shapes)."""
        return f"model.{output}" in self.ref and f"model.{output}" in self.cand

    def f64(self, side: str, name: str) -> np.ndarray:
        return getattr(self, side)[f"model.{name}"].astype(np.float64)

    @cached_property
    def ref_lp(self) -> np.ndarray:
        return self.f64("ref", "topk_logprobs")

    @cached_property
    def at_ref(self) -> np.ndarray:
        """The candidate's logprob at the reference's top-k ids (imputed where it did not store it)."""
        return _cand_at_ref_ids(self.ref["model.topk_ids"], self.ref_lp, self.cand["model.topk_ids"],
                                self.f64("cand", "topk_logprobs"))

    @cached_property
    def delta(self) -> np.ndarray:
        """Candidate minus reference logprob at the reference's top-k ids."""
        return self.at_ref - self.ref_lp

    @cached_property
    def target_delta(self) -> np.ndarray:
        """Candidate minus reference logprob of the reference (next) token."""
        return self.f64("cand", "target_logprob") - self.f64("ref", "target_logprob")

    def mean(self, x: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
        """Mean over each prompt's positions (`valid`: its mask; the predicted positions' by default)."""
        valid = self.pos if valid is None else valid
        return x.mean(-1) if valid is None else np.where(valid, x, 0.0).sum(-1) / valid.sum(-1)

    def largest(self, x: np.ndarray) -> np.ndarray:
        """Largest value over each prompt's predicted positions."""
        return x.max(-1) if self.pos is None else np.where(self.pos, x, 0.0).max(-1)


@dataclass(frozen=True, kw_only=True)
class Statistic:
    """One per-prompt model statistic: how it is computed, how calibration floors it, what it needs.

    A statistic with `floors` decides the model check (per-prompt binomial test and mean bound, calibrated per entry
    in gates/data/tolerances.yaml); one without is informational (shown, and used by hard bounds only)."""

    name: str
    title: str  # how a report names it
    compute: Callable[[Pair], np.ndarray]  # per-prompt values, larger = further from the reference (or the first ones)
    floors: Mapping[str, float] = field(default_factory=dict)  # gate dtype -> smallest calibrated threshold
    # The probe output beyond top-k logprobs it is computed from (skupin/engines/base.py: Output): not computed unless
    # both sides hold it, as with an engine whose probe adapter does not report it (InferenceEngine.OUTPUTS).
    needs: Output | None = None
    unavailable: str = ""  # the note ModelStatistics carries when it is not computed
    larger_is_worse: bool = True

    @property
    def decides(self) -> bool:
        return bool(self.floors)

    @property
    def why_unavailable(self) -> str:
        """Why a pair has no value of it (a statistic that needs nothing is always computed)."""
        return self.unavailable or f"model.{self.needs} is not available on both sides"


def _kl_full(p: Pair) -> np.ndarray:
    rf, cf = _renormalise(p.ref["model.logprobs_full"]), _renormalise(p.cand["model.logprobs_full"])
    m = cf.shape[0]  # 1 <= m <= the reference's prompts, the rest of the same shape (_check_shapes)
    terms = np.where(np.isneginf(rf[:m]), 0.0, np.exp(rf[:m]) * (rf[:m] - cf[:m]))
    return p.mean(np.clip(terms.sum(-1), 0.0, None), None if p.pos is None else p.pos[:m])


# The floors: the smallest thresholds calibration gives per compute dtype, about one rounding step of that dtype on
# the statistic. bfloat16: 4 x what one bf16 rounding difference gives on tiny-llama (H200 eager vs sdpa attention,
# and CPU bf16 vs H200 bf16, both ~ kl 9e-8, 1-cos 2.5e-5, logprob L2 0.0125, max |delta| 0.012; measured by
# bench/detection). The earlier floors (kl 1e-9, 1-cos 1e-6, 1e-2) rejected every honest eager-attention H200 run
# when the calibration runs were bit-identical to the reference (docs/BENCHMARKS.md, Detection power).
STATISTICS: Final[dict[str, Statistic]] = {s.name: s for s in (
    Statistic(name="kl", title="mean KL(ref || cand), top-k + tail",
              compute=lambda p: p.mean(_topk_kl(p.ref_lp, p.at_ref)),
              floors={"float32": 1e-13, "bfloat16": 2e-7, "float16": 1e-11}),
    Statistic(name="one_minus_cos", title="1 - cos(final hidden states)",
              compute=lambda p: p.mean(_one_minus_cos(p.f64("ref", "hidden"), p.f64("cand", "hidden")), p.tok),
              floors={"float32": 1e-12, "bfloat16": 5e-5, "float16": 1e-8}, needs="hidden",
              unavailable="final hidden states are not available on both sides: 1 - cos not computed"),
    Statistic(name="logprob_l2", title="logprob L2 (top-k ids + next token)",
              compute=lambda p: p.mean(np.sqrt((p.delta**2).sum(-1) + p.target_delta**2)),
              floors={"float32": 1e-5, "bfloat16": 2.5e-2, "float16": 2e-3}),
    Statistic(name="max_abs", title="max |logprob delta|",
              compute=lambda p: np.maximum(p.largest(np.abs(p.delta).max(-1)), p.largest(np.abs(p.target_delta))),
              floors={"float32": 1e-5, "bfloat16": 2.5e-2, "float16": 2e-3}),
    Statistic(name="kl_full", title="mean KL, full vocabulary", compute=_kl_full, needs="logprobs_full"),
    Statistic(name="top1_agree", title="top-1 agreement", larger_is_worse=False,
              compute=lambda p: p.mean((p.ref["model.topk_ids"][..., 0] == p.cand["model.topk_ids"][..., 0])
                                       .astype(np.float64))),
)}
# Per-prompt statistics the calibrated decision uses (larger = further from the reference), and every one.
DECISION_STATS: Final[tuple[str, ...]] = tuple(name for name, s in STATISTICS.items() if s.decides)
ALL_STATS: Final[tuple[str, ...]] = tuple(STATISTICS)
