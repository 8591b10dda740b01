"""Generate the gate's model fixtures bit-identically from seeds, and check a folder against them.

A fixture is a causal LM in a real checkpoint layout -- Llama (transformers' LlamaConfig) or, with
``experts`` set, a Mixtral-style mixture of experts (top-k routing over ``experts`` SwiGLU experts
per layer, stored under Mixtral's Hub names ``block_sparse_moe.gate`` / ``experts.N.w1|w2|w3``) --
whose weights are drawn from numpy's ``default_rng`` (N(0, std), the router N(0, router_std) so
that routing is decided by clear margins, norms 1 -- a shaped fixture draws q/k and lm_head larger and gives a few
outlier channels a larger norm weight, as a trained model has them -- rounded to bfloat16 and stored as BF16
so fp32 and bf16 runs start from the same numbers), a BPE tokenizer trained offline with the
``tokenizers`` library on a seeded word corpus (vocab size equal to the model's), and a fixed
prompt set (``prompts.json``: text and token ids of every prompt). Nothing here needs torch, so
the bytes are identical on every machine; the expected sha256 of every file is recorded below.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from skupin.common.errors import BundleError
from skupin.gates.refdata.tensorio import encode_safetensors

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PROMPTS_FORMAT = "skupin-prompts/1"
SUMS_NAME = "SHA256SUMS"
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class FixtureSpec:
    """Shape and seeds of one fixture."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    weight_seed: int = 1234
    corpus_seed: int = 4321
    prompt_seed: int = 7
    words: int = 6000
    sentences: int = 30000
    prompts: int = 64
    prompt_tokens: int = 64  # token ids per prompt, the leading <s> included (the longest, with min_prompt_tokens)
    min_prompt_tokens: int = 0  # > 0: each prompt's length drawn from [min_prompt_tokens, prompt_tokens], so batches pad
    new_tokens: int = 16  # greedy continuation length the probe generates
    full_logprobs: int = 4  # prompts whose full-vocabulary logprobs the probe stores (bundles and gate runs alike)
    std: float = 0.02
    max_positions: int = 512
    experts: int = 0  # > 0: a Mixtral-style MoE with this many experts per layer (intermediate = per expert)
    experts_per_token: int = 0
    router_std: float = 0.0
    # Structure a trained model has and N(0, std) weights lack (0 = off; the fixtures above use none of it):
    qk_std: float = 0.0  # > 0: q_proj and k_proj drawn N(0, qk_std): large query-key scores, peaked attention
    lm_head_std: float = 0.0  # > 0: lm_head drawn N(0, lm_head_std): peaked next-token distributions
    outliers: int = 0  # hidden channels whose every norm weight is outlier_gain: outlier channels in the activations
    outlier_gain: float = 1.0  # that every matrix product reads and the final hidden state carries

    @property
    def moe(self) -> bool:
        return self.experts > 0


SPECS: dict[str, FixtureSpec] = {
    "tiny-llama": FixtureSpec("tiny-llama", hidden=256, layers=3, heads=4, kv_heads=2, intermediate=512, vocab=2048),
    "llama-1k": FixtureSpec("llama-1k", hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vocab=8192,
                            words=12000, sentences=60000, full_logprobs=2),
    # Mixtral-style: 8 experts, top-2 routing (the code path of 4-bit MoE serving); tiny-llama's tokenizer (same
    # corpus and vocabulary), its own ragged prompts.
    "tiny-moe": FixtureSpec("tiny-moe", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256, vocab=2048,
                            experts=8, experts_per_token=2, router_std=0.25, min_prompt_tokens=16),
    # deeper and narrow: 8 decoder layers (a partial swap of one layer is one eighth of the network), ragged prompts
    "deep-llama": FixtureSpec("deep-llama", hidden=128, layers=8, heads=4, kv_heads=2, intermediate=384, vocab=2048,
                              min_prompt_tokens=16),
    # shaped like a trained model (docs/REFERENCES.md, "peaked-moe"): tiny-moe's layout with peaked attention
    # (normalised entropy ~0.8), two outlier channels every matrix product reads (4x), peaked next-token distributions
    # and ragged prompts of 32-128 ids, so RoPE, attention, norm and routing faults reach the outputs
    "peaked-moe": FixtureSpec("peaked-moe", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256, vocab=2048,
                              experts=8, experts_per_token=2, router_std=0.25, min_prompt_tokens=32,
                              prompt_tokens=128, qk_std=0.1, lm_head_std=0.3, outliers=2, outlier_gain=4.0,
                              full_logprobs=1),  # a full row is 1 MB at 128 positions: the bundles stay small
}

# sha256 of every file of each fixture, as generated; regeneration must reproduce them.
EXPECTED: dict[str, dict[str, str]] = {
    "tiny-llama": {
        "config.json": "0b024fcc8b106601f40201b18c7dcc982547147be46a27089d4b7222d13e094a",
        "generation_config.json": "9560e1c7353131b230d9e8aa59199400e94048474fd8ba7f1bde3aeba52a2369",
        "model.safetensors": "87bf6ec669d645c9c7f85ecc1e09309cb7c57f1a012cf99b64752a3fdd41c386",
        "prompts.json": "676532813997cd7375e700fa928b3ef54e2993e7877dbbad2a3e2f172ca24c43",
        "special_tokens_map.json": "7f7ba0811f62f76051a24e6c025bcd2b222e0e26ae9a603179544c72d7c3e952",
        "tokenizer.json": "eef8669a8ef2f6bec2818a91332dddc3ce90dcab170cc880a1ff860969a5ae20",
        "tokenizer_config.json": "d9c43c46ba0f03b993142c7b655b615a22ad2706ba83455b820e20188a9ec97d",
    },
    "llama-1k": {
        "config.json": "f172b4bd3864507a86e31450b830354f134449679f934f3189ba9affbe3330fc",
        "generation_config.json": "9560e1c7353131b230d9e8aa59199400e94048474fd8ba7f1bde3aeba52a2369",
        "model.safetensors": "85c55037d806ab9aa30f9fc0638fe435e56a4a9753a63c35c3fa6b51f2d3a64a",
        "prompts.json": "9c4779c716085a0786bf58380bfec317a29b665ef18d981ece3fae583fe14630",
        "special_tokens_map.json": "7f7ba0811f62f76051a24e6c025bcd2b222e0e26ae9a603179544c72d7c3e952",
        "tokenizer.json": "218f8e162b4fea1b2c93693cbca023c8eb2f9b78b95fb7994c24cf2af6ed26d6",
        "tokenizer_config.json": "d9c43c46ba0f03b993142c7b655b615a22ad2706ba83455b820e20188a9ec97d",
    },
    "tiny-moe": {
        "config.json": "3dbdc50e38c6226d527c365cb5fe2cd8faa74a139ad2683b84d45230c4962162",
        "generation_config.json": "9560e1c7353131b230d9e8aa59199400e94048474fd8ba7f1bde3aeba52a2369",
        "model.safetensors": "d2da21450c2cebc20b4a6ad71e2ec0b9ff4d4d404c29cfc2713ff3f81cab8a77",
        "prompts.json": "7fb4bb44d2c61700812428913db42262be1ce22d3c9d264594d993d71c2e0069",
        "special_tokens_map.json": "7f7ba0811f62f76051a24e6c025bcd2b222e0e26ae9a603179544c72d7c3e952",
        "tokenizer.json": "eef8669a8ef2f6bec2818a91332dddc3ce90dcab170cc880a1ff860969a5ae20",
        "tokenizer_config.json": "d9c43c46ba0f03b993142c7b655b615a22ad2706ba83455b820e20188a9ec97d",
    },
    "deep-llama": {
        "config.json": "7f8e4f615ce6e8926fda421fc8ccd6e0abb9d559b033666d007e3d510219eb5d",
        "generation_config.json": "9560e1c7353131b230d9e8aa59199400e94048474fd8ba7f1bde3aeba52a2369",
        "model.safetensors": "5857391728ceec5d93b38d6400a4a99bee983edfa0ae1c86ea82b83f0882b982",
        "prompts.json": "1604b278df2a48015f32481b58736e229eb0411a6249d591153972ce09651260",
        "special_tokens_map.json": "7f7ba0811f62f76051a24e6c025bcd2b222e0e26ae9a603179544c72d7c3e952",
        "tokenizer.json": "eef8669a8ef2f6bec2818a91332dddc3ce90dcab170cc880a1ff860969a5ae20",
        "tokenizer_config.json": "d9c43c46ba0f03b993142c7b655b615a22ad2706ba83455b820e20188a9ec97d",
    },
    "peaked-moe": {
        "config.json": "3dbdc50e38c6226d527c365cb5fe2cd8faa74a139ad2683b84d45230c4962162",
        "generation_config.json": "9560e1c7353131b230d9e8aa59199400e94048474fd8ba7f1bde3aeba52a2369",
        "model.safetensors": "8ee4779131dafe635bd2166884f3dd021c2b60accf8e42d9a2520f8a9f2320a6",
        "prompts.json": "3f75bb7f07fa65d6852a5adf0f10abcc28e9aa047436a8c598dc90ecf6c0434d",
        "special_tokens_map.json": "7f7ba0811f62f76051a24e6c025bcd2b222e0e26ae9a603179544c72d7c3e952",
        "tokenizer.json": "eef8669a8ef2f6bec2818a91332dddc3ce90dcab170cc880a1ff860969a5ae20",
        "tokenizer_config.json": "d9c43c46ba0f03b993142c7b655b615a22ad2706ba83455b820e20188a9ec97d",
    },
}


def spec_for(name: str) -> FixtureSpec:
    """The spec of fixture `name`, or BundleError listing the known ones."""
    try:
        return SPECS[name]
    except KeyError:
        raise BundleError(f"unknown fixture {name!r}; known: {', '.join(sorted(SPECS))}") from None


# ---------------------------------------------------------------- weights and config


def weight_shapes(spec: FixtureSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model under its transformers name, with its shape."""
    head_dim = spec.hidden // spec.heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab, spec.hidden),
        "model.norm.weight": (spec.hidden,),
        "lm_head.weight": (spec.vocab, spec.hidden),
    }
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (spec.hidden,),
            p + "post_attention_layernorm.weight": (spec.hidden,),
            p + "self_attn.q_proj.weight": (spec.heads * head_dim, spec.hidden),
            p + "self_attn.k_proj.weight": (spec.kv_heads * head_dim, spec.hidden),
            p + "self_attn.v_proj.weight": (spec.kv_heads * head_dim, spec.hidden),
            p + "self_attn.o_proj.weight": (spec.hidden, spec.heads * head_dim),
        }
        if spec.moe:
            m = p + "block_sparse_moe."
            shapes[m + "gate.weight"] = (spec.experts, spec.hidden)
            for e in range(spec.experts):
                shapes |= {
                    f"{m}experts.{e}.w1.weight": (spec.intermediate, spec.hidden),
                    f"{m}experts.{e}.w2.weight": (spec.hidden, spec.intermediate),
                    f"{m}experts.{e}.w3.weight": (spec.intermediate, spec.hidden),
                }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (spec.intermediate, spec.hidden),
                p + "mlp.up_proj.weight": (spec.intermediate, spec.hidden),
                p + "mlp.down_proj.weight": (spec.hidden, spec.intermediate),
            }
    return shapes


def outlier_channels(spec: FixtureSpec) -> list[int]:
    """The hidden channels that carry outliers: spec.outliers distinct ones drawn from weight_seed + 1."""
    if not spec.outliers:
        return []
    rng = np.random.default_rng(spec.weight_seed + 1)
    return sorted(int(c) for c in rng.choice(spec.hidden, size=spec.outliers, replace=False))


def _std(spec: FixtureSpec, name: str) -> float:
    if name.endswith("block_sparse_moe.gate.weight"):
        return spec.router_std
    if spec.qk_std and name.endswith(("q_proj.weight", "k_proj.weight")):
        return spec.qk_std
    if spec.lm_head_std and name == "lm_head.weight":
        return spec.lm_head_std
    return spec.std


def weights(spec: FixtureSpec) -> dict[str, np.ndarray]:
    """float32 weights (bf16-representable): norms 1 (outlier_gain on the outlier channels), routers N(0, router_std),
    q/k N(0, qk_std) and lm_head N(0, lm_head_std) where set, the rest N(0, std), drawn in sorted name order."""
    rng = np.random.default_rng(spec.weight_seed)
    outliers = outlier_channels(spec)
    out = {}
    for name, shape in sorted(weight_shapes(spec).items()):
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype=np.float32)
            out[name][outliers] = spec.outlier_gain
        else:
            out[name] = (rng.standard_normal(shape) * _std(spec, name)).astype(np.float32)
    return out


def config(spec: FixtureSpec) -> dict:
    """config.json of the model (transformers LlamaConfig keys, or MixtralConfig's for a MoE fixture)."""
    doc = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden // spec.heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": spec.std,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    if spec.moe:
        for key in ("attention_bias", "mlp_bias"):
            del doc[key]
        doc |= {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": spec.experts,
            "num_experts_per_tok": spec.experts_per_token,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return doc


def generation_config() -> dict:
    """generation_config.json: greedy decoding by default."""
    return {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}


# ---------------------------------------------------------------- tokenizer and prompts


def word_list(spec: FixtureSpec) -> list[str]:
    """Distinct lowercase pseudo-words (2-10 letters) from the corpus seed, in draw order."""
    rng = np.random.default_rng(spec.corpus_seed)
    seen: dict[str, None] = {}
    while len(seen) < spec.words:
        length = int(rng.integers(2, 11))
        seen.setdefault("".join(LETTERS[i] for i in rng.integers(0, 26, size=length)), None)
    return list(seen)


def corpus(spec: FixtureSpec, words: list[str]) -> list[str]:
    """Seeded sentences with a Zipf-like word frequency: the tokenizer's training text."""
    rng = np.random.default_rng(spec.corpus_seed + 1)
    weights_ = 1.0 / np.arange(1, len(words) + 1) ** 0.8
    picks = rng.choice(len(words), size=(spec.sentences, 12), p=weights_ / weights_.sum())
    return [" ".join(words[i] for i in row) for row in picks]


def train_tokenizer(spec: FixtureSpec, words: list[str]) -> Tokenizer:
    """A BPE tokenizer (Metaspace, <s> prepended) with exactly spec.vocab tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=list(SPECIALS), min_frequency=1,
                                  initial_alphabet=["\u2581", *LETTERS], show_progress=False)
    tok.train_from_iterator(corpus(spec, words), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if tok.get_vocab_size() != spec.vocab or [tok.token_to_id(s) for s in SPECIALS] != [0, 1, 2]:
        raise BundleError(f"{spec.name}: tokenizer has {tok.get_vocab_size()} tokens, model has {spec.vocab}")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: the fast tokenizer with Llama's special tokens and a plain chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}",
    }


def prompt_lengths(spec: FixtureSpec) -> list[int]:
    """Each prompt's length in ids: spec.prompt_tokens for all, or drawn from [min_prompt_tokens, prompt_tokens] (the
    first prompt always the longest, so that the set's longest length is spec.prompt_tokens)."""
    if not spec.min_prompt_tokens:
        return [spec.prompt_tokens] * spec.prompts
    rng = np.random.default_rng(spec.prompt_seed + 1)
    drawn = rng.integers(spec.min_prompt_tokens, spec.prompt_tokens + 1, size=spec.prompts - 1)
    return [spec.prompt_tokens, *map(int, drawn)]


def prompt_set(spec: FixtureSpec, tok: Tokenizer, words: list[str]) -> list[dict]:
    """spec.prompts texts of words whose encoding (with <s>) is exactly as many ids as prompt_lengths(spec) says."""
    rng = np.random.default_rng(spec.prompt_seed)
    single = [w for w in words if len(tok.encode(w).ids) == 2]
    prompts: list[dict[str, Any]] = []
    for length in prompt_lengths(spec):
        text_words: list[str] = []
        ids = tok.encode("").ids
        while len(ids) < length:
            candidate = words[int(rng.integers(len(words)))]
            trial = tok.encode(" ".join([*text_words, candidate])).ids
            if len(trial) > length:
                candidate = single[int(rng.integers(len(single)))]
                trial = tok.encode(" ".join([*text_words, candidate])).ids
            text_words.append(candidate)
            ids = trial
        text = " ".join(text_words)
        if tok.decode(ids, skip_special_tokens=True) != text or ids[0] != 1:
            raise BundleError(f"{spec.name}: prompt {len(prompts)} does not round-trip through the tokenizer")
        prompts.append({"text": text, "ids": ids})
    return prompts


def prompts_document(spec: FixtureSpec, prompts: list[dict], tokenizer_sha256: str) -> dict:
    """The content of prompts.json."""
    return {
        "format": PROMPTS_FORMAT,
        "fixture": spec.name,
        "seed": spec.prompt_seed,
        "seq_len": spec.prompt_tokens,
        **({"min_seq_len": spec.min_prompt_tokens} if spec.min_prompt_tokens else {}),
        "new_tokens": spec.new_tokens,
        "bos_id": 1,
        "eos_id": 2,
        "add_bos": True,
        "tokenizer_sha256": tokenizer_sha256,
        "prompts": prompts,
    }


# ---------------------------------------------------------------- files


def _json_bytes(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def fixture_files(name: str) -> dict[str, bytes]:
    """Every file of fixture `name` (SHA256SUMS excluded) as bytes."""
    spec = spec_for(name)
    words = word_list(spec)
    tok = train_tokenizer(spec, words)
    tokenizer_json = (tok.to_str(pretty=True) + "\n").encode()
    tok_sha = hashlib.sha256(tokenizer_json).hexdigest()
    return {
        "config.json": _json_bytes(config(spec)),
        "generation_config.json": _json_bytes(generation_config()),
        "model.safetensors": encode_safetensors(weights(spec), metadata={"format": "pt"}, bf16=weight_shapes(spec)),
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": _json_bytes(tokenizer_config()),
        "special_tokens_map.json": _json_bytes({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
        "prompts.json": _json_bytes(prompts_document(spec, prompt_set(spec, tok, words), tok_sha)),
    }


def sums_text(hashes: dict[str, str]) -> str:
    """SHA256SUMS content in sha256sum's format, sorted by file name."""
    return "".join(f"{hashes[n]}  {n}\n" for n in sorted(hashes))


def parse_sums(text: str, *, source: str) -> dict[str, str]:
    """File name -> sha256 from SHA256SUMS text; BundleError on a malformed line."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not name \
                or "/" in name or name.startswith(".") or name in out:
            raise BundleError(f"{source}: line {number} is not '<sha256>  <file name>'")
        out[name] = digest
    return out


def digest_of(hashes: dict[str, str]) -> str:
    """One sha256 naming a whole folder: the sha256 of its SHA256SUMS text."""
    return hashlib.sha256(sums_text(hashes).encode()).hexdigest()


def generate_fixture(*, name: str, out: Path) -> dict[str, str]:
    """Write fixture `name` into folder `out` (with SHA256SUMS); return the sha256 of every file."""
    files = fixture_files(name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for file_name, data in files.items():
        (out / file_name).write_bytes(data)
        hashes[file_name] = hashlib.sha256(data).hexdigest()
    (out / SUMS_NAME).write_text(sums_text(hashes))
    expected = EXPECTED.get(name)
    if expected and hashes != expected:
        bad = sorted(n for n in hashes.keys() | expected.keys() if hashes.get(n) != expected.get(n))
        raise BundleError(f"fixture {name} regenerated with different sha256 for {', '.join(bad)}; "
                          "numpy or tokenizers produced other bytes than the recorded ones")
    return hashes


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every regular file directly in `folder`, SHA256SUMS excluded."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != SUMS_NAME}


def check_fixture(*, name: str, folder: Path) -> dict[str, str]:
    """Check that `folder` holds exactly fixture `name` as recorded; return its file hashes."""
    expected = EXPECTED.get(spec_for(name).name)
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"{folder}: fixture folder {name} is missing; fix: skupin fixture generate --name {name}")
    found = file_hashes(folder)
    if not expected:
        raise BundleError(f"fixture {name} has no recorded sha256 yet")
    for file_name in sorted(found.keys() | expected.keys()):
        if file_name not in found:
            raise BundleError(f"{folder / file_name}: missing from fixture {name}")
        if file_name not in expected:
            raise BundleError(f"{folder / file_name}: not part of fixture {name}")
        if found[file_name] != expected[file_name]:
            raise BundleError(f"{folder / file_name}: sha256 {found[file_name]} differs from the recorded "
                              f"{expected[file_name]}; fix: skupin fixture generate --name {name} --out {folder}")
    return found


def fixture_digest(name: str) -> str:
    """The recorded sha256 naming fixture `name` as a whole (sha256 of its SHA256SUMS text)."""
    expected = EXPECTED.get(spec_for(name).name)
    if not expected:
        raise BundleError(f"fixture {name} has no recorded sha256 yet")
    return digest_of(expected)


def load_prompts(path: Path) -> dict:
    """The prompts.json document at `path`, checked for format and consistent shapes."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: cannot read the prompt set: {exc}") from exc
    if doc.get("format") != PROMPTS_FORMAT or not doc.get("prompts"):
        raise BundleError(f"{path}: not a {PROMPTS_FORMAT} document")
    shortest = doc.get("min_seq_len", doc["seq_len"])  # ragged prompt sets name their shortest length
    if any(not shortest <= len(p["ids"]) <= doc["seq_len"] for p in doc["prompts"]) or \
            max(len(p["ids"]) for p in doc["prompts"]) != doc["seq_len"]:
        raise BundleError(f"{path}: every prompt must have between {shortest} and seq_len={doc['seq_len']} ids, "
                          f"the longest exactly seq_len")
    return doc
