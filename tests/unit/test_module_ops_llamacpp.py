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


def _moe_honest(model: L.HostModel, *, dtype: str = "bfloat16", fault: dict[str, float] | None = None,
                rows: int = 160) -> dict[str, np.ndarray]:
    """What a correct llama.cpp returns for a MoE layer's module ops, captured: routers and blocks on the 32 captured
    tokens, each expert on the rows of `rows` tokens routed to it (exact top-k of the float64 logits), float32 values;
    `fault` scales one module's output (key -> factor; a router's: its logits)."""
    rng = np.random.default_rng(0)
    k = int(model.config["num_experts_per_tok"])
    tensors: dict[str, np.ndarray] = {}
    for key, kind in model.plan():
        if kind not in ("router", "moe", "expert"):
            continue
        layer = key.split(".")[1]
        gate = model.weights[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        if kind == "expert":
            pool = rng.normal(0, 1, (rows, model.hidden)).astype(np.float32)
            _, ids = L._route(pool.astype(np.float64) @ gate.T, k)
            x = pool[(ids == int(key.split(".")[3])).any(-1)]
        else:
            x = rng.normal(0, 1, (spec.LT, model.hidden)).astype(np.float32)
        ref = L.reference(model, key, kind, {"x": x.astype(np.float64)}, captured=True)
        factor = (fault or {}).get(key, 1.0)
        if kind == "router":
            logits = ref["logits"] * factor
            weights, ids = L._route(logits.astype(np.float32).astype(np.float64), k)
            ref = {"logits": logits, "weights": weights, "ids": ids.astype(np.float64)}
        elif factor != 1.0:
            ref = {name: value * factor for name, value in ref.items()}
        for name, value in {"in_x": x, **ref}.items():
            tensors[f"ops.{key}.{dtype}.{name}"] = np.asarray(value, dtype=np.float32)
    return tensors


def _moe_judged(tensors: dict[str, np.ndarray], model: L.HostModel, dtype: str = "bfloat16") -> Battery:
    keys = [(k, kind) for k, kind in model.plan() if kind in ("router", "moe", "expert")]
    report = {"modules": {"status": "ok", "inputs": "captured", "ops": {f"{k}.{dtype}": {"status": "ok"} for k, _ in keys}}}
    battery = L.with_modules(Battery(results=()), tensors, report, model, dtypes=(dtype,), captured=True)
    # the plan's other modules (norms, attention, ...) have no tensors here: only the MoE ones are judged
    return Battery(results=tuple(r for r in battery.results if any(r.key.startswith(k + ".") for k, _ in keys)))


def test_every_module_of_a_moe_plan_is_a_tensor_of_llamacpps_graph_or_its_experts_rows() -> None:
    """A MoE layer's router (logits, renormalised weights, argsort ids) and block are graph tensors the callback copies,
    with the layer's normed input as theirs; each expert is made from that input, the argsort and ffn_moe_down."""
    model = L.host_model("peaked-moe")
    assert model is not None
    targets = adapter._targets(int(model.config["num_hidden_layers"]), int(model.config["num_local_experts"]))
    reached: dict[str, set[str]] = {}
    for outs in targets.values():
        for key, name in outs:
            reached.setdefault(key, set()).add(name)
    for key, kind in model.plan():
        if kind == "expert":
            assert key not in reached, key
            assert {(f"ffn_moe_down-{key.split('.')[1]}", "MUL_MAT_ID"),
                    (f"ffn_moe_argsort-{key.split('.')[1]}", "ARGSORT")} <= set(targets)
        else:
            assert reached[key] == set(spec.CAPTURED_OUTPUTS[kind]) | ({"in_x"} if kind != "embed" else set()), key
    assert not any(key.endswith(".mlp") for outs in targets.values() for key, _ in outs)


def test_each_experts_rows_are_the_tokens_routed_to_it_across_every_capture() -> None:
    """Per evaluation the argsort's first k columns are a token's experts and ffn_moe_down holds [tokens, k, hidden]:
    expert j gets the normed rows of its tokens and its slot's output, from the module-op capture and the extra one;
    an expert no token was routed to is not reached, named."""
    plan = [("layer.0.expert.0", "expert"), ("layer.0.expert.1", "expert"), ("layer.0.expert.2", "expert")]
    segments = [[0, 1, 2]]  # one segment: a prefill of 2 tokens, then 1 decoded
    norm = [np.arange(8, dtype=np.float32), np.arange(8, 12, dtype=np.float32)]  # hidden 4: tokens 0-1, then 2
    order = [np.asarray([1, 0, 2, 0, 1, 2], np.float32), np.asarray([1, 0, 2], np.float32)]  # argsort over 3 experts
    down = [np.arange(16, dtype=np.float32) + 100, np.arange(8, dtype=np.float32) + 200]  # [tokens, k=2, 4]
    captured = {("ffn_norm-0", "MUL"): norm, ("ffn_moe_argsort-0", "ARGSORT"): order,
                ("ffn_moe_down-0", "MUL_MAT_ID"): down}
    tensors, rows, why = adapter._expert_tensors(plan, [(captured, segments), (captured, segments)], "bfloat16", 0.1, 2)
    # tokens 0, 1, 2 chose experts {1, 0}, {0, 1}, {1, 0}: expert 0 is slot 1, 0, 1 of each; twice (two captures)
    assert tensors["ops.layer.0.expert.0.bfloat16.in_x"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] * 2
    assert tensors["ops.layer.0.expert.0.bfloat16.out"][:3, 0].tolist() == [104, 108, 204]
    assert tensors["ops.layer.0.expert.1.bfloat16.out"][:3, 0].tolist() == [100, 112, 200]
    assert "layer.0.expert.0" not in why and rows["layer.0.expert.0.bfloat16"]["tokens"] == 6
    assert "no captured token was routed to expert 2" in why["layer.0.expert.2"]


def test_a_correct_moe_engine_passes_its_routers_experts_and_blocks_from_a_captured_forward() -> None:
    model = L.host_model("peaked-moe")
    assert model is not None
    battery = _moe_judged(_moe_honest(model), model)
    experts = [r for r in battery.results if ".expert." in r.key]
    assert len(experts) == 32 and len([r for r in battery.results if r.key.endswith(".moe.bfloat16")]) == 4
    assert not battery.failures(), [(r.key, r.problem, r.errors) for r in battery.failures()]
    assert all("tokens routed to it" in r.note for r in experts)


@pytest.mark.parametrize(("key", "factor", "failing"), [
    ("layer.1.expert.3", 1 + 2.0 ** -5, "layer.1.expert.3.bfloat16"),  # one expert's output a few percent off
    ("layer.2.moe", 1 + 2.0 ** -5, "layer.2.moe.bfloat16"),  # the block's weighted sum
    ("layer.0.router", 1 + 2.0 ** -5, "layer.0.router.logits.bfloat16"),  # a 3% sharper routing temperature
])
def test_a_moe_module_off_by_a_few_percent_fails_by_name(key: str, factor: float, failing: str) -> None:
    model = L.host_model("peaked-moe")
    assert model is not None
    failures = [r.key for r in _moe_judged(_moe_honest(model, fault={key: factor}), model).failures()]
    assert failing in failures and all(f.startswith(key) for f in failures), failures


def test_a_captured_experts_rows_must_be_its_width_and_bounded() -> None:
    model = L.host_model("peaked-moe")
    assert model is not None
    for shape in [(0, 128), (4, 64), (L.MAX_EXPERT_ROWS + 1, 128)]:
        _, problem = L._captured_inputs(model, "layer.0.expert.0", "expert", "bfloat16",
                                        {"in_x": np.zeros(shape, np.float32)})
        assert problem.startswith(f"input in_x has shape {list(shape)}"), problem
    x, problem = L._captured_inputs(model, "layer.0.expert.0", "expert", "bfloat16", {"in_x": np.ones((5, 128), np.float32)})
    assert not problem and x["x"].shape == (5, 128)


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


def test_a_class_entrys_seeded_module_bounds_neither_judge_nor_leave_uncalibrated_a_captured_engines_modules() -> None:
    """A llama.cpp SKU keyed to its class (not gate.tolerance_per_engine): its captured modules are judged on their hard
    bounds, and the class entry's module bounds (of seeded inputs) must not make the check `uncalibrated` for want of
    bounds no calibration could give them; the gate keeps only the battery's (battery_bounds)."""
    from skupin.gates.judge.ops import battery_bounds, judge_ops
    from skupin.gates.judge.tolerance import DEFAULT_PATH, ToleranceKey, load_tolerances

    model = L.host_model("peaked-moe")
    assert model is not None
    battery = _moe_judged(_moe_honest(model), model)
    entry = load_tolerances(DEFAULT_PATH).find(ToleranceKey(hardware_class="cpu-x86_64", dtype="bfloat16",
                                                            model="peaked-moe"))
    assert entry is not None and any(".expert." in key for key in entry.ops)
    unfiltered = judge_ops(battery, calibrated=entry.ops, entry_key=entry.key.label(), engine="llamacpp")
    assert unfiltered.status == "uncalibrated"  # what the gate said before it kept the battery's bounds only
    kept = battery_bounds(entry.ops)
    assert kept and not any(".expert." in key or key.startswith("layer.") for key in kept)
    result = judge_ops(battery, calibrated=kept, entry_key=entry.key.label(), engine="llamacpp",
                       hard_only_why="captured from llamacpp's own forward")
    assert result.status == "pass" and "on their hard bounds alone (captured from llamacpp's own forward)" in result.reason


def _moe_forward(model: L.HostModel, layer: int = 1, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """One MoE layer's captured tensors as one correct forward gives them: the norm's output is the router's and the
    block's input; each expert holds the block's routed tokens first (then 8 rows of other tokens); the block's output
    is the routing weights times its experts' outputs, summed in slot order in float32."""
    rng = np.random.default_rng(3)
    k, p = int(model.config["num_experts_per_tok"]), f"layer.{layer}."
    w = model.weights[f"model.layers.{layer}.post_attention_layernorm.weight"]
    x = L._rms(rng.normal(0, 1, (spec.LT, model.hidden)), w, 1e-5).astype(np.float32)
    logits = (x.astype(np.float64) @ model.weights[f"model.layers.{layer}.block_sparse_moe.gate.weight"].T)
    weights, ids = L._route(logits, k)
    t = {f"ops.{p}post_norm.{dtype}.out": x, f"ops.{p}router.{dtype}.in_x": x, f"ops.{p}moe.{dtype}.in_x": x,
         f"ops.{p}router.{dtype}.logits": logits.astype(np.float32), f"ops.{p}router.{dtype}.weights":
         weights.astype(np.float32), f"ops.{p}router.{dtype}.ids": ids.astype(np.float32)}
    out = np.zeros_like(x)
    pool = L._rms(rng.normal(0, 1, (512, model.hidden)), w, 1e-5).astype(np.float32)  # the extra tokens' rows
    _, pool_ids = L._route(pool.astype(np.float64) @ model.weights[f"model.layers.{layer}.block_sparse_moe.gate.weight"].T, k)
    for e in range(int(model.config["num_local_experts"])):
        routed = np.nonzero((ids == e).any(-1))[0]
        rows = np.concatenate([x[routed], pool[(pool_ids == e).any(-1)][:8]])
        ref = L.reference(model, f"{p}expert.{e}", "expert", {"x": rows.astype(np.float64)})["out"].astype(np.float32)
        t[f"ops.{p}expert.{e}.{dtype}.in_x"], t[f"ops.{p}expert.{e}.{dtype}.out"] = rows, ref
    for slot in range(k):
        for e in np.unique(ids[:, slot]):
            sel, routed = ids[:, slot] == e, np.nonzero((ids == e).any(-1))[0]
            out[sel] += t[f"ops.{p}expert.{e}.{dtype}.out"][np.searchsorted(routed, np.nonzero(sel)[0])] * \
                weights[sel, slot, None].astype(np.float32)
    t[f"ops.{p}moe.{dtype}.out"] = out
    return t


def _break(t: dict[str, np.ndarray], how: str, model: L.HostModel) -> dict[str, np.ndarray]:
    t = dict(t)
    if how == "zero rows":  # every module's input all zeros: each module alone is then exact
        for name in [n for n in t if n.endswith(("in_x", "post_norm.bfloat16.out"))]:
            t[name] = np.zeros_like(t[name])
    elif how == "router input":  # the router judged on other rows than the block
        t["ops.layer.1.router.bfloat16.in_x"] = t["ops.layer.1.router.bfloat16.in_x"][::-1].copy()
    elif how == "expert rows":  # an expert's rows are not the block's tokens routed to it
        key = next(n for n in t if ".expert." in n and n.endswith("in_x") and len(t[n]) > 9)
        t[key] = t[key][::-1].copy()
    elif how == "block output":  # the block's output is not its experts' weighted sum
        t["ops.layer.1.moe.bfloat16.out"] = t["ops.layer.1.moe.bfloat16.out"] * np.float32(1 + 2.0**-6)
    elif how in ("extra zeros", "extra elsewhere"):  # an expert's extra rows: zeros, or rows routed to other experts
        key = "ops.layer.1.expert.0.bfloat16.in_x"
        extra = t[key].copy()
        gate = model.weights["model.layers.1.block_sparse_moe.gate.weight"]
        rows = np.concatenate([t[n] for n in t if ".expert." in n and n.endswith("in_x") and n != key])
        elsewhere = rows[~(np.argsort(-(rows.astype(np.float64) @ gate.T), axis=-1)[:, :3] == 0).any(-1)]
        extra[-1] = 0 if how == "extra zeros" else elsewhere[0]  # a row the router sends far from expert 0
        t[key] = extra
    return t


def test_a_captured_moe_layer_from_one_forward_is_consistent() -> None:
    model = L.host_model("peaked-moe")
    assert model is not None
    assert L.captured_moe_consistency(_moe_forward(model), model, "bfloat16") == []


@pytest.mark.parametrize(("how", "words"), [
    ("zero rows", "not normalised"),
    ("router input", "not the post-attention norm's output"),
    ("expert rows", "first rows are not the block's tokens routed to it"),
    ("block output", "not the routing weights times its experts' outputs"),
    ("extra zeros", "not normalised"),
    ("extra elsewhere", "that the router does not send to expert"),
])
def test_captured_tensors_that_are_not_one_forward_fail_the_layer(how: str, words: str) -> None:
    """Rows an image made up for one module (zeros, another order, another expert's) or a block output that its own
    experts do not give: each module may pass alone, the layer does not."""
    model = L.host_model("peaked-moe")
    assert model is not None
    found = L.captured_moe_consistency(_break(_moe_forward(model), how, model), model, "bfloat16")
    assert [r.key for r in found] == ["layer.1.capture.bfloat16"] and words in found[0].problem, found


def test_calibration_judges_a_captured_engines_modules_for_its_own_entry_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """skupin calibrate of a llama.cpp SKU keyed to its engine judges its captured modules (at the serving dtype, as
    captured), so their bounds can be derived; keyed to its class it judges none (no bound of another forward)."""
    from skupin.calibration import calibrate
    from skupin.calibration.calibrate import HonestRun, measure_run
    from skupin.gates.judge.tolerance import ToleranceKey

    monkeypatch.setattr(calibrate, "model_statistics", lambda reference, tensors: None)  # the model's: not this test's

    model = L.host_model("peaked-moe")
    assert model is not None
    tensors = {**_moe_honest(model), "model.logprobs_full": np.zeros((1, 2, 5), np.float32)}
    keys = [k for k, kind in model.plan() if kind in ("router", "moe", "expert")]
    ops = {"ops": {}, "modules": {"status": "ok", "ops": {f"{k}.bfloat16": {"status": "ok"} for k in keys}}}
    run = HonestRun(label="r", tensors=tensors, env={}, ops=ops, engine="llamacpp", engine_version="0.3.36")
    reference = {"model.logprobs_full": np.zeros((1, 2, 5), np.float32)}
    own = ToleranceKey(hardware_class="cpu-x86_64", dtype="bfloat16", model="peaked-moe", engine="llamacpp")
    measured = measure_run(reference=reference, run=run, kernels=False, key=own)
    assert measured.ops is not None
    judged = {r.key for r in measured.ops.results}
    assert {"layer.1.expert.3.bfloat16", "layer.0.router.logits.bfloat16", "layer.2.moe.bfloat16"} <= judged
    assert not any(r.key.endswith(".float32") for r in measured.ops.results)
    assert all("captured" in r.note for r in measured.ops.results if r.key in judged and not r.problem)
    classwide = measure_run(reference=reference, run=run, kernels=False, key=own.model_copy(update={"engine": ""}))
    assert classwide.ops is None


def test_the_router_ids_are_the_first_k_columns_of_llamacpps_argsort() -> None:
    """ffn_moe_argsort-N holds every expert per token, best first; the router's ids are its first k columns."""
    model = L.host_model("peaked-moe")
    assert model is not None
    layers, experts = int(model.config["num_hidden_layers"]), int(model.config["num_local_experts"])
    targets = adapter._targets(layers, experts)
    segments = spec.capture_segments()
    rows = adapter._rows(segments)
    captured = {t: [np.full(n * (experts if "argsort" in t[0] else 2 if "weights" in t[0] else
                                 experts if "logits" in t[0] else 256 if t[0].startswith("ffn_moe_down") else 128),
                            i, np.float32) for i, n in enumerate(rows)] for t in targets}
    captured[("ffn_moe_argsort-1", "ARGSORT")] = [np.tile(np.arange(experts, dtype=np.float32)[::-1], n) for n in rows]
    tensors, report, why = adapter._module_tensors(model.plan(), targets, captured, segments, "bfloat16", 0.1)
    ids = tensors["ops.layer.1.router.bfloat16.ids"]
    assert ids.shape == (32, 2) and ids[0].tolist() == [experts - 1, experts - 2]
    assert report["layer.1.router.bfloat16"]["tensors"]["ids"] == "ffn_moe_argsort-1 (ARGSORT)"
    assert not any(key.startswith(("layer.1.router", "layer.1.moe")) for key in why)


def test_a_layer_that_chooses_every_expert_has_no_near_tie_and_no_routing_to_contradict() -> None:
    """num_experts_per_tok == num_local_experts: there is no (k+1)-th expert to tie with or be routed instead."""
    logits = np.random.default_rng(0).normal(0, 1, (5, 2))
    assert not L._near_ties(logits, 2, "bfloat16").any()
    norm, gate = np.ones(4), np.random.default_rng(1).normal(0, 1, (2, 4))
    rows = L._rms(np.random.default_rng(2).normal(0, 1, (3, 4)), norm, 1e-5).astype(np.float32)
    ids = np.tile(np.arange(2), (3, 1))
    assert L._expert_rows_problem(1, rows, rows, ids, rows, norm, gate, 2, "bfloat16") == ""
