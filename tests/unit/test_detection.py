"""The detection benchmark's analysis: exact binomial intervals, prompt blocks, the calibration split, decisions, swaps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.detection import analysis as A
from bench.detection import swaps
from skupin.gates.judge.tolerance import ToleranceKey

STATS = ("kl", "one_minus_cos", "logprob_l2", "max_abs", "kl_full", "top1_agree")
OPS = ("matmul.bfloat16", "silu.float32")


def record(*, role="honest", swap=None, batch=8, attn="sdpa", boot=1, threads=1, scale=1.0, top1=1.0, silu=1e-7,
           seed=0, prompts=64):
    rng = np.random.default_rng(seed)
    base = {"kl": 1e-8, "one_minus_cos": 1e-6, "logprob_l2": 1e-3, "max_abs": 1e-3}
    stats = {s: (v * scale * (1 + 0.2 * rng.random(prompts))).tolist() for s, v in base.items()}
    stats["kl_full"] = [1e-7 * scale] * 4 + [None] * (prompts - 4)
    stats["top1_agree"] = [top1] * prompts
    return {"class": "cpu-x86_64", "model": "tiny-llama", "dtype": "bfloat16", "role": role, "swap": swap, "batch": batch,
            "attn": attn, "threads": threads, "boot": boot, "stats": stats, "available": list(STATS), "nonfinite": [],
            "kernels": {"matmul.bfloat16": 1e-3, "silu.float32": silu}, "kernel_problems": {}}


def binom_cdf_direct(k, n, p):
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


@pytest.mark.parametrize("k,n,p", [(0, 10, 0.1), (3, 20, 0.2), (7, 7, 0.5), (15, 40, 0.37)])
def test_binom_cdf_matches_the_direct_sum(k, n, p):
    assert A.binom_cdf(k, n, p) == pytest.approx(binom_cdf_direct(k, n, p), rel=1e-9)


def test_binom_cdf_does_not_overflow_for_large_n():
    value = A.binom_cdf(30, 20000, 0.001)
    assert 0.9 < value < 1.0


def test_clopper_pearson_known_values_and_symmetry():
    lo, hi = A.clopper_pearson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 10), rel=1e-6)
    lo2, hi2 = A.clopper_pearson(10, 10)
    assert hi2 == 1.0 and lo2 == pytest.approx(1 - hi, rel=1e-6)
    lo, hi = A.clopper_pearson(77, 100)
    assert lo < 0.77 < hi
    # the tails at the bounds are exactly 2.5% each
    assert 1 - A.binom_cdf(76, 100, lo) == pytest.approx(0.025, abs=1e-6)
    assert A.binom_cdf(77, 100, hi) == pytest.approx(0.025, abs=1e-6)
    assert A.clopper_pearson(0, 3000)[1] < 0.0013
    with pytest.raises(ValueError):
        A.clopper_pearson(5, 3)


def test_blocks_are_disjoint_seeded_and_drop_the_remainder():
    b = A.blocks(64, 8, seed=3)
    assert len(b) == 8 and all(len(x) == 8 for x in b)
    assert sorted(np.concatenate(b).tolist()) == list(range(64))
    assert [x.tolist() for x in A.blocks(64, 8, seed=3)] == [x.tolist() for x in b]
    assert [x.tolist() for x in A.blocks(64, 8, seed=4)] != [x.tolist() for x in b]
    assert len(A.blocks(20, 8, seed=0)) == 2
    assert A.blocks(16, 64, seed=0) == []


def test_split_follows_the_calibrate_recipe():
    records = [record(batch=8), record(batch=1, threads=2), record(batch=4), record(attn="eager"), record(boot=2),
               record(role="swap", swap="int8", scale=50)]
    calib, held, swapped = A.split(records)
    assert [(r["batch"], r["threads"]) for r in calib] == [(8, 1), (1, 2)]
    assert len(held) == 3 and all(r["role"] == "honest" for r in held)
    assert [r["swap"] for r in swapped] == ["int8"]


def entry_from(records):
    return A.calibrate(records=[r for r in records if A.is_calibration(r)],
                       key=ToleranceKey(hardware_class="cpu-x86_64", dtype="bfloat16", model="tiny-llama"),
                       margin=4.0, date="2026-11-29")


def test_calibrate_and_decide_separate_honest_from_swaps():
    honest = [record(batch=8, seed=1, scale=100), record(batch=1, seed=2, scale=100)]
    entry = entry_from(honest)
    kl_max = max(max(r["stats"]["kl"]) for r in honest)
    assert entry.model.per_prompt["kl"] == pytest.approx(4 * kl_max)  # margin 4 over the largest honest value
    assert entry_from([record(batch=8, seed=1), record(batch=1, seed=2)]).model.per_prompt["kl"] == pytest.approx(2e-7)
    assert entry.model.per_prompt["logprob_l2"] == pytest.approx(max(4 * float(np.max(honest[0]["stats"]["logprob_l2"] +
                                                                                    honest[1]["stats"]["logprob_l2"])), 0.025))
    held = A.to_stats(record(batch=4, seed=5, scale=100))
    assert A.decide(stats=held, kernels=A.to_kernels(honest[0]), entry=entry) == "pass"
    swapped = record(role="swap", swap="int8", seed=6, scale=2000)
    assert A.decide(stats=A.to_stats(swapped), kernels=A.to_kernels(swapped), entry=entry) == "calibrated"
    broken = record(role="swap", swap="int4-nibble", seed=7, scale=100, top1=0.5)
    assert A.decide(stats=A.to_stats(broken), kernels=A.to_kernels(broken), entry=entry) == "hard"
    # a float32 SiLU off by 1e-2 breaks the kernel hard bound (1e-4) before any calibrated tolerance
    silu = record(role="swap", swap="silu", seed=8, scale=100, silu=1e-2)
    assert A.decide(stats=A.to_stats(silu), kernels=A.to_kernels(silu), entry=entry) == "hard"
    # under the hard bound but over its calibrated tolerance (4 x 1e-7): the calibrated kernel check
    subtle = record(role="swap", swap="silu", seed=9, scale=100, silu=5e-5)
    assert A.decide(stats=A.to_stats(subtle), kernels=A.to_kernels(subtle), entry=entry) == "kernels"


def test_decisions_and_counts_over_prompt_blocks():
    honest = [record(batch=8, seed=1, scale=100), record(batch=1, seed=2, scale=100)]
    entry = entry_from(honest)
    outcomes = A.decisions(records=[record(role="swap", swap="int8", scale=2000, seed=s) for s in (3, 4)], entry=entry,
                           size=8)
    assert len(outcomes) == 16 and set(outcomes) == {"calibrated"}
    counted = A.count(outcomes, positive=True)
    assert counted["caught"] == 16 and counted["total"] == 16 and counted["by"] == {"calibrated": 16}
    assert counted["ci95"][1] == 1.0 and counted["ci95"][0] == pytest.approx(0.025 ** (1 / 16), rel=1e-4)
    honest_out = A.count(["pass"] * 9 + ["calibrated"], positive=False)
    assert honest_out["rejected"] == 1 and honest_out["rate"] == pytest.approx(0.1)


def test_subset_keeps_kl_full_only_where_it_exists():
    stats = A.to_stats(record())
    assert "kl_full" in A.subset(stats, np.array([0, 10])).available
    assert "kl_full" not in A.subset(stats, np.array([10, 11])).available
    assert A.subset(stats, np.array([3, 5])).num_prompts == 2


def test_margins_and_honest_ratio():
    honest = [record(batch=8, seed=1, scale=100), record(batch=1, seed=2, scale=100)]
    entry = entry_from(honest)
    swapped = [record(role="swap", swap="int8", scale=2000, seed=3)]
    m = A.margins(swapped, entry)
    expected = min(swapped[0]["stats"]["one_minus_cos"]) / entry.model.per_prompt["one_minus_cos"]
    assert m["one_minus_cos"]["per_prompt"] == pytest.approx(expected, rel=1e-3)
    assert m["one_minus_cos"]["mean_of_8"] >= m["one_minus_cos"]["per_prompt"] * 0.99
    assert all(v < 1 for v in A.honest_max_ratio([record(batch=4, seed=9, scale=100)], entry).values())


# ---------------------------------------------------------------- swaps


def test_swap_scopes():
    assert swaps.selected("model.layers.0.self_attn.q_proj", "quarter", 8)
    assert swaps.selected("model.layers.4.mlp.down_proj", "quarter", 8)
    assert not swaps.selected("model.layers.1.mlp.down_proj", "quarter", 8)
    assert swaps.selected("model.layers.2.mlp.up_proj", "mlp", 8)
    assert not swaps.selected("model.layers.2.self_attn.o_proj", "mlp", 8)
    assert not any(swaps.selected("lm_head", s, 8) for s in ("all", "mlp", "quarter"))


def test_weight_swaps_change_only_their_layers_and_quantize():
    torch = pytest.importorskip("torch")

    class Config:
        num_hidden_layers = 4

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.gate_proj = torch.nn.Linear(256, 128, bias=False)
            self.self_attn = torch.nn.Module()
            self.self_attn.q_proj = torch.nn.Linear(256, 256, bias=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(Layer() for _ in range(4))
            self.lm_head = torch.nn.Linear(256, 64, bias=False)

    torch.manual_seed(0)
    m = Model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    done = swaps.apply_weight_swap(m, "int8-quarter")
    assert done == ["model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.q_proj"]
    after = m.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    w = after["model.layers.0.mlp.gate_proj.weight"]
    scale = w.abs().amax(1, keepdim=True) / 127
    assert torch.allclose(w / scale, torch.round(w / scale), atol=1e-3)  # on the INT8 grid
    m2 = Model()
    w2 = m2.model.layers[1].self_attn.q_proj.weight.clone()
    swaps.apply_weight_swap(m2, "fp8-channel")
    q = m2.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(q, w2) and torch.allclose(q, w2, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits
    m3 = Model()
    head = m3.lm_head.weight.clone()
    swaps.apply_weight_swap(m3, "int4-mlp")
    assert torch.equal(m3.lm_head.weight, head)


def test_kernel_swaps_patch_and_restore():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    x = torch.linspace(-3, 3, 16)
    silu, softmax = F.silu, torch.softmax
    with swaps.kernel_swap("silu"):
        assert torch.allclose(F.silu(x), silu(x) * swaps.KERNEL_FACTOR)
    with swaps.kernel_swap("softmax"):
        assert float(torch.softmax(x, dim=-1).sum()) == pytest.approx(swaps.KERNEL_FACTOR, rel=1e-6)
    assert F.silu is silu and torch.softmax is softmax
    with pytest.raises(ValueError):
        with swaps.kernel_swap("nonsense"):
            pass
