"""llama.cpp's module ops, captured from its own forward (skupin_probe_llamacpp.py module_capture) and judged on the
host (gates/judge/modules.py, captured=True): a correct engine's float32 outputs pass, a faulty module fails by name,
inputs the image misshapes are problems, and the probe's capture map reaches every module of a dense plan. No
Docker: the engine's outputs are made here from the host's own float64 reference, rounded to float32."""

from __future__ import annotations

import numpy as np
import pytest

from skupin.engines import engine_module_inputs, engine_modules
from skupin.gates.judge import modules as L
from skupin.gates.judge.ops import Battery, judge_ops
from skupin.gates.refdata.gguf import permute
from skupin.imagetools.probe import skupin_probe as probe
from skupin.imagetools.probe import skupin_probe_llamacpp as adapter
from skupin.imagetools.probe import skupin_probe_ops as spec

MODEL = "tiny-llama"


def _honest(model: L.HostModel, *, fault: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """The tensors a correct llama.cpp returns at float32: per module a float32 input in_x (seeded here) and its
    outputs, the float64 definition rounded to float32; `fault` scales one module's output (key -> factor)."""
    rng = np.random.default_rng(0)
    c = model.config
    tensors: dict[str, np.ndarray] = {}
    for key, kind in model.plan():
        width = int(c["num_attention_heads"]) * int(c["head_dim"]) if kind == "rotary" else model.hidden
        got = {} if kind == "embed" else {"in_x": rng.normal(0, 1, (spec.LT, width)).astype(np.float32)}
        x, problem = L._captured_inputs(model, key, kind, "float32", got)
        assert not problem
        ref = L.reference(model, key, kind, x, captured=True)
        for name, value in {**got, **ref}.items():
            out = value * (fault or {}).get(key, 1.0) if name != "in_x" else value
            tensors[f"ops.{key}.float32.{name}"] = np.asarray(out, dtype=np.float32)
    return tensors


def _report(model: L.HostModel) -> dict[str, object]:
    return {"modules": {"status": "ok", "inputs": "captured",
                        "ops": {f"{k}.float32": {"status": "ok"} for k, _ in model.plan()}}}


def _judged(tensors: dict[str, np.ndarray], model: L.HostModel) -> Battery:
    return L.with_modules(Battery(results=()), tensors, _report(model), model, dtypes=("float32",), captured=True)


def test_llamacpp_declares_captured_module_ops_and_the_others_seeded_ones() -> None:
    assert engine_modules("llamacpp") and engine_module_inputs("llamacpp") == "captured"
    assert {engine_module_inputs(e) for e in ("transformers", "vllm", "sglang")} == {"seeded"}
    assert engine_module_inputs("no-such-engine") == "seeded"
    assert callable(probe.load_adapter("llamacpp").module_capture)


def test_the_capture_is_two_sequences_short_and_long() -> None:
    segments = spec.capture_segments()
    assert len(segments) == spec.CAPTURE_SEGMENTS and [len(s) for s in segments] == [spec.LT // 2] * 2
    assert segments[0][0] == 0 and segments[1][0] == spec.LONG[0]
    assert list(L._segments(np.asarray(spec.CAPTURE_POSITIONS))) == [0] * 16 + [1] * 16


def test_every_module_of_a_dense_plan_is_a_tensor_of_llamacpps_graph() -> None:
    """Each plan key has its input (but the embedding: ids the host regenerates) and its outputs in the map of graph
    tensors the callback copies."""
    model = L.host_model(MODEL)
    assert model is not None
    targets = adapter._targets(int(model.config["num_hidden_layers"]))
    reached: dict[str, set[str]] = {}
    for outs in targets.values():
        for key, name in outs:
            reached.setdefault(key, set()).add(name)
    for key, kind in model.plan():
        assert reached[key] == set(spec.CAPTURED_OUTPUTS[kind]) | ({"in_x"} if kind != "embed" else set()), key


def test_captured_tensors_are_stacked_per_evaluation_and_a_missing_one_is_uncovered() -> None:
    """Rows of each evaluation (a segment's prefill, then its decoded token) stack in order; a tensor the graph did not
    compute once per evaluation leaves its module uncovered, named."""
    model = L.host_model(MODEL)
    assert model is not None
    targets = adapter._targets(3)
    segments = spec.capture_segments()
    rows = adapter._rows(segments)
    assert rows == [15, 1, 15, 1]
    captured = {t: [np.full(n * 256, i, np.float32) for i, n in enumerate(rows)] for t in targets if t[1] != "ROPE"}
    captured[("Qcur-0", "ROPE")] = [np.zeros(n * 256, np.float32) for n in rows[:-1]]  # one evaluation short
    tensors, report, why = adapter._module_tensors(model.plan(), targets, captured, segments, "float32", 0.1)
    assert tensors["ops.layer.1.mlp.float32.out"].shape == (32, 256)
    assert list(tensors["ops.layer.1.mlp.float32.in_x"][:, 0]) == [0] * 15 + [1] + [2] * 15 + [3]
    assert "rotary" in why and "Qcur-0 (ROPE)" in why["rotary"] and "rotary.float32" not in report
    assert report["layer.0.attention.float32"]["tensors"] == {"in_x": "attn_norm-0 (MUL)", "out": "attn_out-0 (MUL_MAT)"}


def test_a_moe_model_is_uncovered_by_the_capture() -> None:
    config = {"num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1, "hidden_size": 8,
              "vocab_size": 97}
    tensors, rows, why = adapter.module_capture("/nonexistent", {"dtype": "float32", "cpu_threads": 1}, spec, config)
    assert not tensors and not rows and set(why) == {k for k, _ in spec.module_plan(config)}


def test_the_rotary_reference_is_the_gguf_layout_of_transformers_rotation() -> None:
    """Queries in the GGUF's interleaved rows (gates/refdata/gguf.py permute), rotated, equal transformers' rotate-half
    rotation permuted the same way: the host's layout is the converter's."""
    model = L.host_model(MODEL)
    assert model is not None
    heads, head = int(model.config["num_attention_heads"]), int(model.config["head_dim"])
    positions = np.asarray(spec.CAPTURE_POSITIONS, dtype=np.float64)
    q_hf = np.random.default_rng(1).normal(0, 1, (spec.LT, heads * head))
    cos, sin = L._table(model, positions)
    rotated = L._rotate(q_hf.reshape(spec.LT, heads, head), cos, sin).reshape(spec.LT, -1)
    as_gguf = permute(q_hf.T, heads).T  # the converter permutes Q's rows: the activations' columns move with them
    assert np.allclose(L._rope_interleaved(model, as_gguf, positions), permute(rotated.T, heads).T, atol=1e-12)


def test_a_correct_engine_passes_every_module_on_its_hard_bounds() -> None:
    model = L.host_model(MODEL)
    assert model is not None
    battery = _judged(_honest(model), model)
    assert [r.key for r in battery.results] == [f"{k}.float32" for k, _ in model.plan()]
    assert not battery.failures() and all(not r.calibrated and "captured" in r.note for r in battery.results)
    assert L.missing_modules(list(battery.results), model, dtype="float32") == []
    result = judge_ops(battery, calibrated=None, entry_key="cpu-x86_64/float32/tiny-llama", engine="llamacpp")
    assert result.status == "pass" and "16 engine ops within their bounds" in result.reason


@pytest.mark.parametrize(("key", "bits"), [("layer.1.input_norm", 10), ("layer.0.mlp", 10), ("lm_head", 10),
                                           ("rotary", 6), ("layer.2.attention", 6)])
def test_a_module_off_by_a_power_of_two_fails_by_name(key: str, bits: int) -> None:
    """Off by 2^-10 (a bfloat16-sized error) a norm, an MLP or the head fails at float32; the rotary embedding and
    attention, whose hard bounds allow float32's rounding of angles near position 4096 (about 1e-3 of the output), by
    2^-6."""
    model = L.host_model(MODEL)
    assert model is not None
    battery = _judged(_honest(model, fault={key: 1 + 2.0 ** -bits}), model)
    assert [r.key for r in battery.failures()] == [f"{key}.float32"]


def test_attention_that_sees_across_sequences_fails() -> None:
    """The two captured sequences are independent (each from an empty KV cache): attention over both as one fails."""
    model = L.host_model(MODEL)
    assert model is not None
    tensors = _honest(model)
    x = tensors["ops.layer.0.attention.float32.in_x"].astype(np.float64)
    joined = L._attention(model, "model.layers.0.self_attn.", x, np.asarray(spec.CAPTURE_POSITIONS, np.float64))
    tensors["ops.layer.0.attention.float32.out"] = joined.astype(np.float32)
    assert [r.key for r in _judged(tensors, model).failures()] == ["layer.0.attention.float32"]


def test_inputs_the_image_misshapes_or_leaves_out_are_problems() -> None:
    model = L.host_model(MODEL)
    assert model is not None
    tensors = _honest(model)
    tensors["ops.layer.0.mlp.float32.in_x"] = tensors["ops.layer.0.mlp.float32.in_x"][:4]
    del tensors["ops.final_norm.float32.in_x"]
    tensors["ops.lm_head.float32.in_x"] = tensors["ops.lm_head.float32.in_x"].astype(np.float64) + 1e-12
    problems = {r.key: r.problem for r in _judged(tensors, model).results if r.problem}
    assert problems == {"layer.0.mlp.float32": "input in_x has shape [4, 256], not [32, 256]",
                        "final_norm.float32": "no input in_x (the module's input as the engine's forward computed it)",
                        "lm_head.float32": "input in_x: values that are not float32 values"}


def test_a_captured_report_is_judged_captured_only_when_the_engine_says_so() -> None:
    """The report's own "inputs": "captured" does not switch the host: judged as seeded, llama.cpp's tensors are
    compared with the seeded inputs' reference and fail."""
    model = L.host_model(MODEL)
    assert model is not None
    seeded = L.with_modules(Battery(results=()), _honest(model), _report(model), model, dtypes=("float32",))
    assert seeded.failures()
