"""llama.cpp (through llama-cpp-python): its OpenAI-compatible server on a GGUF file, and the probe's llama.cpp adapter
(full logprobs, hidden states).

llama.cpp reads one GGUF file, not a transformers folder: the gate writes the fixture as GGUF (gates/refdata/gguf.py)
and mounts it in the model folder as ``model-<file type>.gguf`` (``model_file``), next to the fixture's files.
"""

from __future__ import annotations

from typing import Final

from skupin.engines.base import NEVER_EOS, SERVED_NAME, Distribution, Output, ServerLaunch

NAME: Final = "llamacpp"
# llama-cpp-python is an sdist built in the image; its requirements (numpy, typing-extensions, diskcache, jinja2)
# name no torch: no engine_torch rows.
DISTRIBUTIONS: Final = (Distribution(name="llama-cpp-python", refresh_since=None),)
PROBE_ADAPTER: Final = "llamacpp"
# hidden: llama.cpp's embeddings with pooling NONE (the graph's result_norm tensor: the output of the final RMSNorm,
# transformers' last_hidden_state), see skupin/imagetools/probe/skupin_probe_llamacpp.py
OUTPUTS: Final[frozenset[Output]] = frozenset({"hidden", "logprobs_full"})
# The gate's model folder holds the one GGUF the SKU serves (model_file); an F32 GGUF beside a BF16 one is not built.
FLOAT32: Final = False
# llama-cpp-python exposes no per-op ggml API: the op battery's seeded inputs reach none of its ops
# (skupin_probe_llamacpp.py: op_battery)
OPS: Final[frozenset[str]] = frozenset()
MOE_OPS: Final[frozenset[str]] = frozenset()
# The module ops, captured (skupin_probe_llamacpp.py: module_capture): llama.cpp's C API, bound by llama-cpp-python's
# ctypes, takes an eval callback (llama_context_params.cb_eval, ggml_backend_sched_eval_callback) that sees every tensor
# of the graph as ggml computes it; the adapter reads each by ggml's own functions exported from libggml
# (ggml_get_name, ggml_op_name, ggml_nbytes, ggml_backend_tensor_get) and the struct ggml_tensor of the vendored
# ggml.h (ne/nb/type/op; checked against ggml_tensor_overhead). Every module of the plan is reached: embd,
# attn_norm-N (RMS_NORM+MUL), Qcur-0 before and after ROPE, attn_out-N (Q/K/V, RoPE, KQ, softmax, KQV, output
# projection, from the KV cache at decode), ffn_inp-N, ffn_norm-N, ffn_out-N (gate/up, GLU, down) or, in a MoE layer,
# ffn_moe_logits-N, ffn_moe_weights_norm-N, ffn_moe_argsort-N, ffn_moe_down-N (each expert's rows) and ffn_moe_out-N,
# l_out-N, result_norm, result_output. Not reached: the residual adds on their own (they are the captured inputs of
# the next module), and ggml's kernels at seeded inputs (the op battery).
MODULES: Final = True
MODULE_INPUTS: Final = "captured"

# gate.weights + gate.dtype -> the GGUF file type the SKU serves. "full" is the gate dtype at full precision.
_FULL: Final = {"float32": "f32", "bfloat16": "bf16"}
QUANTIZED: Final = ("q8_0",)
# ggml_type of the KV cache (llama.cpp's default is F16, which rounds every cached K and V): the gate dtype's own.
_KV_TYPE: Final = {"float32": 0, "bfloat16": 30}  # GGML_TYPE_F32, GGML_TYPE_BF16

# Checked against llama-cpp-python 0.3.36 (llama_cpp/server/settings.py, app.py, types.py, llama.py):
# - `python -m llama_cpp.server` parses every ModelSettings/ServerSettings field as `--<field name>` (underscores):
#   model, model_alias, host, port, n_ctx (0: the model's context length), seed, type_k, type_v, logits_all
#   (default True, needed for logprobs).
# - There is no /health: GET /v1/models answers 200 with the alias once the model is loaded (the app loads it before
#   uvicorn listens), so the readiness probe asks /v1/models twice.
# - POST /v1/completions takes the prompt as text only (`prompt: str | list[str]`; a list of strings is a batch, not
#   token ids): the server tokenizes it with the GGUF's tokenizer (tests/unit/test_gguf.py checks it gives the
#   reference ids). It honours `logprobs` (top-N per generated token, keyed by token text) and streams one
#   token's text per event (logprobs.tokens are texts: the serve check compares pieces). There is no ignore_eos
#   field, but `min_tokens` (app.py: a MinTokensLogitsProcessor masking the model's EOS until that many tokens):
#   NEVER_EOS keeps every completion to max_tokens; unknown fields are ignored.
# - Its sampler applies repetition penalties before every choice, temperature 0 included (Llama._init_sampler), and
#   a request's repeat_penalty defaults to 1.1: the greedy requests send 1.0 (no penalty), so greedy is argmax.


def file_type(*, dtype: str, weights: str) -> str:
    """The GGUF file type served for gate dtype `dtype` and gate.weights `weights` (ValueError when there is none)."""
    if weights == "full":
        if dtype not in _FULL:
            raise ValueError(f"llama.cpp has no full-precision GGUF for dtype {dtype} (known: {', '.join(_FULL)})")
        return _FULL[dtype]
    if weights in QUANTIZED:
        return weights
    raise ValueError(f"llama.cpp serves no weights {weights!r} (known: full, {', '.join(QUANTIZED)})")


def model_file(*, dtype: str, weights: str) -> str | None:
    """The GGUF file inside the model folder the server loads."""
    return f"model-{file_type(dtype=dtype, weights=weights)}.gguf"


def server(*, dtype: str, vendor: str, port: int, model_dir: str, host: str, distribution: str,
           weights: str = "full") -> ServerLaunch:
    """llama-cpp-python's server on the GGUF under a fixed model name and seed, with a KV cache of the gate dtype.

    `--interrupt_requests False`: by default a new request cuts the stream in flight (found by `skupin ab`: under
    concurrency 2 and 4 the candidate's completions were cut short and only 42% equalled the baseline's; with the
    flag, 16/16 concurrent completions equal transformers' greedy ones)."""
    kv = str(_KV_TYPE.get(dtype, 1))  # GGML_TYPE_F16 otherwise (llama.cpp's default)
    return ServerLaunch(engine=NAME, port=port, model_id=SERVED_NAME, health_path="/v1/models", returns_logprobs=True,
                        prompt="text", request_extra={"repeat_penalty": 1.0, "min_tokens": NEVER_EOS},
                        argv=("python3", "-m", "llama_cpp.server",
                              "--model", f"{model_dir}/{model_file(dtype=dtype, weights=weights)}",
                              "--host", host, "--port", str(port), "--model_alias", SERVED_NAME, "--n_ctx", "0",
                              "--seed", "0", "--type_k", kv, "--type_v", kv, "--interrupt_requests", "False"))
