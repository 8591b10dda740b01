"""The bf16 path on every change: the CPU SKU served in bfloat16 (cpu-x86_64-bf16) gated end to end against the H200
bf16 bundle of the shaped MoE fixture (peaked-moe: peaked attention, outlier channels, routing, prompts to position 127)
with its calibrated cpu-x86_64/bfloat16 entry, the engine op battery at bfloat16 and float32 (the MoE router and block
included), and the float32 pass (issue 29)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


EVERY_CHECK = ("reference", "pins", "binaries", "smoke", "boot", "kernels", "ops", "model", "float32", "serve")


def _passing_gate(sku: str, image: str, out: Path, *, skipped: tuple[str, ...] = ("smoke",)) -> tuple[dict, dict[str, dict]]:
    """`skupin gate SKU --image IMAGE --json`, which must pass every check but `skipped` (smoke: a CPU image); its
    verdict and checks by name."""
    proc = subprocess.run([sys.executable, "-m", "skupin.cli", "gate", sku, "--image", image, "--json", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    verdict = json.loads(proc.stdout)
    checks = {c["name"]: c for c in verdict["checks"]}
    assert verdict["decision"] == "pass", verdict["reason"]
    assert [(n, c["status"]) for n, c in checks.items()] == [
        (n, "skipped" if n in skipped else "pass") for n in EVERY_CHECK]
    return verdict, checks


def _failing_ops(derived, stack, mode: str, out: Path):
    """The gate of `derived`'s locked swap `mode`, which must pass `pins` and fail at `ops`: its statuses by check and
    the failing ops check."""
    from skupin.dockerd.client import connect
    from skupin.gates.gate import gate_image

    swapped = derived.swap(mode)
    verdict = gate_image(stack=swapped.stack(stack), image=swapped.image, docker=connect(), out=out,
                         wheelhouse=swapped.wheelhouse)
    statuses = {c.name: c.status for c in verdict.checks}
    assert verdict.decision == "fail" and verdict.exit_code == 10, verdict.reason
    assert statuses["pins"] == "pass" and statuses["ops"] == "fail", statuses
    return statuses, verdict.check("ops")


def test_the_bf16_cpu_sku_passes_the_whole_gate_with_its_calibrated_entry(bf16_image: str, tmp_path: Path) -> None:
    verdict, checks = _passing_gate("cpu-x86_64-bf16", bf16_image, tmp_path)
    assert verdict["tolerance"]["key"] == "cpu-x86_64/bfloat16/peaked-moe"
    assert verdict["reference"]["dtype"] == "bfloat16"
    # the op battery: the model's own modules at both dtypes, judged with the class's calibrated op bounds
    ops = checks["ops"]["details"]
    assert ops["calibrated"] is True
    assert {f"{op}.{dtype}" for op in ("rmsnorm", "silu_mul", "rope.long", "attention.prefill", "attention.decode",
                                       "matmul", "moe.route", "moe.block") for dtype in ("bfloat16", "float32")} \
        <= set(ops["ops"])
    assert all(row["calibrated"] for row in ops["ops"].values())
    # the float32 pass ran the same image at float32 against the float32 bundle, with the class's float32 entry
    assert checks["float32"]["details"]["tolerance_key"] == "cpu-x86_64/float32/peaked-moe"
    assert checks["float32"]["details"]["calibrated"] is True
    print(f"bf16 CPU gate: {verdict['reason']}; ops: {checks['ops']['reason']}")


@pytest.mark.parametrize("mode, op", [("norm-bf16", "rmsnorm.bfloat16"), ("router-bf16", "moe.route.bfloat16")])
def test_a_bf16_path_fault_in_the_engines_own_classes_fails_the_ops_check_before_the_model_and_float32(
        bf16_derived, bf16_stack, mode: str, op: str, tmp_path: Path) -> None:
    """A faulty engine release (a locked test wheel patching transformers' RMSNorm or MoE router to compute in bf16 what
    the honest class computes in float32) passes `pins`; a float32 run is unchanged by it by construction, and its
    end-to-end effect sits inside honest bf16 noise. The op battery builds its modules from those classes and fails
    the op, before the model check and the float32 pass run."""
    statuses, failing = _failing_ops(bf16_derived, bf16_stack, mode, tmp_path / "gate")
    assert "model" not in statuses or statuses["model"] == "skipped", statuses
    assert op in failing.reason, failing.reason
    assert failing.details["ops"][op]["ratio"] > 1


def test_the_vllm_bf16_cpu_sku_passes_the_whole_gate_with_its_engines_own_entry(vllm_bf16_image: str,
                                                                               tmp_path: Path) -> None:
    """vLLM's CPU backend serving bfloat16 (cpu-x86_64-vllm-bf16): its own bf16 path -- CPU kernels, fused MoE and
    router, the rotary table at the serving dtype -- through the whole gate on the shaped MoE fixture, judged with the
    entries calibrated on vLLM itself (gate.tolerance_per_engine), the module ops of the model its engine loaded at both
    dtypes, and the float32 pass."""
    verdict, checks = _passing_gate("cpu-x86_64-vllm-bf16", vllm_bf16_image, tmp_path)
    assert verdict["tolerance"]["key"] == "cpu-x86_64/bfloat16/peaked-moe/vllm"
    assert checks["float32"]["details"]["tolerance_key"] == "cpu-x86_64/float32/peaked-moe/vllm"
    ops = checks["ops"]["details"]
    assert ops["calibrated"] is True and not ops.get("missing")
    # the loaded MoE model, module by module, at the serving dtype: routers, each expert, the fused blocks
    assert {"layer.1.router.bfloat16", "layer.1.expert.3.bfloat16", "layer.1.moe.bfloat16", "rotary.bfloat16",
            "layer.0.attention.bfloat16", "lm_head.bfloat16"} <= set(ops["ops"]), sorted(ops["ops"])
    model = json.loads((tmp_path / "probe" / "probe.json").read_text())["checks"]["model"]
    assert (model["engine"], model["dtype"]) == ("vllm", "bfloat16"), (model["engine"], model.get("dtype"))
    print(f"vLLM bf16 CPU gate: {verdict['reason']}; ops: {checks['ops']['reason']}")


@pytest.mark.heavy  # more vLLM gates of minutes each: opt-in (SKUPIN_HEAVY=1), measured in docs/BENCHMARKS.md
@pytest.mark.parametrize("mode, named", [
    # one expert (3 of layer 1) quantized INT4 right after vLLM's loader filled the weights: a faulty weight in one
    # loaded model, no op's; the battery's own layers pass, that expert's module op fails
    ("vllm-expert-int4", ("layer.1.expert.3.bfloat16",)),
    # vLLM's CPU router at a 3% sharper softmax temperature (the same experts, weights about 1% off): a routing fault in
    # the engine's own router, which the battery's router op and every loaded router's module op call
    ("vllm-router-temp", ("moe.route.bfloat16", "layer.1.router.bfloat16")),
    # vLLM's own RMSNorm without its float32 upcast (a precision fault of the bf16 path a float32 run cannot show):
    # the battery's norm ops build that layer, every loaded norm is one of them
    ("vllm-norm-bf16", ("rmsnorm.bfloat16", "layer.1.post_norm.bfloat16")),
])
def test_a_fault_in_vllms_bf16_moe_path_fails_the_ops_check_naming_the_op(mode: str, named: tuple[str, ...],
                                                                          vllm_bf16_derived, vllm_bf16_stack,
                                                                          tmp_path: Path) -> None:
    """A locked test wheel changes vLLM's MoE path as a faulty release or loader would: `pins` passes, and the op
    check fails at the serving dtype (bf16, so without the float32 pass), before the model check and the float32
    pass; the reason names the worst ops, the details every failing one."""
    _, failing = _failing_ops(vllm_bf16_derived, vllm_bf16_stack, mode, tmp_path / "gate")
    ops = failing.details["ops"]
    assert all((ops.get(name) or {}).get("ratio", 0) > 1 for name in named), {name: ops.get(name) for name in named}
    assert any(name.rsplit(".", 1)[0] in failing.reason for name in named), failing.reason
    print(f"{mode}: {failing.reason}; " + ", ".join(f"{name} {ops[name]['ratio']:.3g}x" for name in named))


def test_the_llamacpp_bf16_sku_passes_the_whole_gate_with_its_moe_modules_captured(llamacpp_bf16_image: str,
                                                                                    tmp_path: Path) -> None:
    """llama.cpp serving a BF16 GGUF of the MoE fixture (cpu-x86_64-llamacpp-bf16): its own bf16 path -- BF16 products,
    its router (softmax, argsort top-k, renormalisation) and expert products (MUL_MAT_ID), RoPE, attention -- checked
    module by module from its own forward (captured by its eval callback, judged on the host), then the model and
    serve checks with its engine's own entry. No float32 pass: llama.cpp serves one GGUF."""
    verdict, checks = _passing_gate("cpu-x86_64-llamacpp-bf16", llamacpp_bf16_image, tmp_path,
                                    skipped=("smoke", "kernels", "float32"))
    assert verdict["tolerance"]["key"] == "cpu-x86_64/bfloat16/peaked-moe/llamacpp"
    ops = checks["ops"]["details"]["ops"]
    # every module of the MoE model, from llama.cpp's own forward: each router, each of the 8 experts of each of the 4
    # layers (on the tokens llama.cpp routed to it), each block, attention, rotary, norms, head
    experts = {f"layer.{i}.expert.{j}.bfloat16" for i in range(4) for j in range(8)}
    routers = {f"layer.{i}.{part}.bfloat16" for i in range(4) for part in ("router", "router.logits", "moe")}
    assert experts | routers | {"rotary.bfloat16", "layer.0.attention.bfloat16", "lm_head.bfloat16"} <= set(ops)
    # judged with bounds calibrated on llama.cpp's own forward (its engine-keyed entry), not only the hard ones
    assert all("bounds calibrated on this engine's own forward" in (ops[name].get("note") or "")
               for name in experts | routers), {name: ops[name].get("note") for name in sorted(experts | routers)[:3]}


@pytest.mark.parametrize("mode, named", [
    # a precision fault of the serving path: keys cached 4-bit, which attention reads back
    ("llamacpp-kv-q4", "attention.bfloat16"),
    # a single badly quantized expert (INT4 g128) in the loaded model
    ("llamacpp-expert-int4", "layer.1.expert.3.bfloat16"),
    # a routing fault: every router's weights scaled by 1 + 2^-5 (a 3% sharper temperature, the same experts mostly)
    ("llamacpp-router-scale", "router.logits.bfloat16"),
])
def test_a_fault_in_llama_cpps_bf16_path_fails_the_ops_check_from_its_own_forward(mode: str, named: str,
                                                                                 llamacpp_bf16_derived,
                                                                                 llamacpp_bf16_stack,
                                                                                 tmp_path: Path) -> None:
    """A locked test wheel gives every llama_cpp.Llama of the image a fault (the server's and the probe's alike):
    `pins` passes; the module ops captured from llama.cpp's own forward fail, naming the module, with no float32 pass
    to lean on (llama.cpp has none)."""
    _, failing = _failing_ops(llamacpp_bf16_derived, llamacpp_bf16_stack, mode, tmp_path / "gate")
    over = {op for op, row in failing.details["ops"].items() if (row.get("ratio") or 0) > 1}
    assert any(op.endswith(named) for op in over), (sorted(over), failing.reason)
    print(f"{mode}: {failing.reason}")
