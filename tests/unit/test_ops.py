"""The engine op battery (skupin_probe_ops.py in the image, gates/judge/ops.py on the host): exact inputs on both
sides, the float64 definitions, the three error measures and both kinds of bound, TF32 seen and named, and the check."""

from __future__ import annotations

import math

import numpy as np
import pytest

from skupin.gates.judge import ops as J
from skupin.gates.judge.tolerance import ModelThresholds, Provenance, ToleranceEntry, ToleranceKey
from skupin.imagetools.probe import skupin_probe_ops as spec

torch = pytest.importorskip("torch")
F = torch.nn.functional
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


# ---------------------------------------------------------------- an honest engine in plain torch (fp32 inside)


def _rms(x, w):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec.EPS) * w.float()


def _rope(t, pos):
    inv = 1.0 / (spec.THETA ** (torch.arange(0, spec.HD, 2, dtype=torch.float64) / spec.HD))
    ang = (pos.double()[:, None] * inv[None]).float()
    emb = torch.cat((ang, ang), -1)[:, None, :]
    return spec.rotate_neox(t.float(), emb.cos(), emb.sin()).to(t.dtype)


def _attention(x):
    q, k, v = (x[n].float() for n in ("q", "k", "v"))
    g = q.shape[0] // k.shape[0]
    causal = q.shape[1] == k.shape[1] and q.shape[1] > 1
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), is_causal=causal)
    return {"out": out.to(x["q"].dtype)}


def _moe(x):
    xf = x["x"].float()
    logits = xf @ x["gate"].float().T
    probs = torch.softmax(logits, -1)
    w, ids = torch.topk(probs, spec.TOPK, -1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(xf)
    for t in range(xf.shape[0]):
        for s in range(spec.TOPK):
            e = int(ids[t, s])
            h = F.silu(xf[t] @ x["w1"][e].float().T) * (xf[t] @ x["w3"][e].float().T)
            out[t] += w[t, s] * (h @ x["w2"][e].float().T)
    return {"out": out.to(x["x"].dtype)}


HONEST = {
    "rmsnorm": lambda x: {"out": _rms(x["x"], x["weight"]).to(x["x"].dtype)},
    "add_rmsnorm": lambda x: {"out": _rms(x["x"].float() + x["residual"].float(), x["weight"]).to(x["x"].dtype),
                              "residual": (x["x"].float() + x["residual"].float()).to(x["x"].dtype)},
    "silu_mul": lambda x: {"out": (F.silu(x["x"].float()[:, :spec.IW]) * x["x"].float()[:, spec.IW:]).to(x["x"].dtype)},
    "rope.short": lambda x: {"q": _rope(x["q"], x["positions"]), "k": _rope(x["k"], x["positions"])},
    "rope.long": lambda x: {"q": _rope(x["q"], x["positions"]), "k": _rope(x["k"], x["positions"])},
    "attention.prefill": _attention,
    "attention.decode": _attention,
    "moe.route": lambda x: spec.route_topk(x["logits"]),
    "moe.block": _moe,
    "matmul": lambda x: {"out": (x["x"].float() @ x["weight"].float().T).to(x["x"].dtype)},
}


def run(impls=None, dtypes=("bfloat16", "float32")):
    """(tensors as numpy, the probe's ops report) of the battery with `impls` (default: the honest engine)."""
    tensors, report = spec.run_battery(impls or HONEST, {"moe.block": "needs a running engine"}, dtypes, "cpu")
    return {k: v.float().numpy() for k, v in tensors.items()}, report


@pytest.fixture(scope="module")
def honest():
    return run()


@pytest.fixture(scope="module")
def calibrated(honest):
    return J.derive_bounds([J.judge_battery(*honest)])


# ---------------------------------------------------------------- inputs


def test_inputs_are_exact_in_their_dtype_and_float32_inputs_are_past_tf32_and_bfloat16() -> None:
    for op in spec.OPS:
        for name, (_, vals) in spec.inputs(op, "bfloat16").items():
            if name == "positions":  # integers, fed as int64
                continue
            t = torch.tensor(vals, dtype=torch.float64)
            assert torch.equal(t.to(torch.bfloat16).double(), t), (op, name)
        for name, (_, vals) in spec.inputs(op, "float32").items():
            t = torch.tensor(vals, dtype=torch.float64)
            assert torch.equal(t.float().double(), t), (op, name)
            if name in ("positions", "logits"):
                continue
            low = (t.float().view(torch.int32) & 0x1FFF) != 0  # mantissa bits TF32 drops
            assert low.float().mean() > 0.99, (op, name)


def test_the_host_regenerates_exactly_what_the_probe_fed() -> None:
    for op in spec.OPS:
        for dtype in ("bfloat16", "float32"):
            host = J.host_inputs(op, dtype)
            probe = spec.torch_inputs(op, dtype, "cpu")
            assert host.keys() == probe.keys()
            for name in host:
                assert np.array_equal(host[name], probe[name].double().numpy()), (op, dtype, name)


def test_inputs_are_deterministic_and_differ_between_ops_and_dtypes() -> None:
    assert spec.inputs("rmsnorm", "bfloat16") == spec.inputs("rmsnorm", "bfloat16")
    assert spec.inputs("rmsnorm", "bfloat16")["x"][1] != spec.inputs("add_rmsnorm", "bfloat16")["x"][1]
    assert spec.inputs("matmul", "bfloat16")["x"][1] != spec.inputs("matmul", "float32")["x"][1]


def test_router_logits_never_tie_so_the_exact_top_k_is_defined() -> None:
    shape, vals = spec.inputs("moe.route", "bfloat16")["logits"]
    rows = np.asarray(vals).reshape(shape)
    assert all(len(set(r)) == len(r) for r in rows)


def test_attention_inputs_are_peaked() -> None:
    """Trained models attend sharply: the battery's queries and keys give low-entropy attention (normalised < 0.8)."""
    x = J.host_inputs("attention.decode", "bfloat16")
    s = x["q"] @ np.repeat(x["k"], 2, 0).transpose(0, 2, 1) / math.sqrt(spec.HD)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    entropy = -(p * np.log(p)).sum(-1) / math.log(p.shape[-1])
    assert entropy.mean() < 0.8


# ---------------------------------------------------------------- definitions


def _torch64(op, x):
    """The op's definition written a second time, in torch at float64."""
    if op in ("rmsnorm", "add_rmsnorm"):
        h = x["x"] + x["residual"] if op == "add_rmsnorm" else x["x"]
        out = {"out": h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.EPS) * x["weight"]}
        return {**out, "residual": h} if op == "add_rmsnorm" else out
    if op == "silu_mul":
        return {"out": F.silu(x["x"][:, :spec.IW]) * x["x"][:, spec.IW:]}
    if op.startswith("rope."):
        inv = 1.0 / (spec.THETA ** (torch.arange(0, spec.HD, 2, dtype=torch.float64) / spec.HD))
        ang = x["positions"].double()[:, None] * inv[None]
        emb = torch.cat((ang, ang), -1)[:, None, :]
        return {n: spec.rotate_neox(x[n], emb.cos(), emb.sin()) for n in ("q", "k")}
    if op.startswith("attention."):
        g = x["q"].shape[0] // x["k"].shape[0]
        causal = x["q"].shape[1] == x["k"].shape[1] > 1
        return {"out": F.scaled_dot_product_attention(x["q"], x["k"].repeat_interleave(g, 0),
                                                      x["v"].repeat_interleave(g, 0), is_causal=causal)}
    if op == "moe.route":
        w, ids = torch.topk(torch.softmax(x["logits"], -1), spec.TOPK, -1)
        return {"weights": w / w.sum(-1, keepdim=True), "ids": ids.double()}
    return {"out": x["x"] @ x["weight"].T}


def test_the_float64_definitions_agree_with_torch_in_float64() -> None:
    for op in spec.OPS:
        x = {k: (v if k == "positions" else v.double()) for k, v in spec.torch_inputs(op, "float32", "cpu").items()}
        if op == "moe.block":
            xs = x
            logits = xs["x"] @ xs["gate"].T
            w, ids = torch.topk(torch.softmax(logits, -1), spec.TOPK, -1)
            w = w / w.sum(-1, keepdim=True)
            out = torch.zeros_like(xs["x"])
            for t in range(xs["x"].shape[0]):
                for s_ in range(spec.TOPK):
                    e = int(ids[t, s_])
                    h = F.silu(xs["x"][t] @ xs["w1"][e].T) * (xs["x"][t] @ xs["w3"][e].T)
                    out[t] += w[t, s_] * (h @ xs["w2"][e].T)
            got = {"out": out}
        else:
            got = _torch64(op, x)
        ref = J.reference(op, J.host_inputs(op, "float32"))
        for name in ref:
            assert np.allclose(got[name].double().numpy(), ref[name], rtol=1e-9, atol=1e-10), (op, name)


# ---------------------------------------------------------------- measures and bounds


def test_an_honest_engine_passes_every_hard_bound_at_both_dtypes(honest) -> None:
    battery = J.judge_battery(*honest)
    assert {r.key for r in battery.results} == {f"{op}.{d}" for op in spec.OPS for d in ("bfloat16", "float32")}
    assert not battery.failures(), [(r.key, r.worst()) for r in battery.failures()]
    assert battery.uncovered == {"moe.block": "needs a running engine"}


def test_one_rounding_to_bfloat16_costs_about_half_a_unit() -> None:
    r = np.linspace(-3, 3, 4097)
    y = torch.tensor(r).to(torch.bfloat16).double().numpy()
    errors, _ = J.measure(y, r, J.UNIT["bfloat16"])
    assert 0.2 < errors["rms"] < 0.6 and errors["max"] <= 1.0 and errors["bias"] < 0.05


def test_a_row_scaled_by_one_unit_shows_as_bias() -> None:
    r = np.random.default_rng(0).normal(size=(4, 256))
    y = r.copy()
    y[2] *= 1 + J.UNIT["bfloat16"]
    errors, _ = J.measure(y, r, J.UNIT["bfloat16"])
    assert errors["bias"] == pytest.approx(1.0, rel=1e-6)


def _bf16_variance_rmsnorm(x):
    h = x["x"]
    var = (h * h).mean(-1, keepdim=True)  # every step in bfloat16: no upcast
    return {"out": x["weight"] * (h * torch.rsqrt(var + spec.EPS))}


def _bf16_softmax_attention(x):
    q, k, v = x["q"], x["k"], x["v"]
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = (q @ k.transpose(1, 2)) * spec.HD**-0.5
    if q.shape[1] == k.shape[1] > 1:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return {"out": torch.softmax(s, -1) @ v}  # softmax in bfloat16


def _tf32_matmul(x):
    def cut(t):
        i = t.float().contiguous().view(torch.int32)
        return ((i + 0x1000) & ~0x1FFF).view(torch.float32)

    return {"out": (cut(x["x"]) @ cut(x["weight"]).T).to(x["x"].dtype)}


def _unnormalised_route(x):
    w, ids = torch.topk(torch.softmax(x["logits"].float(), -1), spec.TOPK, -1)
    return {"weights": w.to(x["logits"].dtype), "ids": ids.to(torch.int32)}


def _one_q4_expert(x):
    y = dict(x)
    for name in ("w1", "w3", "w2"):
        w = y[name].clone()
        scale = w[3].float().abs().amax(-1, keepdim=True) / 7
        w[3] = ((w[3].float() / scale).round().clamp(-8, 7) * scale).to(w.dtype)
        y[name] = w
    return _moe(y)


@pytest.mark.parametrize("op, fault, at", [
    ("rmsnorm", _bf16_variance_rmsnorm, "rmsnorm.bfloat16"),
    ("attention.prefill", _bf16_softmax_attention, "attention.prefill.bfloat16"),
    ("attention.decode", _bf16_softmax_attention, "attention.decode.bfloat16"),
    ("moe.route", _unnormalised_route, "moe.route.bfloat16"),
    ("moe.block", _one_q4_expert, "moe.block.bfloat16"),
    ("matmul", _tf32_matmul, "matmul.float32"),
])
def test_a_bf16_path_fault_a_routing_change_a_quantized_expert_and_tf32_fail_their_op(calibrated, op, fault, at) -> None:
    battery = J.judge_battery(*run({**HONEST, op: fault}), calibrated=calibrated)
    assert at in {r.key for r in battery.failures()}


def test_the_honest_engine_passes_its_own_calibration(honest, calibrated) -> None:
    assert not J.judge_battery(*honest, calibrated=calibrated).failures()
    assert set(calibrated) == {r.key for r in J.judge_battery(*honest).results}
    assert all(set(b) == set(J.MEASURES) for b in calibrated.values())


def test_tf32_is_named_and_a_declared_tf32_passes(honest, calibrated) -> None:
    tf32 = run({**HONEST, "matmul": _tf32_matmul})
    result = next(r for r in J.judge_battery(*tf32, calibrated=calibrated).results if r.key == "matmul.float32")
    assert result.hard_ratio > 1 and "TF32" in J.reduced_precision(result)
    # declared: TF32's rounding is within the hard bound (the class's calibration, made with TF32 on, still applies),
    # and a bfloat16 product is not
    declared = J.judge_battery(*tf32, tf32=True)
    assert "matmul.float32" not in {r.key for r in declared.failures()}
    bf16_products = run({**HONEST, "matmul": lambda x: {"out": (x["x"].bfloat16().float() @ x["weight"].bfloat16().float().T)}})
    assert "matmul.float32" in {r.key for r in J.judge_battery(*bf16_products, tf32=True).failures()}
    check = J.judge_ops(J.judge_battery(*tf32, calibrated=calibrated), calibrated=calibrated, entry_key="k",
                        settings={"cuda_matmul_allow_tf32": True, "float32_matmul_precision": "highest"})
    assert check.status == "fail"
    assert "TF32" in check.reason and "gate.reduced_precision: [tf32]" in check.reason
    assert "cuda_matmul_allow_tf32=True" in check.reason


@pytest.mark.parametrize("change, problem", [
    (lambda t: t.pop("ops.matmul.bfloat16.out"), "no output out"),
    (lambda t: t.update({"ops.matmul.bfloat16.out": t["ops.matmul.bfloat16.out"][:3]}), "has shape"),
    (lambda t: t["ops.matmul.bfloat16.out"].__setitem__((0, 0), np.nan), "NaN/Inf"),
])
def test_a_missing_misshaped_or_non_finite_output_fails_its_op(honest, change, problem) -> None:
    tensors = {k: v.copy() for k, v in honest[0].items()}
    change(tensors)
    result = next(r for r in J.judge_battery(tensors, honest[1]).results if r.key == "matmul.bfloat16")
    assert result.failed and problem in result.problem


def test_an_op_the_engine_could_not_run_fails_naming_its_error(honest) -> None:
    report = {**honest[1], "ops": {**honest[1]["ops"], "rmsnorm.bfloat16": {"status": "error", "error": "boom\x1b[2J"}}}
    result = next(r for r in J.judge_battery(honest[0], report).results if r.key == "rmsnorm.bfloat16")
    assert result.failed and "boom" in result.problem and "\x1b" not in result.problem


def test_experts_other_than_the_exact_top_k_fail_the_route_and_an_unsorted_top_k_is_the_same_answer(honest) -> None:
    tensors = dict(honest[0])
    unsorted = {**tensors, "ops.moe.route.bfloat16.ids": tensors["ops.moe.route.bfloat16.ids"][:, ::-1].copy(),
                "ops.moe.route.bfloat16.weights": tensors["ops.moe.route.bfloat16.weights"][:, ::-1].copy()}
    result = next(r for r in J.judge_battery(unsorted, honest[1]).results if r.key == "moe.route.bfloat16")
    assert not result.failed, result.worst()
    ids = tensors["ops.moe.route.bfloat16.ids"].copy()
    ids[5, 0] = (ids[5, 0] + 1) % spec.E if (ids[5, 0] + 1) % spec.E != ids[5, 1] else (ids[5, 0] + 2) % spec.E
    tensors["ops.moe.route.bfloat16.ids"] = ids
    result = next(r for r in J.judge_battery(tensors, honest[1]).results if r.key == "moe.route.bfloat16")
    assert "routed 1 of 32 tokens to other experts" in result.problem


# ---------------------------------------------------------------- the check


def test_the_check_lists_every_op_and_what_it_did_not_reach(honest, calibrated) -> None:
    check = J.judge_ops(J.judge_battery(*honest, calibrated=calibrated), calibrated=calibrated, entry_key="k")
    assert check.status == "pass"
    assert set(check.details["ops"]) == set(calibrated)
    assert check.details["uncovered"] == {"moe.block": "needs a running engine"}
    assert "uncovered: moe.block" in check.reason


def test_without_an_entry_the_check_is_uncalibrated_and_without_op_bounds_hard_only(honest) -> None:
    battery = J.judge_battery(*honest)
    assert J.judge_ops(battery, calibrated=None, entry_key="k", why="no calibrated tolerance").status == "uncalibrated"
    hard_only = J.judge_ops(battery, calibrated={}, entry_key="cpu/bfloat16/m")
    assert hard_only.status == "pass" and "hard bounds only" in hard_only.reason
    partial = J.judge_ops(battery, calibrated={"matmul.bfloat16": {"rms": 9, "max": 9, "bias": 9}}, entry_key="k")
    assert partial.status == "uncalibrated" and "no calibrated op bound" in partial.reason


def test_an_engine_that_reaches_no_op_is_skipped_and_says_what_is_uncovered() -> None:
    battery = J.judge_battery({}, {"status": "ok", "ops": {}, "uncovered": {op: "not exposed" for op in spec.OPS}})
    check = J.judge_ops(battery, calibrated=None, entry_key="k", engine="llamacpp")
    assert check.status == "skipped" and "not exposed" in check.reason and "llamacpp" in check.reason


def test_llama_cpp_reaches_no_op_and_says_why_for_each(tmp_path) -> None:
    from skupin.imagetools.probe import skupin_probe as probe

    args = probe.parse_args(["--out", str(tmp_path), "--engine", "llamacpp", "--checks", "env,ops", "--model", "x"])
    tensors, info = probe.ops_check(args, "cpu")
    assert tensors == {} and set(info["uncovered"]) == set(spec.OPS)
    assert all("no per-op ggml API" in why for why in info["uncovered"].values())


def test_an_adapter_without_a_battery_leaves_every_op_uncovered(tmp_path, monkeypatch) -> None:
    from skupin.imagetools.probe import skupin_probe as probe

    monkeypatch.setattr(probe, "load_adapter", lambda engine: object())
    args = probe.parse_args(["--out", str(tmp_path), "--engine", "sglang", "--checks", "env,ops", "--model", "x"])
    tensors, info = probe.ops_check(args, "cpu")
    assert tensors == {} and set(info["uncovered"]) == set(spec.OPS)


def test_an_entry_without_op_bounds_serialises_as_before() -> None:
    entry = ToleranceEntry(
        key=ToleranceKey(hardware_class="c", dtype="bfloat16", model="m"), kernels={},
        model=ModelThresholds(per_prompt={}, mean={}, honest_rate=0.01),
        provenance=Provenance(runs=2, prompts_per_run=8, hosts=(), versions={}, variations=(), date="d", method="m",
                              margin=2.0, reference_sha256="0" * 64, image="i", honest_max={}))
    assert "ops" not in entry.model_dump(mode="json")
    with_ops = entry.model_copy(update={"ops": {"matmul.bfloat16": {"rms": 1.0, "max": 2.0, "bias": 0.5}}})
    assert with_ops.model_dump(mode="json")["ops"]["matmul.bfloat16"]["rms"] == 1.0


@pytest.mark.parametrize("settings, declared, named", [
    ({"cuda_matmul_allow_tf32": True}, False, "cuda_matmul_allow_tf32=True"),
    ({"float32_matmul_precision": "high"}, False, "float32_matmul_precision=high"),
    ({"float32_matmul_precision": "medium"}, True, "float32_matmul_precision=medium"),  # bf16: never allowed
    ({"mkldnn_matmul_fp32_precision": "bf16"}, True, "mkldnn_matmul_fp32_precision=bf16"),
])
def test_a_reduced_precision_switch_the_image_turned_on_fails_naming_it_even_where_it_changes_nothing(
        honest, calibrated, settings, declared, named) -> None:
    """On a CPU, TF32 does not exist and the numbers stay the same: the switch itself is the finding (an image can only
    make itself fail by reporting one)."""
    battery = J.judge_battery(*honest, calibrated=calibrated)
    check = J.judge_ops(battery, calibrated=calibrated, entry_key="k", tf32_declared=declared,
                        settings={"float32_matmul_precision": "highest", **settings})
    assert check.status == "fail" and named in check.reason


def test_declared_tf32_switches_pass_and_odd_settings_are_ignored(honest, calibrated) -> None:
    battery = J.judge_battery(*honest, calibrated=calibrated)
    ok = J.judge_ops(battery, calibrated=calibrated, entry_key="k", tf32_declared=True,
                     settings={"cuda_matmul_allow_tf32": True, "float32_matmul_precision": "high"})
    assert ok.status == "pass"
    odd = J.judge_ops(battery, calibrated=calibrated, entry_key="k", settings={"x": [1], "float32_matmul_precision": [2]})
    assert odd.status == "pass"


def test_the_probe_reports_the_switches_after_the_battery(honest) -> None:
    assert honest[1]["settings"]["float32_matmul_precision"] == "highest"
    assert honest[1]["settings"]["cuda_matmul_allow_tf32"] is False


def test_an_op_the_engines_adapter_reaches_but_the_candidate_left_out_fails(honest, calibrated) -> None:
    """The image cannot evade the battery by calling an op uncovered or leaving it out: the host expects each engine's
    OPS (skupin/engines/<engine>.py) at every dtype the gate runs."""
    from skupin.engines import engine_ops

    expected = engine_ops("transformers", moe=True)
    assert {"rmsnorm", "attention.decode", "moe.block"} <= expected
    assert "moe.block" not in engine_ops("transformers", moe=False)
    assert engine_ops("llamacpp", moe=True) == frozenset() and engine_ops("nope", moe=False) == frozenset()
    report = {**honest[1], "ops": {k: v for k, v in honest[1]["ops"].items() if not k.startswith("attention.decode")},
              "uncovered": {"attention.decode": "the image says so"}}
    battery = J.judge_battery(honest[0], report, calibrated=calibrated)
    missing = J.missing_ops(battery, expected=expected, dtypes=("bfloat16", "float32"))
    assert missing == ["attention.decode.bfloat16", "attention.decode.float32"]
    check = J.judge_ops(battery, calibrated=calibrated, entry_key="k", engine="transformers", missing=missing)
    assert check.status == "fail" and "did not return attention.decode.bfloat16" in check.reason
    complete = J.judge_battery(*honest, calibrated=calibrated)
    assert J.missing_ops(complete, expected=expected, dtypes=("bfloat16", "float32")) == []


@pytest.mark.parametrize("name, change, problem", [
    ("ops.matmul.bfloat16.out", lambda v: v.astype(np.float64) * (1 + 2**-12), "not bfloat16 values"),
    ("ops.moe.route.bfloat16.ids", lambda v: v + 0.5, "not integers"),
    ("ops.moe.route.bfloat16.ids", lambda v: v + 64, "not integers in [0, 8)"),
])
def test_outputs_must_be_values_of_their_dtype_and_ids_experts(honest, name, change, problem) -> None:
    tensors = {**honest[0], name: change(honest[0][name])}
    key = name.removeprefix("ops.").rsplit(".", 1)[0]
    result = next(r for r in J.judge_battery(tensors, honest[1]).results if r.key == key)
    assert result.failed and problem in result.problem


def test_only_the_dtypes_the_gate_runs_are_judged(honest, calibrated) -> None:
    report = {**honest[1], "ops": {**honest[1]["ops"], "matmul.float16": {"status": "ok"}}}
    battery = J.judge_battery(honest[0], report, calibrated=calibrated, dtypes=("bfloat16", "float32"))
    assert "matmul.float16" not in {r.key for r in battery.results}
    assert J.judge_ops(battery, calibrated=calibrated, entry_key="k").status == "pass"


def test_settings_text_in_the_reason_is_printable_and_unknown_keys_are_dropped(honest, calibrated) -> None:
    battery = J.judge_battery(*honest, calibrated=calibrated)
    check = J.judge_ops(battery, calibrated=calibrated, entry_key="k",
                        settings={"float32_matmul_precision": "medium", "x\x1b[2J" * 1000: True})
    assert check.status == "fail" and "\x1b" not in check.reason and len(check.reason) < 400
    assert set(check.details["settings"]) == {"float32_matmul_precision"}
