"""The probe: standalone imports, its adapter registry, its stdlib safetensors writer read back by tensorio, its CLI on
this CPU, each engine's adapter against a fake engine."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from skupin.gates.refdata.tensorio import read_dtypes, read_safetensors

REPO = Path(__file__).resolve().parents[2]
PROBE_DIR = REPO / "skupin" / "imagetools" / "probe"
PROBE = PROBE_DIR / "skupin_probe.py"  # the entry script the gate runs; the adapters are its siblings
FIXTURE = REPO / "gates" / "fixtures" / "tiny-llama"
BUNDLE = REPO / "gates" / "references" / "tiny-llama" / "h200-float32"
# numpy: only the llama.cpp adapter's path (llama-cpp-python requires it; its image has no torch)
ALLOWED_TOP = {"torch", "transformers", "vllm", "sglang", "llama_cpp", "numpy", "__future__"} | set(sys.stdlib_module_names)


def _type_checking_blocks(tree: ast.Module) -> list[ast.If]:
    return [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]


def _imports(source: str) -> set[str]:
    """Top-level names of every import that runs (a relative import shows as "." + its module); imports only for
    mypy (under `if TYPE_CHECKING:`) are left out: in an image they never run."""
    tree = ast.parse(source)
    typing_only = {id(n) for block in _type_checking_blocks(tree) for n in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or "").split(".")[0])
    return names


def _probe_files() -> list[Path]:
    """The probe's modules as the gate mounts them: every .py file of its folder but __init__.py, which only skupin's
    own process imports."""
    return sorted(p for p in PROBE_DIR.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", _probe_files(), ids=lambda p: p.name)
def test_probe_needs_only_stdlib_torch_and_engines_and_never_pickles(path: Path) -> None:
    source = path.read_text()
    assert _imports(source) <= ALLOWED_TOP, _imports(source) - ALLOWED_TOP
    assert not {"pickle", "safetensors", "gates", "builder", "skupin"} & _imports(source)
    for banned in ("torch.load", "torch.save", "pickle.", "perturb", "weights_only"):
        assert banned not in source
    for block in _type_checking_blocks(ast.parse(source)):  # mypy's view of the siblings: relative, one level
        for node in ast.walk(block):
            if isinstance(node, ast.Import | ast.ImportFrom):
                assert isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "skupin_probe", \
                    ast.unparse(node)


def test_the_probe_is_its_folder_and_every_module_is_named_for_it() -> None:
    """The gate mounts the whole folder (sys.path[0] of the script): every module name starts with skupin_probe, which
    no package of an image has, and every adapter module is registered and the other way round (beside them only
    skupin_probe_ops, the op battery's spec, and skupin_probe_smoke, the import smoke test)."""
    names = {p.stem for p in _probe_files()}
    assert all(n == "skupin_probe" or n.startswith("skupin_probe_") for n in names), names
    registry = _probe_module_static("ADAPTERS")
    assert names == {"skupin_probe", "skupin_probe_ops", "skupin_probe_smoke", *registry.values()}
    assert all(module == f"skupin_probe_{engine}" for engine, module in registry.items())


def _probe_module_static(name: str) -> dict:
    for node in ast.parse(PROBE.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{PROBE} has no {name}")


@pytest.mark.parametrize("engine", sorted(_probe_module_static("ADAPTERS")))
def test_each_adapter_module_has_the_interface(engine: str) -> None:
    import inspect

    from skupin.imagetools.probe import load_adapter, skupin_probe

    adapter = load_adapter(engine)
    assert isinstance(adapter.NEEDS_TORCH, bool)
    params = list(inspect.signature(adapter.run).parameters)
    assert params == list(inspect.signature(skupin_probe.Adapter.run).parameters)[1:]  # without self
    assert (engine == "llamacpp") == (not adapter.NEEDS_TORCH)  # the one image without torch


def test_run_as_a_script_the_probe_loads_its_adapters_from_its_own_folder(monkeypatch, tmp_path) -> None:
    """Outside the package (the script in an image) an adapter is loaded from the file beside the probe: a module of
    the same name on sys.path, or already imported, is not used."""
    import importlib.util

    (tmp_path / "skupin_probe_vllm.py").write_text("raise SystemExit('the image shadowed the probe')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("skupin_probe_vllm", "skupin_probe_sglang"):  # also undone after the test: the loader registers its own
        monkeypatch.setitem(sys.modules, name, type(sys)(name))
    spec = importlib.util.spec_from_file_location("skupin_probe", PROBE)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert not script.__package__
    for engine in ("vllm", "sglang"):
        adapter = script.load_adapter(engine)
        assert Path(adapter.__file__) == PROBE_DIR / f"skupin_probe_{engine}.py" and callable(adapter.run)


def test_cpu_threads_is_omp_num_threads_when_set(monkeypatch) -> None:
    from skupin.imagetools.probe import skupin_probe

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert skupin_probe._cpu_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "x")
    assert skupin_probe._cpu_threads() >= 1


def _probe_module():
    pytest.importorskip("torch")
    from skupin.imagetools.probe import skupin_probe

    return skupin_probe


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
    # and the numbers: float32 on this CPU is the H200's to rounding, so the committed bundles, captured by the
    # single-file probe before its split into adapter modules, still describe what this probe computes
    from skupin.gates.judge.compare import model_statistics

    stats = model_statistics(ref, ours)
    assert stats.per_prompt["max_abs"].max() < 1e-5 and stats.per_prompt["one_minus_cos"].max() < 1e-10
    assert stats.per_prompt["top1_agree"].min() == 1.0


def test_ragged_prompts_left_padded_in_batches_give_each_prompt_its_unpadded_numbers(tmp_path):
    """deep-llama's prompts are 16-64 ids: batch 8 left-pads with a mask and shifted positions; batch 1 pads nothing.
    In float32 the two agree to rounding, so the mask and positions are right (a dropped mask moves logprobs by ~0.4);
    greedy ids match too (ragged batches decode one prompt at a time)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from skupin.gates.judge.compare import model_statistics
    from skupin.gates.refdata.fixture import generate_fixture

    model = tmp_path / "deep-llama"
    generate_fixture(name="deep-llama", out=model)
    outs = {}
    for batch in ("1", "8"):
        done = _run_probe(tmp_path / batch, "--model", str(model), "--prompts", str(model / "prompts.json"),
                          "--dtype", "float32", "--batch-size", batch, "--threads", "2", "--checks", "model")
        assert done.returncode == 0, done.stderr[-3000:]
        outs[batch], _ = read_safetensors(tmp_path / batch / "out" / "tensors.safetensors")
    lengths = outs["8"]["model.prompt_lengths"]
    assert lengths.shape == (64,) and lengths.min() == 16 and lengths.max() == 64
    assert outs["8"]["model.topk_logprobs"].shape == (64, 63, 20) and outs["8"]["model.hidden"].shape[:2] == (64, 64)
    stats = model_statistics(outs["1"], outs["8"])
    assert stats.per_prompt["max_abs"].max() < 2e-6 and stats.per_prompt["one_minus_cos"].max() < 1e-10
    assert stats.greedy_same == 1.0


# ---------------------------------------------------------------- the SGLang adapter against a fake Engine

# ServerArgs fields of sglang 0.5.23 (sglang/srt/arg_groups/fields/*.py; Engine(**kwargs) builds ServerArgs, a
# msgspec struct that refuses any other keyword) that the probe's SGLang adapter may pass.
SGLANG_0_5_23_ENGINE_FIELDS = {"model_path", "dtype", "random_seed", "max_running_requests", "log_level",
                               "return_hidden_states_mode", "enable_return_hidden_states", "device"}


class _FakeSGLang:
    """sglang.Engine's offline generate() with the output layout of sglang 0.5.23, over a deterministic toy model.

    meta_info as the tokenizer manager builds it (managers/tokenizer_manager.py add_logprob_to_meta_info;
    scheduler_components/logprob_result_processor.py): items (logprob, token id, None); with
    logprob_start_len=0 input entry t predicted prompt token t and entry 0 is None; hidden_states[0] is the
    prefill block (one row per prompt position), then one row per decode step.
    """

    V, H = 32, 8

    def __init__(self, **kwargs):
        unknown = set(kwargs) - SGLANG_0_5_23_ENGINE_FIELDS
        if unknown:
            raise TypeError(f"Unexpected keyword arguments: {sorted(unknown)}")
        self.kwargs, self.calls, self.closed = kwargs, [], False

    @classmethod
    def logprobs(cls, prefix):
        import torch

        g = torch.Generator().manual_seed(len(prefix) * 1009 + sum(p * 31 ** i for i, p in enumerate(prefix)) % 100_003)
        return torch.log_softmax(torch.randn(cls.V, generator=g, dtype=torch.float64) * 3, -1)

    @classmethod
    def hidden(cls, prefix):
        return [float(len(prefix) + j + prefix[-1] / 4) for j in range(cls.H)]  # float32-exact

    @staticmethod
    def top(lp, k):
        vals, idx = lp.topk(k)
        return [(float(v), int(i), None) for v, i in zip(vals, idx, strict=True)]

    def generate(self, *, input_ids, sampling_params, return_logprob=False, logprob_start_len=None,
                 top_logprobs_num=None, return_hidden_states=False):
        assert isinstance(input_ids[0], list) and return_logprob
        self.calls.append({"n": len(input_ids), "k": top_logprobs_num, "start": logprob_start_len,
                           "hidden": return_hidden_states, **sampling_params})
        if return_hidden_states:
            assert self.kwargs.get("return_hidden_states_mode") == "full", "SGLang refuses hidden states otherwise"
        outs = []
        for prompt in input_ids:
            meta: dict = {"input_token_logprobs": [], "output_token_logprobs": []}
            if logprob_start_len == 0:
                meta["input_token_logprobs"] = [(None, prompt[0], None)] + [
                    (float(self.logprobs(prompt[:t])[prompt[t]]), prompt[t], None) for t in range(1, len(prompt))]
                meta["input_top_logprobs"] = [None] + [self.top(self.logprobs(prompt[:t]), top_logprobs_num)
                                                       for t in range(1, len(prompt))]
            seq, steps, hidden = list(prompt), [], [[self.hidden(prompt[: t + 1]) for t in range(len(prompt))]]
            for _ in range(sampling_params["max_new_tokens"]):
                lp = self.logprobs(seq)
                steps.append(self.top(lp, top_logprobs_num))
                seq.append(int(lp.argmax()))
                meta["output_token_logprobs"].append((float(lp.max()), seq[-1], None))
            meta["output_top_logprobs"] = steps
            if return_hidden_states:
                meta["hidden_states"] = hidden + [self.hidden(seq[: t + 1]) for t in range(len(prompt), len(seq) - 1)]
            outs.append({"text": "", "output_ids": seq[len(prompt):], "meta_info": meta})
        return outs

    def shutdown(self):
        self.closed = True


def _run_fake_sglang(monkeypatch, fake_cls=_FakeSGLang):
    probe = _probe_module()
    engines_seen: list = []

    def make(**kwargs):
        engines_seen.append(fake_cls(**kwargs))
        return engines_seen[-1]

    monkeypatch.setitem(sys.modules, "sglang", type(sys)("sglang"))
    monkeypatch.setattr(sys.modules["sglang"], "Engine", make, raising=False)
    ids = [[3, 7, 1, 30, 12, 5], [9, 9, 2, 31, 0, 4], [1, 2, 3, 4, 5, 6]]
    opts = {"dtype": "bfloat16", "batch_size": 2, "top_k": 4, "attn": "sdpa", "full_logprobs": 2, "new_tokens": 3,
            "vocab": _FakeSGLang.V, "cpu_threads": 1}
    tensors, info = probe.run_adapter("sglang", "/model", ids, opts, "cuda")
    return probe, ids, opts, {"tensors": tensors, "info": info}, engines_seen


def test_sglang_adapter_reads_the_0_5_23_layout_into_the_common_tensors(monkeypatch):
    torch = pytest.importorskip("torch")
    from skupin.engines import sglang

    _, ids, opts, result, (engine,) = _run_fake_sglang(monkeypatch)
    t = result["tensors"]
    fake = _FakeSGLang
    assert engine.closed and engine.kwargs["return_hidden_states_mode"] == "full"
    assert [(c["n"], c["k"], c["start"], c["hidden"]) for c in engine.calls] == [
        (3, 4, 0, True), (2, fake.V, 0, False), (3, 2, None, False)]
    assert engine.calls[2]["ignore_eos"] and engine.calls[2]["temperature"] == 0.0
    assert {f"model.{name}" for name in sglang.OUTPUTS} <= set(t)
    n, length = len(ids), len(ids[0])
    assert t["model.hidden"].shape == (n, length, fake.H) and t["model.logprobs_full"].shape == (2, length - 1, fake.V)
    for i, prompt in enumerate(ids):
        for pos in range(length - 1):
            lp = fake.logprobs(prompt[: pos + 1]).float()
            assert float(t["model.target_logprob"][i, pos]) == pytest.approx(float(lp[prompt[pos + 1]]))
            assert torch.equal(t["model.topk_ids"][i, pos], lp.topk(4).indices.to(torch.int32))
            if i < 2:
                assert torch.allclose(t["model.logprobs_full"][i, pos], lp)
        assert t["model.hidden"][i].tolist() == [fake.hidden(prompt[: p + 1]) for p in range(length)]
        seq = list(prompt)
        for step in range(opts["new_tokens"]):
            lp = fake.logprobs(seq)
            top2 = lp.topk(2).values
            assert int(t["model.greedy_ids"][i, step]) == int(lp.argmax())
            assert float(t["model.greedy_logprob"][i, step]) == pytest.approx(float(top2[0]))
            assert float(t["model.greedy_margin"][i, step]) == pytest.approx(float(top2[0] - top2[1]), abs=1e-6)
            seq.append(int(lp.argmax()))
    assert "final norm" in result["info"]["hidden_states"]


class _ChunkedHidden(_FakeSGLang):
    """An engine whose hidden states miss prompt positions (e.g. served from a prefix cache)."""

    def generate(self, **kwargs):
        outs = super().generate(**kwargs)
        for out in outs:
            if "hidden_states" in out["meta_info"]:
                out["meta_info"]["hidden_states"][0] = out["meta_info"]["hidden_states"][0][2:]
        return outs


def test_sglang_adapter_refuses_hidden_states_that_miss_positions(monkeypatch):
    pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="hidden states for 4 positions of a 6-token prompt"):
        _run_fake_sglang(monkeypatch, _ChunkedHidden)


# ---------------------------------------------------------------- llama.cpp adapter, against a fake llama_cpp

FAKE_LLAMA_CPP = '''
"""A stand-in for llama_cpp: logits are a fixed function of the prefix; embeddings of the position's prefix."""
import numpy as np

LLAMA_POOLING_TYPE_NONE = 0
V, H = 40, 6
made = []


def logits(prefix):
    seed = sum((i + 1) * (t + 3) for i, t in enumerate(prefix)) % 997
    return np.sin(np.arange(V, dtype=np.float64) * 0.37 + seed).astype(np.float32) * 4


def hidden(prefix):
    return [float(len(prefix) + j + sum(prefix) % 5) for j in range(H)]


class Llama:
    def __init__(self, model_path, **kw):
        self.path, self.kw, self.n_tokens, self.closed = model_path, kw, 0, False
        self.ids = []
        self.scores = np.zeros((kw["n_ctx"], V), dtype=np.float32)
        made.append(self)

    def n_vocab(self):
        return V

    def reset(self):
        self.n_tokens, self.ids = 0, []

    def eval(self, tokens):
        for t in tokens:
            self.ids.append(t)
            self.scores[self.n_tokens] = logits(self.ids)
            self.n_tokens += 1

    def close(self):
        self.closed = True
'''


def _run_fake_llamacpp(monkeypatch, tmp_path):
    probe = _probe_module()
    fake = type(sys)("llama_cpp")
    exec(FAKE_LLAMA_CPP, fake.__dict__)  # the test's own source
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    (tmp_path / "model-f32.gguf").write_bytes(b"GGUF")

    def hidden(path, ids, n_ctx, threads, col):
        for prompt in ids:
            col.add("hidden", np.asarray([fake.hidden(prompt[: t + 1]) for t in range(len(prompt))], dtype=np.float32))
        return "fake hidden"

    monkeypatch.setattr(probe.load_adapter("llamacpp"), "_hidden", hidden)
    ids = [[3, 7, 1, 30, 12, 5], [9, 9, 2, 31, 0, 4], [1, 2, 3, 4, 5, 6]]
    opts = {"dtype": "float32", "batch_size": 2, "top_k": 4, "attn": "sdpa", "full_logprobs": 2, "new_tokens": 3,
            "vocab": fake.V, "cpu_threads": 3}
    tensors, info = probe.run_adapter("llamacpp", str(tmp_path), ids, opts, "cpu")
    return probe, fake, ids, opts, {"tensors": tensors, "info": info}


def _log_softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_llamacpp_adapter_stores_llama_cpps_logits_in_the_common_layout(monkeypatch, tmp_path):
    from skupin.engines import llamacpp

    probe, fake, ids, opts, result = _run_fake_llamacpp(monkeypatch, tmp_path)
    t = result["tensors"]
    (llm,) = fake.made
    assert llm.closed and llm.path == str(tmp_path / "model-f32.gguf")
    assert {k: llm.kw[k] for k in ("logits_all", "type_k", "type_v", "seed", "n_threads")} == {
        "logits_all": True, "type_k": 0, "type_v": 0, "seed": 0, "n_threads": 3}
    assert all(isinstance(v, np.ndarray) for v in t.values())  # numpy only: the image has no torch
    assert {f"model.{name}" for name in llamacpp.OUTPUTS} <= set(t)
    n, length = len(ids), len(ids[0])
    assert t["model.logprobs_full"].shape == (2, length - 1, fake.V) and t["model.hidden"].shape == (n, length, fake.H)
    for i, prompt in enumerate(ids):
        for pos in range(length - 1):
            lp = _log_softmax64(fake.logits(prompt[: pos + 1]))
            assert t["model.target_logprob"][i, pos] == pytest.approx(lp[prompt[pos + 1]], abs=1e-6)
            assert list(t["model.topk_ids"][i, pos]) == list(np.argsort(-lp, kind="stable")[:4])
            if i < 2:
                assert np.allclose(t["model.logprobs_full"][i, pos], lp, atol=1e-6)
        seq = list(prompt)
        for step in range(opts["new_tokens"]):
            lp = _log_softmax64(fake.logits(seq))
            top2 = np.sort(lp)[::-1][:2]
            assert t["model.greedy_ids"][i, step] == int(lp.argmax())
            assert t["model.greedy_logprob"][i, step] == pytest.approx(top2[0], abs=1e-6)
            assert t["model.greedy_margin"][i, step] == pytest.approx(top2[0] - top2[1], abs=1e-5)
            seq.append(int(lp.argmax()))
    info = result["info"]
    assert info["gguf"] == "model-f32.gguf" and info["kv_cache"] == "F32" and info["threads"] == 3
    assert info["gguf_sha256"] == hashlib.sha256(b"GGUF").hexdigest()


def test_llamacpp_adapter_needs_exactly_one_gguf(monkeypatch, tmp_path):
    from skupin.imagetools.probe import skupin_probe_llamacpp as adapter

    with pytest.raises(RuntimeError, match="holds 0 GGUF files"):
        adapter._gguf_file(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(RuntimeError, match="holds 2 GGUF files"):
        adapter._gguf_file(str(tmp_path))


def test_probe_runs_llamacpp_without_torch(tmp_path):
    """An image with llama-cpp-python has numpy and no torch: env and model checks work, the kernel battery says why
    it cannot run, and the tensors are written from numpy arrays."""
    fake_dir = tmp_path / "site"
    fake_dir.mkdir()
    (fake_dir / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    (fake_dir / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")  # import torch fails
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 40}))
    (model / "model-f32.gguf").write_bytes(b"GGUF")
    prompts = {"format": "skupin-prompts/1", "new_tokens": 2, "prompts": [{"ids": [1, 5, 7, 9]}, {"ids": [1, 2, 3, 4]}]}
    (model / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(fake_dir)}
    # the fake has no embeddings context: the hidden-state pass is replaced
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import skupin.imagetools.probe.skupin_probe as p; "
            "p.load_adapter('llamacpp')._hidden = lambda *a: 'none'; sys.exit(p.main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "--model", str(model), "--prompts", str(model / "prompts.json"),
                           "--out", str(out), "--engine", "llamacpp", "--top-k", "3", "--full-logprobs", "1"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    report = json.loads((out / "probe.json").read_text())
    assert done.returncode == 1, done.stderr  # the kernel battery could not run
    assert report["checks"]["env"]["status"] == "ok" and report["env"]["torch"] is None
    assert report["env"]["engines"]["llamacpp"] is None  # the fake is no installed distribution
    assert "needs torch" in report["checks"]["kernels"]["error"]
    assert report["checks"]["model"]["status"] == "ok", report["checks"]["model"]
    tensors, _ = read_safetensors(out / "tensors.safetensors")
    assert tensors["model.topk_ids"].shape == (2, 3, 3) and tensors["model.logprobs_full"].shape == (1, 3, 40)
    assert tensors["model.input_ids"].dtype == np.int32 and "kernels.matmul.float32" not in tensors


def test_collector_pads_every_position_kind_to_the_longest_prompt_even_when_full_logprobs_skip_it():
    import importlib.util

    spec = importlib.util.spec_from_file_location("probe_module", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    col = probe.Collector(2, 1, numpy=True)  # full logprobs for the first prompt only, which is the shorter one
    for n in (3, 6):
        col.add("target_logprob", np.ones(n - 1, dtype=np.float32))
        col.add("hidden", np.ones((n, 4), dtype=np.float32))
    col.add("logprobs_full", np.ones((2, 8), dtype=np.float32))
    out = col.tensors()
    assert out["model.target_logprob"].shape == (2, 5) and out["model.hidden"].shape == (2, 6, 4)
    assert out["model.logprobs_full"].shape == (1, 5, 8)  # T - 1 positions, not the first prompt's 2
    assert out["model.logprobs_full"][0, 2:].sum() == 0 and out["model.target_logprob"][0, 2:].sum() == 0


def test_the_probe_hash_is_over_every_module_of_its_folder(tmp_path):
    """meta.json's probe_sha256 (docs/REFERENCES.md, "The probe's hash"): sha256sum's listing of the folder's *.py
    files, hashed; any module's bytes change it, compiled caches do not."""
    from skupin.gates.refdata.bundle import PROBE, probe_sha256

    assert PROBE == PROBE_DIR / "skupin_probe.py"
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sorted(PROBE_DIR.glob("*.py")))
    assert probe_sha256() == hashlib.sha256(listing.encode()).hexdigest()
    copy = tmp_path / "probe"
    copy.mkdir()
    for p in PROBE_DIR.glob("*.py"):
        (copy / p.name).write_bytes(p.read_bytes())
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "skupin_probe.cpython-311.pyc").write_bytes(b"cache")
    assert probe_sha256(copy) == probe_sha256()
    with (copy / "skupin_probe_vllm.py").open("a") as fh:
        fh.write("\n")
    assert probe_sha256(copy) != probe_sha256()
