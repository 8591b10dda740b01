"""The vLLM adapter's module ops (skupin_probe_vllm.py module_ops) without vLLM: what the host requires of a vLLM image,
the probe's release of the in-process engine, and the adapter's machinery for a module that runs only inside a forward
pass (the seeded rows swapped in, the output taken, the rotary table extended for the pass and given back), on stand-ins
for vLLM's objects. The real engine runs in the image (tests/integration/test_vllm.py)."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from skupin.engines import ALL_ENGINES, engine_modules
from skupin.gates.judge import modules as L
from skupin.gates.judge.ops import Battery, judge_ops
from skupin.imagetools.probe import skupin_probe as probe
from skupin.imagetools.probe import skupin_probe_ops as spec
from skupin.imagetools.probe import skupin_probe_vllm as vllm_adapter

torch = pytest.importorskip("torch")


def test_vllm_declares_its_module_ops_and_its_adapter_has_them() -> None:
    """The gate requires every module of the plan from a vLLM image at both dtypes (MODULES); SGLang's loaded model
    stays unreached (llama.cpp's are captured from its forward: test_module_ops_llamacpp.py)."""
    assert engine_modules("vllm") and engine_modules("transformers") and engine_modules("llamacpp")
    assert not engine_modules("sglang")
    assert ALL_ENGINES["vllm"].MODULES is True
    adapter = probe.load_adapter("vllm")
    assert callable(adapter.module_ops) and callable(adapter.release_modules)


def test_a_vllm_report_that_leaves_modules_out_fails_with_the_probes_reason() -> None:
    """What the image calls unreachable does not shrink the plan: each key it left out is missing, with its words."""
    model = L.host_model("tiny-llama")
    assert model is not None
    said = {"layer.1.attention": "vLLM's attention backends run only inside a running engine's forward context"}
    missing = L.missing_modules([], model, dtype="float32", uncovered=said)
    assert len(missing) == len(model.plan())
    assert "layer.1.attention.float32 (the probe says: vLLM's attention backends run only" in missing[4 * 1 + 2 + 1]
    result = judge_ops(Battery(results=()), calibrated=None, entry_key="cpu-x86_64/float32/tiny-llama", why="",
                       tf32_declared=False, settings={}, engine="vllm", missing=missing)
    assert result.status == "fail" and "embed.float32" in result.reason and result.details["missing"] == missing


def _ops_args(model_dir: str) -> argparse.Namespace:
    return argparse.Namespace(engine="vllm", model=model_dir, dtype="bfloat16", batch_size=1, top_k=20, attn="sdpa")


@pytest.mark.parametrize("fail", [False, True])
def test_the_probe_releases_the_engine_after_each_dtype_even_when_the_modules_fail(tmp_path, monkeypatch,
                                                                                   fail: bool) -> None:
    """vLLM's module ops start an engine in the probe's process: the probe calls release_modules after each dtype's
    modules ran (or failed), before the next load and before the model check starts its own engines."""
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1, "hidden_size": 8, "vocab_size": 16}')
    calls: list[str] = []

    def module_ops(model_dir, opts, device, spec_):
        calls.append(f"load {opts['dtype']}")
        if fail:
            raise RuntimeError("the engine did not start")
        return {"embed": lambda x: {"out": torch.zeros(spec_.LT, 8, dtype=x["ids"].dtype).float()}}, {}

    fake = types.SimpleNamespace(
        op_battery=lambda *a: ({"matmul": lambda x: {"out": torch.nn.functional.linear(x["x"], x["weight"])}}, {}),
        module_ops=module_ops, release_modules=lambda: calls.append("release"))
    monkeypatch.setattr(probe, "load_adapter", lambda engine: fake)
    _, info = probe.ops_check(_ops_args(str(tmp_path)), "cpu")
    if fail:
        assert calls == ["load bfloat16", "release"]
        assert info["modules"]["status"] == "error" and "did not start" in info["modules"]["error"]
    else:
        assert calls == ["load bfloat16", "release", "load float32", "release"]
        assert info["modules"]["status"] == "ok" and set(info["modules"]["ops"]) == {"embed.bfloat16", "embed.float32"}


# ---------------------------------------------------------------- the adapter's machinery on stand-ins


class _Rotary(torch.nn.Module):
    """Stands in for vLLM's rotary module: a cos_sin_cache buffer of max_position_embeddings rows (cos | sin halves)."""

    def __init__(self, head: int = 8, rows: int = 16) -> None:
        super().__init__()
        self.head_size = self.rotary_dim = head
        self.max_position_embeddings = rows
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        freqs = torch.arange(self.max_position_embeddings, dtype=torch.float)[:, None] * inv[None]
        return torch.cat((freqs.cos(), freqs.sin()), -1)


class _Attention(torch.nn.Module):
    """Stands in for a vLLM attention module: reads its positions through the rotary table (as the engine's rotary
    op does), so a position past the table fails."""

    def __init__(self, rotary: _Rotary) -> None:
        super().__init__()
        self.rotary_emb = rotary

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        angle = self.rotary_emb.cos_sin_cache.index_select(0, positions)[:, :1]
        return hidden_states * 2.0 + angle


def _stand_ins(monkeypatch, engine_rows: int):
    """A _Loaded over a one-layer stand-in model whose `generate` runs the layer's attention once on `engine_rows`
    engine rows (positions 0.., hidden states of ones), as a prefill does; vllm's SamplingParams and TokensPrompt
    stubbed."""
    rotary = _Rotary()
    layer = types.SimpleNamespace(self_attn=_Attention(rotary))
    decoder = types.SimpleNamespace(layers=[layer])
    seen: list[list[int]] = []

    def generate(prompts, params, use_tqdm=False):
        seen.append(list(prompts[0]["prompt_token_ids"]))
        layer.self_attn(positions=torch.arange(engine_rows), hidden_states=torch.ones(engine_rows, 4))

    model_config = types.SimpleNamespace(get_vocab_size=lambda: 64, dtype=torch.float32)
    llm = types.SimpleNamespace(generate=generate, llm_engine=types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(model_config=model_config)))
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    fake_inputs = types.ModuleType("vllm.inputs")
    fake_inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", fake_inputs)
    return vllm_adapter._Loaded(llm, types.SimpleNamespace(model=decoder), spec), rotary, seen


def test_a_module_inside_the_forward_pass_gets_the_seeded_rows_and_its_output_is_taken(monkeypatch) -> None:
    loaded, rotary, seen = _stand_ins(monkeypatch, engine_rows=6)
    impl = loaded.layer_module(0, "attention", [])
    x = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    positions = torch.tensor([3, 100, 200, 40])  # past the 16-row table: the pass extends it by the module's formula
    out = impl({"x": x, "positions": positions})["out"]
    longer = _Rotary(rows=201)._compute_cos_sin_cache()
    assert torch.equal(out, x * 2.0 + longer.index_select(0, positions)[:, :1])
    assert rotary.cos_sin_cache.shape[0] == 16  # the loaded table is given back after the pass
    assert len(seen) == 1 and len(seen[0]) == 4  # one sequence of exactly the seeded rows: causal over them
    assert not rotary._forward_pre_hooks and not rotary._forward_hooks
    assert not loaded.decoder.layers[0].self_attn._forward_pre_hooks
    assert not loaded.decoder.layers[0].self_attn._forward_hooks


def test_a_forward_pass_with_fewer_rows_than_the_seeded_ones_is_an_error_not_a_partial_output(monkeypatch) -> None:
    loaded, _, _ = _stand_ins(monkeypatch, engine_rows=2)
    impl = loaded.layer_module(0, "attention", [])
    with pytest.raises(RuntimeError, match="not room for"):
        impl({"x": torch.ones(4, 4), "positions": torch.arange(4)})


def test_the_rotary_table_is_the_loaded_cache_where_it_has_rows_and_the_modules_formula_past_it(monkeypatch) -> None:
    """Rows of the loaded cos_sin_cache (a fault in the loaded table shows) up to max_position_embeddings, the module's
    own formula past it; each half repeated, as neox pairs apply them."""
    loaded, rotary, _ = _stand_ins(monkeypatch, engine_rows=4)
    rotary.cos_sin_cache[5] += 0.5  # a table the loader changed
    got = loaded.rotary({"positions": torch.tensor([0, 5, 15, 40])})
    exact = _Rotary(rows=41)._compute_cos_sin_cache()
    assert got["cos"].shape == (4, 8) and torch.equal(got["cos"][:, :4], got["cos"][:, 4:])
    assert torch.equal(got["cos"][2:, :4], exact[[15, 40], :4]) and torch.equal(got["sin"][3, 4:], exact[40, 4:])
    assert torch.equal(got["cos"][1, :4], exact[5, :4] + 0.5)
    assert rotary.max_position_embeddings == 16 and rotary.cos_sin_cache.shape[0] == 16


def test_an_expert_is_forced_by_its_router_logits_inside_the_pass(monkeypatch) -> None:
    """A single expert runs through the block's fused experts with logits that put it 120 above the others."""
    loaded, _, _ = _stand_ins(monkeypatch, engine_rows=4)
    got: dict[str, torch.Tensor] = {}

    class Experts(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
            got["logits"] = router_logits
            return hidden_states + router_logits.argmax(-1, keepdim=True).float()

    experts = Experts()
    block = types.SimpleNamespace(experts=experts)
    layer = loaded.decoder.layers[0]

    def generate(prompts, params, use_tqdm=False):
        layer.block_sparse_moe.experts(torch.zeros(5, 4), torch.zeros(5, 8))

    layer.block_sparse_moe = block
    loaded.llm.generate = generate
    out = loaded.layer_module(0, "expert", ["3"])({"x": torch.ones(4, 4)})["out"]
    assert torch.equal(out, torch.full((4, 4), 4.0))
    assert torch.equal(got["logits"][:4].argmax(-1), torch.full((4,), 3)) and got["logits"][0, 3] - got["logits"][0, 0] == 120
    assert not got["logits"][4].any()  # an engine row past the seeded ones keeps its logits
