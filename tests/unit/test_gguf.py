"""The fixture as GGUF (gates/refdata/gguf.py): exact bytes, llama.cpp's names, shapes, RoPE permutation, metadata, tokenizer."""

from __future__ import annotations

import hashlib
import heapq
import json
from pathlib import Path

import numpy as np
import pytest

from skupin.common.errors import BundleError
from skupin.gates.refdata import fixture
from skupin.gates.refdata import gguf as g
from skupin.gates.refdata.tensorio import read_safetensors

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "gates" / "fixtures" / "tiny-llama"


@pytest.fixture(scope="module")
def tiny_f32() -> bytes:
    return g.gguf_bytes(folder=FIXTURE, name="tiny-llama", file_type="f32")


@pytest.fixture(scope="module")
def reader(tiny_f32: bytes, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gguf") / "model-f32.gguf"
    path.write_bytes(tiny_f32)
    return gguf.GGUFReader(path)


def _field(reader, key: str):
    f = reader.fields[key]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


@pytest.mark.parametrize("file_type", g.FILE_TYPES)
def test_each_file_type_has_the_recorded_bytes(file_type: str, tiny_f32: bytes) -> None:
    data = tiny_f32 if file_type == "f32" else g.gguf_bytes(folder=FIXTURE, name="tiny-llama", file_type=file_type)
    assert hashlib.sha256(data).hexdigest() == g.EXPECTED["tiny-llama"][file_type]
    assert set(g.EXPECTED["llama-1k"]) == set(g.FILE_TYPES)  # llama-1k (428 MB as f32) is checked where it is used


def test_tensor_names_shapes_and_types_are_llama_cpps(reader) -> None:
    spec = fixture.SPECS["tiny-llama"]
    tensors = {t.name: t for t in reader.tensors}
    expected = {g.tensor_name(n): shape for n, shape in fixture.weight_shapes(spec).items()}
    assert set(tensors) == set(expected)
    assert {"token_embd.weight", "output_norm.weight", "output.weight", "blk.0.attn_q.weight", "blk.2.ffn_down.weight",
            "blk.1.attn_norm.weight", "blk.1.ffn_norm.weight", "blk.0.attn_output.weight"} <= set(tensors)
    for name, t in tensors.items():
        assert tuple(reversed([int(d) for d in t.shape])) == expected[name], name  # GGUF lists ne[0] first
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
    assert [t.name for t in reader.tensors][:2] == ["token_embd.weight", "blk.0.attn_norm.weight"]


def test_q_and_k_rows_are_permuted_for_interleaved_rope_and_the_rest_is_verbatim(reader) -> None:
    params, _ = read_safetensors(FIXTURE / "model.safetensors")  # stored as BF16, read back as float32
    tensors = {t.name: np.asarray(t.data).reshape(tuple(reversed([int(d) for d in t.shape]))) for t in reader.tensors}
    spec = fixture.SPECS["tiny-llama"]
    q, k = params["model.layers.1.self_attn.q_proj.weight"], params["model.layers.1.self_attn.k_proj.weight"]
    assert np.array_equal(tensors["blk.1.attn_q.weight"], g.permute(q, spec.heads))
    assert np.array_equal(tensors["blk.1.attn_k.weight"], g.permute(k, spec.kv_heads))
    assert np.array_equal(g.unpermute(tensors["blk.1.attn_k.weight"], spec.kv_heads), k)
    assert np.array_equal(tensors["blk.1.attn_v.weight"], params["model.layers.1.self_attn.v_proj.weight"])
    assert np.array_equal(tensors["output.weight"], params["lm_head.weight"])


def test_permute_turns_rotate_half_pairs_into_adjacent_pairs() -> None:
    """transformers rotates (x[i], x[i + d/2]) per head; llama.cpp (normal RoPE) rotates (x[2i], x[2i + 1])."""
    heads, d, cols = 3, 8, 2
    w = np.arange(heads * d * cols, dtype=np.float32).reshape(heads * d, cols)
    p = g.permute(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            assert np.array_equal(p[h * d + 2 * i], w[h * d + i])
            assert np.array_equal(p[h * d + 2 * i + 1], w[h * d + i + d // 2])
    assert np.array_equal(g.unpermute(p, heads), w)


def test_metadata_matches_the_fixture_config(reader) -> None:
    spec = fixture.SPECS["tiny-llama"]
    meta = {key: _field(reader, key) for key in reader.fields if not key.startswith("GGUF.")}
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "tiny-llama"
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert (meta["llama.context_length"], meta["llama.embedding_length"], meta["llama.block_count"],
            meta["llama.feed_forward_length"]) == (spec.max_positions, spec.hidden, spec.layers, spec.intermediate)
    assert (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]) == (spec.heads, spec.kv_heads)
    assert meta["llama.rope.freq_base"] == 10000.0 and meta["llama.rope.dimension_count"] == spec.hidden // spec.heads
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert meta["llama.vocab_size"] == spec.vocab
    assert meta["tokenizer.ggml.model"] == "llama"
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"],
            meta["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.ggml.add_space_prefix"] is True
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == spec.vocab and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert meta["tokenizer.ggml.token_type"][:4] == [g.TOKEN_UNKNOWN, g.TOKEN_CONTROL, g.TOKEN_CONTROL, g.TOKEN_NORMAL]
    assert meta["tokenizer.ggml.scores"][3:6] == [-3.0, -4.0, -5.0]


def test_quantized_and_bf16_files_keep_norms_f32(tmp_path: Path) -> None:
    for file_type, matrix in (("bf16", gguf.GGMLQuantizationType.BF16), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        path = tmp_path / g.file_name(file_type)
        path.write_bytes(g.gguf_bytes(folder=FIXTURE, name="tiny-llama", file_type=file_type))
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
        assert types["output_norm.weight"] == types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
        assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == types["output.weight"] == matrix


def _spm_tokenize(vocab: dict[str, int], scores: list[float], text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm_session) in Python: space prefix, ' ' -> U+2581, then
    repeatedly merge the adjacent pair whose concatenation is the highest-scoring token (ties: the leftmost)."""
    syms = list("\u2581" + text.replace(" ", "\u2581"))
    right = [*range(1, len(syms)), -1]
    left = list(range(-1, len(syms) - 1))
    alive = [True] * len(syms)
    heap: list[tuple[float, int, str, int]] = []

    def push(a: int, b: int) -> None:
        if a >= 0 and b >= 0 and syms[a] + syms[b] in vocab:
            heapq.heappush(heap, (-scores[vocab[syms[a] + syms[b]]], a, syms[a] + syms[b], b))

    for i in range(len(syms) - 1):
        push(i, i + 1)
    while heap:
        _, a, text_ab, b = heapq.heappop(heap)
        if not (alive[a] and alive[b] and right[a] == b and syms[a] + syms[b] == text_ab):
            continue
        syms[a], alive[b], right[a] = text_ab, False, right[b]
        if right[b] >= 0:
            left[right[b]] = a
        push(left[a], a)
        push(a, right[a])
    out, i = [], 0
    while i >= 0:
        out.append(vocab[syms[i]])  # every symbol is a token: the prompts use the tokenizer's alphabet only
        i = right[i]
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "llama-1k"])
def test_llama_cpps_tokenizer_gives_the_recorded_ids_for_every_prompt(name: str, tmp_path: Path) -> None:
    if name == "tiny-llama":
        folder = FIXTURE
    else:  # the tokenizer and prompts of llama-1k, without its 100 MB of weights
        spec = fixture.SPECS[name]
        words = fixture.word_list(spec)
        tok = fixture.train_tokenizer(spec, words)
        folder = tmp_path
        (folder / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
        (folder / "prompts.json").write_text(json.dumps({"prompts": fixture.prompt_set(spec, tok, words)}))
    tokens, scores, _ = g.tokenizer_vocab(folder, "<unk>")
    vocab = {t: i for i, t in enumerate(tokens)}
    prompts = json.loads((folder / "prompts.json").read_text())["prompts"]
    assert len(prompts) == 64
    for p in prompts:
        assert [1, *_spm_tokenize(vocab, scores, p["text"])] == p["ids"]


def test_llama_cpp_itself_tokenizes_every_prompt_to_the_recorded_ids(tmp_path: Path) -> None:
    """With llama-cpp-python installed (not in CI's .venv): the same check through llama.cpp's own tokenizer."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / "model-q8_0.gguf"
    path.write_bytes(g.gguf_bytes(folder=FIXTURE, name="tiny-llama", file_type="q8_0"))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for p in json.loads((FIXTURE / "prompts.json").read_text())["prompts"]:
            assert llm.tokenize(p["text"].encode(), add_bos=True) == p["ids"]
            assert llm.detokenize(p["ids"]).decode() == p["text"]  # from <s> on: no space before the first word
    finally:
        llm.close()


def test_gguf_model_caches_checks_and_regenerates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = g.gguf_model(folder=FIXTURE, name="tiny-llama", file_type="q8_0", cache=tmp_path)
    assert path == tmp_path / "tiny-llama-model-q8_0.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == g.EXPECTED["tiny-llama"]["q8_0"]
    calls = []
    real = g.gguf_bytes
    monkeypatch.setattr(g, "gguf_bytes", lambda **kw: calls.append(kw) or real(**kw))
    assert g.gguf_model(folder=FIXTURE, name="tiny-llama", file_type="q8_0", cache=tmp_path) == path and not calls
    path.write_bytes(b"GGUF tampered")
    g.gguf_model(folder=FIXTURE, name="tiny-llama", file_type="q8_0", cache=tmp_path)
    assert len(calls) == 1 and hashlib.sha256(path.read_bytes()).hexdigest() == g.EXPECTED["tiny-llama"]["q8_0"]
    monkeypatch.setitem(g.EXPECTED, "tiny-llama", {**g.EXPECTED["tiny-llama"], "q8_0": "0" * 64})
    with pytest.raises(BundleError, match="not the recorded"):
        g.gguf_model(folder=FIXTURE, name="tiny-llama", file_type="q8_0", cache=tmp_path)
    with pytest.raises(BundleError, match="unknown GGUF file type 'q4_0'"):
        g.file_name("q4_0")
    assert g.file_type_of("model-bf16.gguf") == "bf16"


def test_model_folder_holds_the_fixture_and_the_gguf(tmp_path: Path) -> None:
    gguf_path = g.gguf_model(folder=FIXTURE, name="tiny-llama", file_type="q8_0", cache=tmp_path / "cache")
    out = g.model_folder(fixture_dir=FIXTURE, gguf_path=gguf_path, file_type="q8_0", out=tmp_path / "model")
    hashes = fixture.file_hashes(out)
    assert {n: h for n, h in hashes.items() if n != "model-q8_0.gguf"} == fixture.EXPECTED["tiny-llama"]
    names = sorted(p.name for p in out.iterdir())
    assert "model-q8_0.gguf" in names and "config.json" in names and "prompts.json" in names
    assert (out / "model-q8_0.gguf").read_bytes() == gguf_path.read_bytes()


def test_a_llamacpp_sku_gets_the_fixture_with_its_gguf_and_others_the_fixture_itself(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch):
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.gates.refdata import bundle

    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path / "state"))
    plain = load_manifest(REPO / "skus" / "cpu-x86_64.yaml")
    assert bundle.model_folder(manifest=plain, scratch=tmp_path, fixture_dir=FIXTURE) == FIXTURE
    engine = plain.stack.engine.model_copy(update={"name": "llamacpp", "package": "llama-cpp-python"})
    llama = plain.model_copy(update={"stack": plain.stack.model_copy(update={"engine": engine}),
                                     "gate": plain.gate.model_copy(update={"weights": "q8_0"})})
    folder = bundle.model_folder(manifest=llama, scratch=tmp_path, fixture_dir=FIXTURE)
    assert folder.parent == tmp_path and (folder / "model-q8_0.gguf").is_file()
    assert hashlib.sha256((folder / "model-q8_0.gguf").read_bytes()).hexdigest() == g.EXPECTED["tiny-llama"]["q8_0"]
    assert (tmp_path / "state" / "gguf" / "tiny-llama-model-q8_0.gguf").is_file()  # the checked cache
    bad = llama.model_copy(update={"gate": llama.gate.model_copy(update={"dtype": "float16", "weights": "full"})})
    with pytest.raises(BundleError, match="gate.weights: llama.cpp has no full-precision GGUF for dtype float16"):
        bundle.model_folder(manifest=bad, scratch=tmp_path, fixture_dir=FIXTURE)


@pytest.fixture(scope="module")
def moe_bf16(tmp_path_factory: pytest.TempPathFactory):
    """The MoE fixture (peaked-moe, generated here) and a reader of its BF16 GGUF."""
    folder = tmp_path_factory.mktemp("peaked-moe")
    fixture.generate_fixture(name="peaked-moe", out=folder)
    data = g.gguf_bytes(folder=folder, name="peaked-moe", file_type="bf16")
    path = folder / "model-bf16.gguf"
    path.write_bytes(data)
    return folder, data, gguf.GGUFReader(path)


def test_a_moe_fixtures_experts_are_stacked_per_projection_and_its_router_stays_f32(moe_bf16) -> None:
    """llama.cpp's converter merges a Mixtral layer's experts.N.w1/w3/w2 into ffn_gate/up/down_exps [experts, out, in]
    (expert order) and keeps ffn_gate_inp F32; expert_count and expert_used_count are the config's; the bytes are the
    recorded ones (both file types)."""
    folder, data, reader = moe_bf16
    assert hashlib.sha256(data).hexdigest() == g.EXPECTED["peaked-moe"]["bf16"]
    params, _ = read_safetensors(folder / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    assert not any(".experts." in name or "block_sparse_moe" in name for name in tensors)
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.asarray(tensors["blk.1.ffn_gate_inp.weight"].data),
                          params["model.layers.1.block_sparse_moe.gate.weight"].astype(np.float32))
    for w, name in g.EXPERT_TENSORS.items():
        t = tensors[f"blk.2.{name}.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.BF16
        values = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        stacked = np.stack([params[f"model.layers.2.block_sparse_moe.experts.{e}.{w}.weight"].astype(np.float32)
                            for e in range(8)])
        assert np.array_equal(values.reshape(stacked.shape), stacked), name
    assert (_field(reader, "llama.expert_count"), _field(reader, "llama.expert_used_count")) == (8, 2)
    assert hashlib.sha256(g.gguf_bytes(folder=folder, name="peaked-moe", file_type="f32")).hexdigest() == \
        g.EXPECTED["peaked-moe"]["f32"]


def test_the_fault_wheels_gguf_reader_finds_what_the_gguf_package_finds(moe_bf16) -> None:
    """tests/integration/derived/swap.py reads GGUF without the gguf package (the llama.cpp image has none): its
    tensor table (type, dims, offset) must be the package's, or its faults would write into the wrong bytes."""
    import importlib.util

    found = importlib.util.spec_from_file_location("swap_under_test", REPO / "tests/integration/derived/swap.py")
    assert found is not None and found.loader is not None
    swap = importlib.util.module_from_spec(found)
    found.loader.exec_module(swap)  # no mode baked in: it patches nothing
    _, data, reader = moe_bf16
    tensors, start = swap._gguf_tensors(data)
    assert start == reader.data_offset
    assert {name: (kind, dims, start + offset) for name, (kind, dims, offset) in tensors.items()} == {
        t.name: (int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset)) for t in reader.tensors}
