"""The seeded model fixtures: bit-identical regeneration, the committed copy, the prompt set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from skupin.common.errors import BundleError
from skupin.gates.refdata import fixture
from skupin.gates.refdata.tensorio import read_dtypes, read_safetensors

COMMITTED = Path(__file__).resolve().parents[2] / "gates" / "fixtures" / "tiny-llama"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    out = tmp_path_factory.mktemp("fx") / "tiny-llama"
    return out, fixture.generate_fixture(name="tiny-llama", out=out)


def test_regeneration_reproduces_recorded_and_committed_sha256(regenerated):
    out, hashes = regenerated
    assert hashes == fixture.EXPECTED["tiny-llama"]
    assert (out / "SHA256SUMS").read_text() == (COMMITTED / "SHA256SUMS").read_text()
    for name in hashes:
        assert (out / name).read_bytes() == (COMMITTED / name).read_bytes(), name


def test_committed_fixture_checks_and_is_small():
    hashes = fixture.check_fixture(name="tiny-llama", folder=COMMITTED)
    assert fixture.digest_of(hashes) == fixture.fixture_digest("tiny-llama")
    assert sum(p.stat().st_size for p in COMMITTED.iterdir()) < 6.5 * 1024**2


@pytest.mark.parametrize("damage", ["byte", "missing", "extra"])
def test_check_fixture_refuses_a_damaged_folder(tmp_path, damage):
    folder = tmp_path / "tiny-llama"
    shutil.copytree(COMMITTED, folder)
    if damage == "byte":
        data = bytearray((folder / "model.safetensors").read_bytes())
        data[-3] ^= 0x01
        (folder / "model.safetensors").write_bytes(bytes(data))
        culprit = "model.safetensors"
    elif damage == "missing":
        (folder / "tokenizer.json").unlink()
        culprit = "tokenizer.json"
    else:
        (folder / "notes.txt").write_text("x")
        culprit = "notes.txt"
    with pytest.raises(BundleError, match=culprit):
        fixture.check_fixture(name="tiny-llama", folder=folder)


def test_unknown_fixture_name_is_refused(tmp_path):
    with pytest.raises(BundleError, match="known: deep-llama, llama-1k, peaked-moe, tiny-llama, tiny-moe"):
        fixture.generate_fixture(name="tiny-lama", out=tmp_path)


def test_weights_are_bf16_with_the_stated_distribution():
    spec = fixture.SPECS["tiny-llama"]
    assert set(read_dtypes(COMMITTED / "model.safetensors").values()) == {"BF16"}
    tensors, meta = read_safetensors(COMMITTED / "model.safetensors")
    assert meta == {"format": "pt"}
    assert {k: v.shape for k, v in tensors.items()} == fixture.weight_shapes(spec)
    assert all(np.all(v == 1.0) for k, v in tensors.items() if k.endswith("norm.weight"))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - spec.std) < 0.001 and abs(float(q.mean())) < 0.001
    config = json.loads((COMMITTED / "config.json").read_text())
    assert config["vocab_size"] == spec.vocab == tensors["lm_head.weight"].shape[0]


def test_prompt_set_round_trips_through_the_tokenizer():
    from tokenizers import Tokenizer

    doc = fixture.load_prompts(COMMITTED / "prompts.json")
    tok = Tokenizer.from_file(str(COMMITTED / "tokenizer.json"))
    assert tok.get_vocab_size() == fixture.SPECS["tiny-llama"].vocab
    assert len(doc["prompts"]) >= 64
    for prompt in doc["prompts"]:
        assert len(prompt["ids"]) == doc["seq_len"]
        assert tok.encode(prompt["text"]).ids == prompt["ids"]
        assert tok.decode(prompt["ids"], skip_special_tokens=True) == prompt["text"]
    assert len({tuple(p["ids"]) for p in doc["prompts"]}) == len(doc["prompts"])


def test_transformers_tokenizer_agrees_when_installed():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(COMMITTED))
    doc = fixture.load_prompts(COMMITTED / "prompts.json")
    assert all(tok(p["text"])["input_ids"] == p["ids"] for p in doc["prompts"])


def test_measurement_fixture_is_recorded_and_large_enough():
    spec = fixture.SPECS["llama-1k"]
    assert spec.hidden >= 1024
    assert set(fixture.EXPECTED["llama-1k"]) == set(fixture.EXPECTED["tiny-llama"])
    assert len(fixture.fixture_digest("llama-1k")) == 64


def test_the_moe_fixture_is_mixtral_shaped_and_regenerates_bit_for_bit(tmp_path):
    spec = fixture.SPECS["tiny-moe"]
    assert spec.moe and spec.experts == 8 and spec.experts_per_token == 2 and spec.layers >= 4
    config = fixture.config(spec)
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    names = fixture.weight_shapes(spec)
    assert names["model.layers.3.block_sparse_moe.gate.weight"] == (8, spec.hidden)  # Mixtral's Hub layout
    assert names["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (spec.hidden, spec.intermediate)
    assert not any(".mlp." in n for n in names)
    w = fixture.weights(spec)
    router = w["model.layers.0.block_sparse_moe.gate.weight"]
    expert = w["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    assert 0.2 < router.std() < 0.3 and 0.015 < expert.std() < 0.025  # routing decided by margins, experts small
    assert fixture.generate_fixture(name="tiny-moe", out=tmp_path) == fixture.EXPECTED["tiny-moe"]
    # same tokenizer as tiny-llama (same corpus seed and vocabulary); its own prompts.json names the fixture
    assert fixture.EXPECTED["tiny-moe"]["tokenizer.json"] == fixture.EXPECTED["tiny-llama"]["tokenizer.json"]


def test_the_moe_fixture_loads_in_transformers_with_every_weight_where_it_belongs(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    fixture.generate_fixture(name="tiny-moe", out=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    raw = fixture.weights(fixture.SPECS["tiny-moe"])
    experts = model.model.layers[2].mlp.experts  # transformers 5 fuses each layer's experts into 3-D tensors
    # stored as BF16: the drawn float32 numbers rounded once
    w1 = torch.from_numpy(raw["model.layers.2.block_sparse_moe.experts.5.w1.weight"]).bfloat16().float()
    w2 = torch.from_numpy(raw["model.layers.2.block_sparse_moe.experts.5.w2.weight"]).bfloat16().float()
    assert torch.equal(experts.gate_up_proj[5][: w1.shape[0]], w1) and torch.equal(experts.down_proj[5], w2)
    assert model.config.num_experts_per_tok == 2


@pytest.mark.parametrize("name", ["tiny-moe", "deep-llama"])
def test_ragged_prompt_sets_pad_every_batch_and_load(name, tmp_path):
    spec = fixture.SPECS[name]
    lengths = fixture.prompt_lengths(spec)
    assert lengths[0] == spec.prompt_tokens == max(lengths) and min(lengths) >= spec.min_prompt_tokens == 16
    assert all(len(set(lengths[i:i + 8])) > 1 for i in range(0, 64, 8))  # every batch of 8 pads
    folder = tmp_path / name
    fixture.generate_fixture(name=name, out=folder)
    doc = fixture.load_prompts(folder / "prompts.json")
    assert [len(p["ids"]) for p in doc["prompts"]] == lengths and doc["min_seq_len"] == 16
    assert fixture.SPECS["deep-llama"].layers == 8


def test_a_prompt_set_outside_its_stated_lengths_is_refused(tmp_path):
    fixture.generate_fixture(name="deep-llama", out=tmp_path)
    doc = json.loads((tmp_path / "prompts.json").read_text())
    doc["prompts"][3]["ids"] = doc["prompts"][3]["ids"][:5]  # shorter than min_seq_len
    (tmp_path / "prompts.json").write_text(json.dumps(doc))
    with pytest.raises(BundleError, match="between 16 and seq_len=64 ids"):
        fixture.load_prompts(tmp_path / "prompts.json")


def test_cli_fixture_choices_match_the_specs():
    from skupin.cli.reference import FIXTURE_NAMES
    from skupin.gates.refdata.fixture import SPECS

    assert sorted(FIXTURE_NAMES) == sorted(SPECS)


def test_the_shaped_fixture_carries_outlier_channels_peaked_attention_and_outputs_and_long_prompts(tmp_path):
    spec = fixture.SPECS["peaked-moe"]
    assert spec.moe and spec.qk_std and spec.lm_head_std and spec.outliers
    assert not (fixture.SPECS["tiny-moe"].qk_std or fixture.SPECS["tiny-moe"].outliers)
    outliers = fixture.outlier_channels(spec)
    assert len(outliers) == 2 and outliers == fixture.outlier_channels(spec)  # drawn from the seed, not chosen
    w = fixture.weights(spec)
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.3.post_attention_layernorm.weight"):
        gains = w[name]
        assert set(np.flatnonzero(gains != 1.0)) == set(outliers) and (gains[outliers] == spec.outlier_gain).all()
    # large query-key scores and next-token logits; everything else as tiny-moe draws it
    assert 0.09 < w["model.layers.1.self_attn.q_proj.weight"].std() < 0.11
    assert 0.09 < w["model.layers.1.self_attn.k_proj.weight"].std() < 0.11
    assert 0.015 < w["model.layers.1.self_attn.v_proj.weight"].std() < 0.025
    assert 0.28 < w["lm_head.weight"].std() < 0.32
    assert fixture.prompt_lengths(spec)[0] == 128 and min(fixture.prompt_lengths(spec)) >= 32
    assert fixture.generate_fixture(name="peaked-moe", out=tmp_path) == fixture.EXPECTED["peaked-moe"]
    # an unshaped spec draws exactly what it drew before the shaping knobs existed (its recorded sha256 still holds)
    assert fixture.outlier_channels(fixture.SPECS["tiny-moe"]) == []
