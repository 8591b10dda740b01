"""The probe's llama.cpp adapter: teacher-forced logprobs, final hidden states and greedy continuations through
llama-cpp-python on the model folder's one GGUF file, without torch (its image has none: numpy only).

An Adapter of the probe (skupin_probe.py): the standard library at import, numpy and llama_cpp inside `run`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .skupin_probe import Array, Collector, Entries, Options

NEEDS_TORCH = False


def _gguf_file(model_dir: str) -> str:
    """The one GGUF file in the model folder (the gate mounts exactly one: model-<file type>.gguf)."""
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".gguf"))
    if len(found) != 1:
        raise RuntimeError(f"the model folder holds {len(found)} GGUF files ({', '.join(found[:4])}); llama.cpp needs one")
    return os.path.join(model_dir, found[0])


def _log_softmax(logits: Array) -> Array:
    """float32 log-softmax of float32 logits along the last axis, computed in float64."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return (x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))).astype(np.float32)


def _top_entries(logprobs: Array, k: int) -> list[Entries]:
    """Per row, the k best (logprob, token id) pairs, ties by the lower id (as skupin_probe.sorted_top orders them)."""
    import numpy as np

    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return [[(float(row[i]), int(i)) for i in idx] for row, idx in zip(logprobs, order, strict=True)]


def _hidden(path: str, ids: list[list[int]], n_ctx: int, threads: int, col: Collector) -> str:
    """Final hidden states of every prompt position from llama.cpp's embeddings with pooling NONE.

    With pooling NONE llama.cpp's embeddings are the graph's ``result_norm`` tensor (src/models/llama.cpp: the output
    of the final RMSNorm, before the output matrix): the decoder's last hidden state, as the transformers adapter
    stores it. Each prompt is one sequence of one batch on a cleared KV cache.
    """
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=path, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE,
                          n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, type_k=0, type_v=0, seed=0, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    try:
        n_embd = llm.n_embd()
        for prompt in ids:
            llm._ctx.kv_cache_clear()
            llm._batch.reset()
            llm._batch.add_sequence(prompt, 0, True)
            llm._ctx.decode(llm._batch)
            ptr = llama_cpp.llama_get_embeddings(llm._ctx.ctx)
            if not ptr:
                raise RuntimeError("llama.cpp returned no embeddings for a prompt")
            rows = np.ctypeslib.as_array(ptr, shape=(len(prompt) * n_embd,)).reshape(len(prompt), n_embd)
            col.add("hidden", np.array(rows, dtype=np.float32))
            llm._batch.reset()
    finally:
        llm.close()
    return "llama.cpp embeddings with pooling NONE (result_norm: the output of the final norm), every prompt position"


def run(model_dir: str, ids: list[list[int]], opts: Options, device: str, col: Collector) -> dict[str, Any]:
    """Teacher-forced logprobs, final hidden states and greedy continuations through llama.cpp (llama-cpp-python) on
    the model folder's GGUF, without torch.

    One Llama context with logits for every position (logits_all) and an F32 KV cache (type_k/type_v 0; llama.cpp's
    default F16 cache rounds every cached key and value) evaluates each prompt's ids from a cleared cache; its
    logits rows 0..T-2 give the prompt logprobs (log-softmax in float64), and the greedy continuation goes on
    from the same cache one token at a time (argmax, EOS not special), as the server decodes. llama.cpp computes
    in the GGUF's types (F32 GGUF: float32 throughout; quantized: its own kernels); `--dtype` is recorded only.
    """
    import hashlib

    import llama_cpp
    import numpy as np

    if device != "cpu":
        raise RuntimeError(f"the llama.cpp adapter runs on the CPU build only (device {device})")
    path = _gguf_file(model_dir)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    gguf_sha256 = digest.hexdigest()
    vocab, threads = opts["vocab"], opts["cpu_threads"]
    n_ctx = max(map(len, ids)) + opts["new_tokens"] + 8
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, type_k=0, type_v=0, seed=0,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    forward_s = generate_s = 0.0
    try:
        if llm.n_vocab() != vocab:
            raise RuntimeError(f"the GGUF has {llm.n_vocab()} tokens, config.json vocab_size {vocab}")
        for i, prompt in enumerate(ids):
            t1 = time.perf_counter()
            llm.reset()
            llm.eval(prompt)
            logprobs = _log_softmax(llm.scores[: len(prompt)])
            forward_s += time.perf_counter() - t1
            pred = logprobs[:-1]
            target = [float(pred[t, prompt[t + 1]]) for t in range(len(prompt) - 1)]
            dense = ([[(float(v), tid) for tid, v in enumerate(row)] for row in pred]
                     if i < opts["full_logprobs"] else None)
            col.engine_prompt(i, _top_entries(pred, opts["top_k"]), target, dense, vocab)
            t2 = time.perf_counter()
            tokens, steps, last = [], [], logprobs[-1]
            for step in range(opts["new_tokens"]):
                top = _top_entries(last[None, :], 2)[0]
                tokens.append(top[0][1])
                steps.append(top)
                if step + 1 < opts["new_tokens"]:
                    llm.eval([top[0][1]])
                    last = _log_softmax(llm.scores[llm.n_tokens - 1])
            col.greedy(tokens, steps)
            generate_s += time.perf_counter() - t2
    finally:
        llm.close()
    t3 = time.perf_counter()
    hidden_how = _hidden(path, ids, n_ctx, threads, col)
    hidden_s = time.perf_counter() - t3
    if not all(np.isfinite(v).all() for v in col.rows.get("hidden", [])):
        hidden_how += " (non-finite values)"
    info = {"attn_implementation": "llama.cpp", "gguf": os.path.basename(path), "gguf_sha256": gguf_sha256,
            "kv_cache": "F32", "threads": threads,
            "hidden_states": hidden_how,
            "logprobs": f"llama.cpp logits of every prompt position (logits_all, F32 KV cache), log-softmax: "
                        f"top-{opts['top_k']} for every prompt, the full vocabulary ({vocab}) for the first "
                        f"{opts['full_logprobs']}",
            "greedy": "llama.cpp KV-cache decode of its own logits, argmax, EOS not special",
            "load_s": load_s, "forward_s": forward_s, "generate_s": generate_s, "hidden_s": hidden_s}
    return info


def op_battery(model_dir: str, opts: Options, device: str, spec: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """None of llama.cpp's ops can be called one by one here: llama-cpp-python binds llama.h (whole-model evaluation)
    and not ggml's graph API, and the image has no torch to feed them. Every op of the path is uncovered, with why;
    the model check covers them end to end (upstream's own per-op check is test-backend-ops, a C++ binary)."""
    why = ("llama-cpp-python exposes no per-op ggml API (only whole-model evaluation); checked end to end by the model "
           "check")
    return {}, {op: why for op in spec.OPS}
