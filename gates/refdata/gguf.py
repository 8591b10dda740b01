"""Write a fixture as a llama-architecture GGUF file (llama.cpp's model format), bit-identically, and check it.

The layout follows llama.cpp's own converter (convert_hf_to_gguf.py, LlamaModel, as vendored in
llama-cpp-python 0.3.36): transformers' parameter names become GGUF tensor names
(``model.embed_tokens`` -> ``token_embd``, ``model.layers.N.self_attn.q_proj`` -> ``blk.N.attn_q``, ...),
the rows of the Q and K projections are permuted from transformers' rotate-half RoPE layout to
llama.cpp's interleaved one (``permute``), norms stay F32, and the hyperparameters go under
``llama.*`` (context length, embedding length, head counts, RoPE base and dimension, RMS epsilon).

File types (``FILE_TYPES``): ``f32`` (every tensor F32), ``bf16`` (matrices BF16, norms F32: the fixture's
weights are bf16-representable, so both are exact) and ``q8_0`` (matrices Q8_0: a *different model version*,
which the gate must fail against the full-precision reference).

Tokenizer (``TOKENIZER_MODEL``): the fixture's tokenizer is BPE with a Metaspace pre-tokenizer (a space becomes
U+2581 and one is prepended to the text: SentencePiece's convention, not GPT-2's byte-level one). llama.cpp's
``gpt2`` model cannot tokenize that text as the fixture does: its pre-tokenizers either map bytes to GPT-2's
alphabet (a space becomes U+0120, which the vocabulary does not have; the converter's ``default`` fallback) or,
the SentencePiece-style ones (``gemma4``), add no space before the first word, so the first token of every prompt
would differ, and llama-cpp-python's server takes prompts as text only. The GGUF therefore carries the
vocabulary as llama.cpp's ``llama`` (SentencePiece) model: the tokens verbatim, scores ``-id`` (the BPE
trainer numbers merged tokens in merge order, so the highest-scoring pair is the earliest merge), ``<unk>``
UNKNOWN, ``<s>`` and ``</s>`` CONTROL, the rest NORMAL, bos/eos/unk ids, add_bos, a space prefix. Merging by
score is not BPE in general; tests/unit/test_gguf.py proves it gives exactly the recorded ids for every prompt
of both fixtures (by llama.cpp's algorithm in Python, and with llama-cpp-python itself when it is installed).

The bytes depend only on the fixture files and the ``gguf`` package's writer; ``EXPECTED`` holds the sha256 of
every fixture x file type, and ``gguf_model`` regenerates into a cache and checks that sha256 before every use.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Final

import numpy as np

from skupin.builder.wheels import file_sha256
from skupin.common.errors import BundleError
from skupin.gates.refdata import fixture
from skupin.gates.refdata.tensorio import read_safetensors

FILE_TYPES: Final = ("f32", "bf16", "q8_0")
# llama.cpp tokenizer model written as tokenizer.ggml.model (see the module docstring and docs/GATE.md)
TOKENIZER_MODEL: Final = "llama"
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL = 1, 2, 3  # llama.cpp's token types (gguf.TokenType)

# sha256 of the GGUF of each fixture and file type, as written by gguf_bytes; regeneration must reproduce them.
EXPECTED: Final[dict[str, dict[str, str]]] = {
    "tiny-llama": {
        "f32": "4a9a9f79f39ada469a8046fe881d98545bedac8ea10c15ea07f9f13157f08ccc",
        "bf16": "d30cd5497c437d1bc95b42543937cf1d85db35f99ce5fe07f43d41743b4764b0",
        "q8_0": "effecb60fb980418795a1774fa7f1874031794ab45fd83be4dd7353bfbda9267",
    },
    "llama-1k": {
        "f32": "d24df08a2f92e20785cf5fb778c9d2f0c464d68a0ed4135303f20fa197aa1801",
        "bf16": "9c5dc6a4fabb3d2874f8aead333b467ec24b6ed43db0ee1aa4c43fafd360ebbb",
        "q8_0": "be31139539c8af51078ca85eae8897c1f966aa69bf26ae6a2538f751bbe4c0d6",
    },
    "peaked-moe": {  # a Mixtral-style MoE: experts stacked per projection (EXPERT_TENSORS), the router F32
        "f32": "d88d53ebae3fc3b8e205447feb71cdc772379cf27c210272bb121d9d9d5ef79c",
        "bf16": "7ad0bec93646f209b725e684f14eee20d987ae1311b6f5f3e1fa6a1833e7ca9b",
    },
}


def file_name(file_type: str) -> str:
    """The GGUF's name inside the model folder (model-f32.gguf, ...)."""
    if file_type not in FILE_TYPES:
        raise BundleError(f"unknown GGUF file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
    return f"model-{file_type}.gguf"


def file_type_of(name: str) -> str:
    """The file type of a GGUF named by file_name (model-f32.gguf -> f32)."""
    found = next((t for t in FILE_TYPES if file_name(t) == name), None)
    if found is None:
        raise BundleError(f"{name!r} names no GGUF file type the gate writes (model-<{'|'.join(FILE_TYPES)}>.gguf)")
    return found


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Q/K rows from transformers' rotate-half RoPE layout to llama.cpp's interleaved pairs (convert_hf_to_gguf's
    LlamaModel.permute with n_head already the K/V head count for K)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of permute."""
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# A Mixtral-style MoE layer's experts, stacked into one 3-D tensor per projection (the converter's LlamaModel merges
# ``block_sparse_moe.experts.N.wK`` so): w1 the gate, w3 the up, w2 the down projection.
EXPERT_TENSORS: Final = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def tensor_name(hf_name: str) -> str:
    """The GGUF tensor name of a transformers Llama (or Mixtral: the router) parameter."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) not in (5, 6) or parts[-1] != "weight":
        raise BundleError(f"no GGUF name for parameter {hf_name!r}")
    layer, module = parts[2], ".".join(parts[3:-1])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "block_sparse_moe.gate": "ffn_gate_inp"}
    if module not in names:
        raise BundleError(f"no GGUF name for parameter {hf_name!r}")
    return f"blk.{layer}.{names[module]}.weight"


def tokenizer_vocab(folder: Path, unk: str) -> tuple[list[str], list[float], list[int]]:
    """(tokens by id, scores, token types) of the fixture's tokenizer.json as llama.cpp's SentencePiece vocabulary."""
    doc = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = doc["model"]["vocab"]
    added = {t["id"]: t for t in doc.get("added_tokens", [])}
    size = max(len(vocab), max(added, default=-1) + 1)
    tokens = [""] * size
    for text, i in vocab.items():
        tokens[i] = text
    for i, t in added.items():
        tokens[i] = t["content"]
    if any(not t for t in tokens):
        raise BundleError(f"{folder}/tokenizer.json: token ids are not contiguous")
    types = [TOKEN_UNKNOWN if tokens[i] == unk else TOKEN_CONTROL if i in added and added[i].get("special")
             else TOKEN_NORMAL for i in range(size)]
    scores = [0.0 if types[i] != TOKEN_NORMAL else -float(i) for i in range(size)]
    return tokens, scores, types


def gguf_bytes(*, folder: Path, name: str, file_type: str) -> bytes:
    """The GGUF of the checked fixture folder `folder` (fixture `name`) as `file_type`."""
    import gguf  # imported here: only a llama.cpp SKU needs it

    file_name(file_type)
    spec = fixture.spec_for(name)
    cfg = json.loads((folder / "config.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    params, _ = read_safetensors(folder / "model.safetensors")
    head_dim = int(cfg["head_dim"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[file_type]
    matrix_type = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
                   "q8_0": gguf.GGMLQuantizationType.Q8_0}[file_type]
    tokens, scores, types = tokenizer_vocab(folder, tok_cfg["unk_token"])
    if len(tokens) != int(cfg["vocab_size"]):
        raise BundleError(f"{folder}: tokenizer has {len(tokens)} tokens, config.json vocab_size {cfg['vocab_size']}")

    with tempfile.TemporaryDirectory(prefix="skupin-gguf-") as tmp:
        path = Path(tmp) / "model.gguf"
        w = gguf.GGUFWriter(path, "llama")
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(spec.name)
        w.add_context_length(int(cfg["max_position_embeddings"]))
        w.add_embedding_length(int(cfg["hidden_size"]))
        w.add_block_count(int(cfg["num_hidden_layers"]))
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_rope_freq_base(float(cfg["rope_theta"]))
        w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_file_type(ftype)
        w.add_vocab_size(len(tokens))
        w.add_rope_dimension_count(head_dim)
        experts = int(cfg.get("num_local_experts") or 0)
        if experts:
            w.add_expert_count(experts)
            w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        w.add_tokenizer_model(TOKENIZER_MODEL)
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(int(cfg["bos_token_id"]))
        w.add_eos_token_id(int(cfg["eos_token_id"]))
        w.add_unk_token_id(tokens.index(tok_cfg["unk_token"]))
        w.add_add_bos_token(bool(tok_cfg["add_bos_token"]))
        w.add_add_eos_token(bool(tok_cfg["add_eos_token"]))
        w.add_add_space_prefix(True)  # the fixture's Metaspace pre-tokenizer prepends one (prepend_scheme "first")
        if file_type == "q8_0":
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, values in _tensors(params, experts):
            data = np.ascontiguousarray(values, dtype=np.float32)
            if name.endswith(".attn_q.weight"):
                data = permute(data, heads)
            elif name.endswith(".attn_k.weight"):
                data = permute(data, kv_heads)
            # norms and the router stay F32 (the converter's rule: 1-D tensors and ffn_gate_inp always)
            qtype = (matrix_type if data.ndim >= 2 and not name.endswith(".ffn_gate_inp.weight")
                     else gguf.GGMLQuantizationType.F32)
            if qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def _tensors(params: dict[str, np.ndarray], experts: int) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, values) of every tensor in writing order: each parameter under its GGUF name, a MoE layer's experts
    stacked per projection ([experts, out, in], expert order) after that layer's other tensors."""
    found: list[tuple[str, np.ndarray]] = []
    stacked: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for hf_name, values in _ordered(params):
        parts = hf_name.split(".")
        if experts and parts[3:5] == ["block_sparse_moe", "experts"]:
            stacked.setdefault(parts[2], {}).setdefault(int(parts[5]), {})[parts[6]] = values
            continue
        found.append((tensor_name(hf_name), values))
    for layer, per_expert in stacked.items():
        if sorted(per_expert) != list(range(experts)) or any(sorted(e) != sorted(EXPERT_TENSORS)
                                                             for e in per_expert.values()):
            raise BundleError(f"layer {layer} does not hold w1, w2 and w3 of each of its {experts} experts")
        at = max(i for i, (name, _) in enumerate(found) if name.startswith(f"blk.{layer}.")) + 1
        found[at:at] = [(f"blk.{layer}.{gguf_name}.weight", np.stack([per_expert[e][w] for e in range(experts)]))
                        for w, gguf_name in EXPERT_TENSORS.items()]
    return found


def _ordered(params: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """Parameters in the converter's order: embeddings, then each layer in order, then the final norm and head."""
    def key(name: str) -> tuple[int, int, str]:
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            return (0, 0, name)
        if parts[:2] == ["model", "layers"]:
            return (1, int(parts[2]), name)
        return (2, 0, name)
    return sorted(params.items(), key=lambda kv: key(kv[0]))


def gguf_model(*, folder: Path, name: str, file_type: str, cache: Path) -> Path:
    """The checked GGUF of fixture `name` (its checked folder `folder`) as `file_type`: taken from `cache` when its
    sha256 is the recorded one, else regenerated there (and checked); BundleError when it cannot be had as recorded."""
    expected = EXPECTED.get(name, {}).get(file_type)
    if expected is None:
        raise BundleError(f"fixture {name} has no recorded GGUF sha256 for {file_type}")
    cache = Path(cache)
    path = cache / f"{name}-{file_name(file_type)}"
    if path.is_file() and not path.is_symlink() and file_sha256(path) == expected:
        return path
    data = gguf_bytes(folder=folder, name=name, file_type=file_type)
    found = hashlib.sha256(data).hexdigest()
    if found != expected:
        raise BundleError(f"the {file_type} GGUF of fixture {name} was written with sha256 {found}, not the recorded "
                          f"{expected}: the gguf package wrote other bytes")
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=cache)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def model_folder(*, fixture_dir: Path, gguf_path: Path, file_type: str, out: Path) -> Path:
    """A model folder for a GGUF engine: the checked fixture's files (hard links, copies across file systems) and
    the checked GGUF as `file_name(file_type)`; `out` must not exist yet."""
    import shutil

    out = Path(out)
    out.mkdir(parents=True)
    sources = [(p, out / p.name) for p in sorted(Path(fixture_dir).iterdir()) if p.is_file()]
    sources.append((Path(gguf_path), out / file_name(file_type)))
    for src, dst in sources:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    return out
