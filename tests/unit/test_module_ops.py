"""The module ops (gates/judge/modules.py): every module of the model as transformers loaded it, against float64 math of
its definition with the fixture's own weights, on the host."""

from __future__ import annotations

import hashlib
import json
import types

import numpy as np
import pytest

from skupin.gates.judge import modules as L
from skupin.gates.judge.ops import Battery, OpResult, derive_bounds, judge_ops
from skupin.gates.refdata import fixture
from skupin.imagetools.probe import skupin_probe as probe
from skupin.imagetools.probe import skupin_probe_ops as spec

pytest.importorskip("transformers")


def test_the_plan_names_every_module_of_a_moe_and_a_dense_model() -> None:
    moe = spec.module_plan(fixture.config(fixture.SPECS["tiny-moe"]))
    keys = [k for k, _ in moe]
    assert keys[:2] == ["embed", "rotary"] and keys[-2:] == ["final_norm", "lm_head"]
    assert {"layer.1.router", "layer.1.expert.7", "layer.3.moe", "layer.0.attention", "layer.2.post_norm"} <= set(keys)
    assert len(keys) == 2 + 4 * (3 + 1 + 8 + 1) + 2
    dense = dict(spec.module_plan(fixture.config(fixture.SPECS["deep-llama"])))
    assert dense["layer.7.mlp"] == "mlp" and not any(k.endswith("router") for k in dense)


def test_inputs_are_exact_deterministic_and_frozen() -> None:
    """The host regenerates the inputs bit for bit; a change to them changes every calibrated layer bound's meaning,
    so it must be deliberate (this digest moves with it)."""
    config = fixture.config(fixture.SPECS["tiny-moe"])
    a = spec.module_inputs("layer.1.expert.3", "expert", "bfloat16", config)
    assert a == spec.module_inputs("layer.1.expert.3", "expert", "bfloat16", config)
    assert a["x"][1] != spec.module_inputs("layer.1.expert.4", "expert", "bfloat16", config)["x"][1]
    bf = np.asarray(a["x"][1], dtype=np.float32)
    assert np.array_equal(bf.view(np.uint32) & 0xFFFF, np.zeros_like(bf.view(np.uint32)))  # exact bfloat16
    f32 = np.asarray(spec.module_inputs("layer.1.expert.3", "expert", "float32", config)["x"][1], dtype=np.float64)
    assert np.array_equal(f32.astype(np.float32).astype(np.float64), f32) and (f32.astype(np.float32).view(np.uint32)
                                                                              & 0x1FFF).any()  # past TF32
    digest = hashlib.sha256(json.dumps([spec.module_inputs(k, kind, dt, config) for k, kind in spec.module_plan(
        config)[:6] for dt in ("bfloat16", "float32")]).encode()).hexdigest()
    assert digest[:16] == "f7a67f549d129ee1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-moe")
    fixture.generate_fixture(name="tiny-moe", out=out)
    return out


def _probe(model_dir, dtype: str, fault=None, monkeypatch=None, attn: str = "sdpa"):
    """The probe's module ops on the tiny-moe fixture (the adapter's module_ops, as the ops check runs them), with
    `fault(model)` applied to the loaded instance; -> (numpy tensors, layers report)."""
    from transformers import AutoModelForCausalLM

    if fault is not None:
        loader = AutoModelForCausalLM.from_pretrained.__func__

        def load(cls, *a, **kw):
            m = loader(cls, *a, **kw)
            fault(m)
            return m
        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(load))
    adapter = probe.load_adapter("transformers")
    opts = {"dtype": dtype, "attn": attn, "batch_size": 8, "top_k": 20, "full_logprobs": 0, "new_tokens": 0,
            "vocab": 0, "cpu_threads": 1}
    impls, uncovered = adapter.module_ops(str(model_dir), opts, "cpu", spec)
    config = json.loads((model_dir / "config.json").read_text())
    tensors, rows = spec.run_modules(impls, spec.module_plan(config), config, dtype, "cpu")
    arrays = {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in tensors.items()}
    return arrays, {"status": "ok", "ops": rows, "uncovered": uncovered}


@pytest.fixture(scope="module")
def honest(model_dir):
    return _probe(model_dir, "bfloat16")


@pytest.fixture(scope="module")
def calibrated(honest):
    model = L.host_model("tiny-moe")
    return derive_bounds([Battery(results=tuple(L.judge_modules(*honest, model, dtype="bfloat16")))])


def test_an_honest_model_passes_every_layer_op_within_its_hard_bounds_at_both_dtypes(model_dir, honest) -> None:
    model = L.host_model("tiny-moe")
    for dtype, run in (("bfloat16", honest), ("float32", _probe(model_dir, "float32"))):
        results = L.judge_modules(*run, model, dtype=dtype)
        assert len(results) == len(model.plan()) + 4  # each router also judged by its logits
        assert not [r.key for r in results if r.hard_ratio > 1.0], dtype
        assert L.missing_modules(results, model, dtype=dtype) == []


def test_the_definitions_are_the_modules_of_transformers_in_float64() -> None:
    """The host's float64 definition of a module equals transformers' own module run in float32 on the same weights, to
    float32 accuracy (transformers' fused experts take no float64)."""
    # (one of the fixture's modules per kind that composes several products)
    import torch
    from transformers import AutoModelForCausalLM

    model = L.host_model("tiny-moe")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        fixture.generate_fixture(name="tiny-moe", out=Path(tmp))
        m = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    for key, kind in [("layer.2.attention", "attention"), ("layer.1.moe", "moe"), ("layer.0.expert.5", "expert")]:
        x = {n: np.asarray(v, dtype=np.float64).reshape(s) for n, (s, v) in spec.module_inputs(
            key, kind, "float32", model.config).items()}
        ref = L.reference(model, key, kind, x)["out"]
        h = torch.from_numpy(x["x"]).float()
        layer = m.model.layers[int(key.split(".")[1])]
        with torch.no_grad():
            if kind == "attention":
                pos = torch.from_numpy(x["positions"]).long()[None]
                mask = torch.full((32, 32), float("-inf")).triu(1)[None, None]
                got = layer.self_attn(hidden_states=h[None], position_embeddings=m.model.rotary_emb(h[None], pos),
                                      attention_mask=mask)[0][0]
            elif kind == "moe":
                got = layer.mlp(h[None])[0]
            else:
                got = layer.mlp.experts(h, torch.full((32, 1), 5), torch.ones((32, 1)))
        # float32 rounding; attention also rounds its rotary angles (positions up to ~6000) to float32
        scale = np.abs(ref).max()
        assert np.abs(got.numpy() - ref).max() < (1e-4 if kind == "attention" else 1e-5) * scale, key


def _int4(w):
    import torch

    g = w.float().reshape(w.shape[0], -1, 128)
    scale = g.abs().amax(-1, keepdim=True) / 7.0
    return (torch.clamp(torch.round(g / scale), -8, 7) * scale).reshape(w.shape).to(w.dtype)


def _quantize_one_expert(m) -> None:
    import torch

    ex = m.model.layers[1].mlp.experts
    with torch.no_grad():
        ex.gate_up_proj.data[3] = _int4(ex.gate_up_proj.data[3])
        ex.down_proj.data[3] = _int4(ex.down_proj.data[3])


def _router_in_bf16(m) -> None:
    import torch

    def route(self, h):
        logits = torch.nn.functional.linear(h.reshape(-1, self.hidden_dim), self.weight)
        top, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)  # no float32 upcast
        return logits, top / top.sum(-1, keepdim=True), ids
    for layer in m.model.layers:
        layer.mlp.gate.forward = types.MethodType(route, layer.mlp.gate)


def _rotary_in_bf16(m) -> None:
    import torch

    rot = m.model.rotary_emb

    def table(self, x, position_ids):
        emb = torch.cat([position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)] * 2, dim=-1)
        return emb.cos(), emb.sin()
    rot.forward = types.MethodType(table, rot)


def _rotary_in_bf16_where_served(m) -> None:
    """The rotary table in bf16 only below max_position_embeddings: where the model serves, not where it extrapolates."""
    import torch

    rot, limit, honest = m.model.rotary_emb, m.config.max_position_embeddings, m.model.rotary_emb.forward

    def table(x, position_ids):
        emb = torch.cat([position_ids[..., None].to(x.dtype) * rot.inv_freq.to(x.dtype)] * 2, dim=-1)
        low = (position_ids < limit)[..., None]
        return tuple(torch.where(low, bad.to(good.dtype), good)
                     for bad, good in zip((emb.cos(), emb.sin()), honest(x, position_ids), strict=True))
    rot.forward = table


def _embedding_in_int4(m) -> None:
    import torch

    table = m.get_input_embeddings().weight
    with torch.no_grad():
        table.data = _int4(table.data)


@pytest.mark.parametrize("fault, named, by_hard", [
    (_rotary_in_bf16_where_served, "rotary.bfloat16", True),
    (_embedding_in_int4, "embed.bfloat16", True),
    (_quantize_one_expert, "layer.1.expert.3.bfloat16", True),
    (_rotary_in_bf16, "rotary.bfloat16", True),
    (_router_in_bf16, "router.bfloat16", False),
])
def test_a_fault_in_the_loaded_model_fails_the_module_it_lives_in(model_dir, calibrated, monkeypatch, fault, named,
                                                                   by_hard) -> None:
    model = L.host_model("tiny-moe")
    results = L.judge_modules(*_probe(model_dir, "bfloat16", fault, monkeypatch), model, dtype="bfloat16",
                             calibrated=calibrated)
    failed = sorted((r for r in results if r.failed), key=lambda r: -r.ratio)
    assert failed and failed[0].key.endswith(named)
    assert (failed[0].hard_ratio > 1.0) == by_hard
    check = judge_ops(Battery(results=tuple(results)), calibrated=calibrated, entry_key="k")
    assert check.status == "fail" and named in check.reason


def test_another_honest_run_passes_the_calibration_and_module_bounds_get_the_wider_margin(model_dir, honest,
                                                                                           calibrated) -> None:
    """Calibrated on the sdpa run, judged on a run with eager attention: a pass that is not one by construction."""
    model = L.host_model("tiny-moe")
    results = L.judge_modules(*_probe(model_dir, "bfloat16", attn="eager"), model, dtype="bfloat16",
                              calibrated=calibrated)
    assert not [r.key for r in results if r.failed]
    expert = next(r for r in L.judge_modules(*honest, model, dtype="bfloat16") if r.key == "layer.0.expert.0.bfloat16")
    assert calibrated["layer.0.expert.0.bfloat16"]["rms"] == pytest.approx(
        max(2.0 * expert.errors["rms"], 0.25 * expert.hard["rms"]), rel=1e-3)


def test_declared_tf32_widens_only_the_float32_products() -> None:
    model = L.host_model("tiny-moe")
    for kind in ("lm_head", "expert", "attention", "router.logits"):
        widened = L.hard_bounds(kind, "float32", model, tf32=True)["rms"] - L.hard_bounds(kind, "float32", model)["rms"]
        assert widened == pytest.approx(2 * 2.0**13)  # two TF32 roundings (2^-11) in float32 units (2^-24)
        assert L.hard_bounds(kind, "bfloat16", model, tf32=True) == L.hard_bounds(kind, "bfloat16", model)
    assert L.hard_bounds("norm", "float32", model, tf32=True) == L.hard_bounds("norm", "float32", model)


def test_an_entry_with_module_bounds_that_lacks_one_is_uncalibrated_for_it(honest, calibrated) -> None:
    model = L.host_model("tiny-moe")
    partial = {k: v for k, v in calibrated.items() if k != "layer.2.moe.bfloat16"}
    check = judge_ops(Battery(results=tuple(L.judge_modules(*honest, model, dtype="bfloat16", calibrated=partial))),
                      calibrated=partial, entry_key="k")
    assert check.status == "uncalibrated" and "layer.2.moe.bfloat16" in check.reason


def test_a_router_that_failed_is_reported_as_failed_not_as_missing(honest) -> None:
    model = L.host_model("tiny-moe")
    rows = dict(honest[1]["ops"])
    rows["layer.1.router.bfloat16"] = {"status": "error", "error": "RuntimeError: no router"}
    results = L.judge_modules(honest[0], {**honest[1], "ops": rows}, model, dtype="bfloat16")
    assert L.missing_modules(results, model, dtype="bfloat16") == []
    assert {r.key for r in results if "no router" in r.problem} == {"layer.1.router.bfloat16",
                                                                    "layer.1.router.logits.bfloat16"}
    missing_weights = dict(honest[0])
    del missing_weights["ops.layer.1.router.bfloat16.weights"]
    found = [r for r in L.judge_modules(missing_weights, honest[1], model, dtype="bfloat16") if "router" in r.key]
    assert any("no output weights" in r.problem for r in found if r.key == "layer.1.router.bfloat16")


def test_a_module_missing_failed_or_not_returned_fails(honest) -> None:
    model = L.host_model("tiny-moe")
    tensors, report = honest
    rows = dict(report["ops"])
    del rows["layer.2.expert.6.bfloat16"]
    rows["layer.0.moe.bfloat16"] = {"status": "error", "error": "RuntimeError: no kernel\x1b[31m"}
    results = L.judge_modules(tensors, {**report, "ops": rows}, model, dtype="bfloat16")
    assert L.missing_modules(results, model, dtype="bfloat16") == ["layer.2.expert.6.bfloat16"]
    said = L.missing_modules(results, model, dtype="bfloat16", uncovered={"layer.2.expert.6": "no expert\x1b[0m"})
    assert said == ["layer.2.expert.6.bfloat16 (the probe says: no expert [0m)"]
    broken = next(r for r in results if r.key == "layer.0.moe.bfloat16")
    assert broken.failed and "no kernel" in broken.problem and "\x1b" not in broken.problem
    nan = dict(tensors)
    nan["ops.lm_head.bfloat16.out"] = np.full_like(tensors["ops.lm_head.bfloat16.out"], np.nan)
    assert "NaN" in next(r for r in L.judge_modules(nan, report, model, dtype="bfloat16") if r.key == "lm_head.bfloat16").problem
    none = L.with_modules(Battery(results=()), tensors, {"ops": {}}, model, dtypes=("bfloat16",))
    assert none.results[0].failed and "no module ops" in none.results[0].problem


def _router_with(honest, **outputs):
    model = L.host_model("tiny-moe")
    tensors = dict(honest[0])
    for name, value in outputs.items():
        tensors[f"ops.layer.1.router.bfloat16.{name}"] = value
    return next(r for r in L.judge_modules(tensors, honest[1], model, dtype="bfloat16") if r.key == "layer.1.router.bfloat16")


def test_a_router_that_routes_elsewhere_repeats_an_expert_or_ties_its_logits_to_hide_fails(honest) -> None:
    ids = honest[0]["ops.layer.1.router.bfloat16.ids"]
    other = ids.copy()
    other[:, 1] = [next(e for e in range(8) if e not in row) for row in ids]  # a second choice outside the exact top-2
    assert "other experts" in _router_with(honest, ids=other).problem
    twice = ids.copy()
    twice[:, 1] = twice[:, 0]
    assert "distinct" in _router_with(honest, ids=twice).problem
    # logits flattened so that every token looks like a near-tie: which tokens are left out is the host's call
    flat = np.zeros_like(honest[0]["ops.layer.1.router.bfloat16.logits"])
    assert _router_with(honest, ids=other, logits=flat).failed
    assert "integers" in _router_with(honest, ids=ids + 0.5).problem


def test_every_router_token_is_judged_and_a_near_tie_may_take_either_expert(honest) -> None:
    """The host picks the near-ties from the exact logits; on them the k-th or the (k+1)-th expert is accepted, any
    other choice fails, and the weights are judged on every token."""
    model = L.host_model("tiny-moe")
    x = {n: np.asarray(v, dtype=np.float64).reshape(sh) for n, (sh, v) in spec.module_inputs(
        "layer.1.router", "router", "bfloat16", model.config).items()}
    exact = x["x"] @ model.weights["model.layers.1.block_sparse_moe.gate.weight"].T.astype(np.float64)
    ties = L._near_ties(exact, 2, "bfloat16")
    assert ties.any(), "the fixture has near-tie tokens to test with"
    order = np.argsort(-exact, -1)
    ids = honest[0]["ops.layer.1.router.bfloat16.ids"].copy()
    swapped = ids.copy()
    swapped[ties] = np.stack([order[ties, 0], order[ties, 2]], -1)  # the near-tie's other choice
    logits = honest[0]["ops.layer.1.router.bfloat16.logits"].copy()
    assert "own logits" in _router_with(honest, ids=swapped).problem  # not what its own logits rank
    lowest = ids.copy()
    lowest[ties] = order[ties][:, -2:]  # the two lowest experts on the near-tie tokens
    assert "other experts" in _router_with(honest, ids=lowest).problem
    weights = honest[0]["ops.layer.1.router.bfloat16.weights"].copy()
    weights[ties] = [0.9, 0.1]
    assert _router_with(honest, weights=weights).failed
    assert logits.shape[0] == 32


def test_a_module_computed_past_its_dtype_is_not_the_engines_module(honest) -> None:
    """A bfloat16 module's output must be bfloat16 values (the battery's rule): a float64 computation stored as
    float32 passes no bound by being exact."""
    model = L.host_model("tiny-moe")
    tensors = dict(honest[0])
    x = {n: np.asarray(v, dtype=np.float64).reshape(sh) for n, (sh, v) in spec.module_inputs(
        "layer.0.expert.1", "expert", "bfloat16", model.config).items()}
    tensors["ops.layer.0.expert.1.bfloat16.out"] = L.reference(model, "layer.0.expert.1", "expert", x)["out"].astype(
        np.float32)
    found = next(r for r in L.judge_modules(tensors, honest[1], model, dtype="bfloat16")
                 if r.key == "layer.0.expert.1.bfloat16")
    assert found.failed and "not bfloat16 values" in found.problem


def test_a_model_that_is_no_fixture_has_no_layer_model() -> None:
    assert L.host_model("not-a-fixture") is None
    assert isinstance(L.host_model("tiny-llama"), L.HostModel)


def test_an_entry_without_layer_bounds_judges_them_by_hard_bounds_and_says_so(honest, calibrated) -> None:
    model = L.host_model("tiny-moe")
    results = L.judge_modules(*honest, model, dtype="bfloat16")
    battery_row = OpResult(op="rmsnorm", dtype="bfloat16", errors={"rms": 0.1, "max": 0.1, "bias": 0.1}, nmse=0.0,
                           hard={"rms": 2.0, "max": 6.0, "bias": 1.0}, calibrated={"rms": 1.0, "max": 1.0, "bias": 1.0})
    check = judge_ops(Battery(results=(battery_row, *results)), calibrated={"rmsnorm.bfloat16": {"rms": 1.0}},
                      entry_key="cpu/bfloat16/tiny-moe")
    assert check.status == "pass" and "module ops on their hard bounds alone" in check.reason
