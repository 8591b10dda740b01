"""The probe: standalone imports, its stdlib safetensors writer read back by tensorio, its CLI on this CPU."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gates.tensorio import read_dtypes, read_safetensors

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "imagetools" / "probe.py"
FIXTURE = REPO / "gates" / "fixtures" / "tiny-llama"
BUNDLE = REPO / "gates" / "references" / "tiny-llama" / "h200-float32"
ALLOWED_TOP = {"torch", "transformers", "vllm", "sglang", "__future__"} | set(sys.stdlib_module_names)


def _imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    return names


def test_probe_needs_only_stdlib_torch_and_engines_and_never_pickles():
    source = PROBE.read_text()
    assert _imports(source) <= ALLOWED_TOP, _imports(source) - ALLOWED_TOP
    assert not {"pickle", "numpy", "safetensors", "gates", "builder"} & _imports(source)
    for banned in ("torch.load", "torch.save", "pickle.", "perturb", "weights_only"):
        assert banned not in source


def _probe_module():
    pytest.importorskip("torch")
    from imagetools import probe

    return probe


def test_probe_writer_round_trips_through_tensorio(tmp_path):
    torch = pytest.importorskip("torch")
    probe = _probe_module()
    base = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) / 7 - 1.5
    tensors = {
        "f32": base.float(), "f64": base, "f16": base.half(), "bf16": base.bfloat16(),
        "i32": torch.arange(-5, 5, dtype=torch.int32), "i64": torch.tensor([2**40, -3]),
        "u8": torch.tensor([0, 15, 255], dtype=torch.uint8), "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "b": torch.tensor([True, False]), "empty": torch.zeros(0, 3), "t.transposed": base.float()[0].t(),
    }
    index = probe.write_safetensors(str(tmp_path / "t.safetensors"), tensors, {"format": probe.FORMAT})
    raw = (tmp_path / "t.safetensors").read_bytes()
    assert raw[:2] != b"\x80\x04" and raw[:2] != b"PK"  # neither a pickle nor a zip (torch.save) file
    arrays, meta = read_safetensors(tmp_path / "t.safetensors")
    assert meta == {"format": probe.FORMAT}
    assert read_dtypes(tmp_path / "t.safetensors")["bf16"] == "BF16"
    assert set(arrays) == set(tensors) == set(index)
    for name, t in tensors.items():
        expected = t.float() if t.dtype in (torch.bfloat16,) else t
        assert arrays[name].shape == tuple(t.shape), name
        assert np.array_equal(arrays[name], np.asarray(expected.tolist(), dtype=arrays[name].dtype).reshape(t.shape)), name


def test_deterministic_inputs_need_no_rng_and_are_bf16_exact():
    torch = pytest.importorskip("torch")
    probe = _probe_module()
    torch.manual_seed(1)
    a = probe.det_values((64, 32), 3)
    torch.manual_seed(2)
    b = probe.det_values((64, 32), 3)
    assert torch.equal(a, b) and not torch.equal(a, probe.det_values((64, 32), 4))
    assert torch.equal(a, a.bfloat16().float())
    assert float(a.abs().max()) <= 1.0 and float(a.std()) > 0.4


def test_int4_packing_puts_the_even_column_in_the_low_nibble():
    torch = pytest.importorskip("torch")
    probe = _probe_module()
    q = probe.det_ints((4, 8), 1, 16)
    packed = probe.int4_pack(q)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 4)
    assert int(packed[0, 0]) == int(q[0, 0]) + 16 * int(q[0, 1])
    scales = torch.full((4, 2), 0.5)
    expected = (q.float() - 8) * 0.5
    assert torch.equal(probe.int4_dequant(packed, scales, 4), expected)


def _run_probe(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(PROBE), "--out", str(tmp_path / "out"), *extra], capture_output=True,
                          text=True, timeout=600, env=env, check=False)


def test_probe_rejects_bad_arguments(tmp_path):
    done = _run_probe(tmp_path, "--checks", "env,teleport")
    assert done.returncode == 2 and "--checks" in done.stderr


def test_probe_reports_a_failing_check_and_still_writes_json(tmp_path):
    pytest.importorskip("torch")
    bad = tmp_path / "prompts.json"
    bad.write_text(json.dumps({"format": "something-else", "prompts": []}))
    done = _run_probe(tmp_path, "--checks", "env,model", "--model", str(FIXTURE), "--prompts", str(bad))
    report = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert done.returncode == 1 and report["status"] == "error"
    assert report["checks"]["env"]["status"] == "ok" and "skupin-prompts/1" in report["checks"]["model"]["error"]
    assert report["env"]["torch"] and report["env"]["python"] == ".".join(map(str, sys.version_info[:3]))


def test_probe_on_this_cpu_matches_the_h200_bundle_shapes(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ref, _ = read_safetensors(BUNDLE / "tensors.safetensors")
    done = _run_probe(tmp_path, "--model", str(FIXTURE), "--prompts", str(FIXTURE / "prompts.json"),
                      "--dtype", "float32", "--batch-size", "8", "--threads", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "probe.json").read_text())
    ours, meta = read_safetensors(tmp_path / "out" / "tensors.safetensors")
    assert meta["format"] == "skupin-probe/1" and report["device"] == "cpu"
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}
    assert read_dtypes(tmp_path / "out" / "tensors.safetensors") == read_dtypes(BUNDLE / "tensors.safetensors")
    for name, value in ours.items():
        assert np.isfinite(value).all(), name
    assert np.array_equal(ours["model.input_ids"], ref["model.input_ids"])
    assert np.array_equal(ours["kernels.int4.dequant"], ref["kernels.int4.dequant"])  # exact arithmetic
    assert report["checks"]["model"]["hidden_states"].startswith("decoder last_hidden_state")
