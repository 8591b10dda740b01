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
    """None of llama.cpp's ops can be called one by one on seeded inputs here: llama-cpp-python binds llama.h
    (whole-model evaluation) and not ggml's graph API, and the image has no torch to feed them. Every op of the battery
    is uncovered, with why; the same kernels are checked on the model's own tensors by the module ops
    (`module_capture`; upstream's own per-op check is test-backend-ops, a C++ binary)."""
    why = ("llama-cpp-python exposes no per-op ggml API (only whole-model evaluation): seeded inputs cannot be fed; "
           "its kernels are checked on the loaded model's own tensors by the module ops")
    return {}, {op: why for op in spec.OPS}


# ---------------------------------------------------------------- the module ops, captured from llama.cpp's forward

# llama.cpp's graph of a llama-architecture model (src/models/llama.cpp in the vendored 0.3.36 sources; a MoE layer's
# block is src/llama-graph.cpp build_moe_ffn) names its tensors `<name>-<layer>`; the callback
# (llama_context_params.cb_eval, ggml_backend_sched_eval_callback) sees each as it is computed. (graph tensor name,
# ggml op) -> the module ops it is an input (in_x) or output of.
_GGML_F32 = 0
_GGML_I32 = 26
_GGML_OBJECT_SIZE = 32  # struct ggml_object (ggml.c): offs, size, next, type, padding[4]


def _targets(layers: int, experts: int = 0) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """The graph tensors the capture copies. A MoE layer (`experts` > 0): its normed input feeds the router and the
    block; the router's logits (ffn_moe_logits), renormalised top-k weights (ffn_moe_weights_norm) and the argsort whose
    first k columns are its expert ids (ffn_moe_argsort; ffn_moe_topk is a view of it); the block's output
    (ffn_moe_out); each routed expert's output before weighting (ffn_moe_down: [tokens, k, hidden]), split per expert by
    `_expert_tensors`."""
    found = {("embd", "GET_ROWS"): [("embed", "out"), ("layer.0.input_norm", "in_x")],
             ("Qcur-0", "MUL_MAT"): [("rotary", "in_x")], ("Qcur-0", "ROPE"): [("rotary", "out")],
             ("result_norm", "MUL"): [("final_norm", "out"), ("lm_head", "in_x")],
             ("result_output", "MUL_MAT"): [("lm_head", "out")]}
    for i in range(layers):
        p = f"layer.{i}."
        found[(f"attn_norm-{i}", "MUL")] = [(p + "input_norm", "out"), (p + "attention", "in_x")]
        found[(f"attn_out-{i}", "MUL_MAT")] = [(p + "attention", "out")]
        found[(f"ffn_inp-{i}", "ADD")] = [(p + "post_norm", "in_x")]
        if experts:
            found[(f"ffn_norm-{i}", "MUL")] = [(p + "post_norm", "out"), (p + "router", "in_x"), (p + "moe", "in_x")]
            found[(f"ffn_moe_logits-{i}", "MUL_MAT")] = [(p + "router", "logits")]
            found[(f"ffn_moe_weights_norm-{i}", "DIV")] = [(p + "router", "weights")]
            found[(f"ffn_moe_argsort-{i}", "ARGSORT")] = [(p + "router", "ids")]
            found[(f"ffn_moe_down-{i}", "MUL_MAT_ID")] = []
            found[(f"ffn_moe_out-{i}", "ADD")] = [(p + "moe", "out")]
        else:
            found[(f"ffn_norm-{i}", "MUL")] = [(p + "post_norm", "out"), (p + "mlp", "in_x")]
            found[(f"ffn_out-{i}", "MUL_MAT")] = [(p + "mlp", "out")]
        found[(f"l_out-{i}", "ADD")] = [(f"layer.{i + 1}.input_norm" if i + 1 < layers else "final_norm", "in_x")]
    return found


def _ggml_tensor_type() -> Any:
    """struct ggml_tensor of the vendored ggml.h (checked against the library's own size in `_ggml`)."""
    import ctypes

    class GgmlTensor(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                    ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                    ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                    ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                    ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]

    return GgmlTensor


def _ggml() -> Any:
    """libggml as llama-cpp-python loaded it, with the few ggml functions the capture calls declared (ggml-base's,
    found through libggml's dependencies); RuntimeError when its tensor struct is not the one `_ggml_tensor_type`
    declares."""
    import ctypes

    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_tensor_overhead.argtypes = []
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    size = ctypes.sizeof(_ggml_tensor_type()) + _GGML_OBJECT_SIZE
    if lib.ggml_tensor_overhead() != size:
        raise RuntimeError(f"ggml's tensor struct is not the one this adapter reads (ggml_tensor_overhead "
                           f"{lib.ggml_tensor_overhead()}, expected {size})")
    return lib


def module_capture(model_dir: str, opts: Options, spec: Any,
                   config: dict[str, Any]) -> tuple[dict[str, Array], dict[str, Any], dict[str, str]]:
    """The module ops from llama.cpp's own forward (skupin_probe_ops.py CAPTURE_POSITIONS): a context of the loaded
    model with an eval callback evaluates the seeded token ids of the `embed` key as CAPTURE_SEGMENTS sequences (each
    from an empty F32 KV cache: all but the last token as one batch, the last through the cache), and the callback
    copies every tensor of the plan's modules (their inputs and outputs, as F32, expert ids as I32) when ggml has
    computed it. A MoE model's experts also take the rows of CAPTURE_EXPERT_SEGMENTS more sequences
    (expert_capture_ids), evaluated the same way with only the experts' tensors copied.
    Returns (tensors ops.<key>.<dtype>.<name>, report rows, key -> why not reached)."""
    plan = spec.module_plan(config)
    import llama_cpp

    experts = int(config.get("num_local_experts") or 0)
    targets = _targets(int(config["num_hidden_layers"]), experts)
    ids = [int(v) for v in spec.module_inputs("embed", "embed", opts["dtype"], config)["ids"][1]]
    segments = spec.capture_segments()
    t0 = time.perf_counter()
    threads = opts["cpu_threads"]
    llm = llama_cpp.Llama(model_path=_gguf_file(model_dir), n_ctx=64, n_batch=64, type_k=0, type_v=0, seed=0,
                          n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    try:
        captured = _evaluate(llm, targets, ids, segments)
        captures = [(captured, segments)]
        if experts:  # the experts' extra rows (skupin_probe_ops.py: CAPTURE_EXPERT_SEGMENTS)
            wanted = {t: outs for t, outs in targets.items() if t[0].startswith(("ffn_norm-", "ffn_moe_argsort-",
                                                                              "ffn_moe_down-"))}
            extra = [list(range(spec.LT // 2))] * spec.CAPTURE_EXPERT_SEGMENTS
            captures.append((_evaluate(llm, wanted, spec.expert_capture_ids(opts["dtype"], config), extra), extra))
    finally:
        llm.close()
    seconds = round(time.perf_counter() - t0, 4)
    tensors, rows, why = _module_tensors(plan, targets, captured, segments, opts["dtype"], seconds)
    if experts:  # the experts' ops are made from the blocks, not mapped one tensor each
        more, more_rows, more_why = _expert_tensors(plan, captures, opts["dtype"], seconds,
                                                    int(config["num_experts_per_tok"]))
        tensors, rows = {**tensors, **more}, {**rows, **more_rows}
        why = {**{key: text for key, text in why.items() if ".expert." not in key}, **more_why}
    return tensors, rows, why


def _evaluate(llm: Any, targets: dict[tuple[str, str], list[tuple[str, str]]], ids: list[int],
              segments: list[list[int]]) -> dict[tuple[str, str], list[Any]]:
    """Each segment's tokens through a fresh context of `llm`'s model whose eval callback copies the target tensors:
    (graph tensor name, op) -> one float32 array per evaluation, in order."""
    import llama_cpp

    lib, tensor_type = _ggml(), _ggml_tensor_type()
    captured: dict[tuple[str, str], list[Any]] = {}
    problems: list[str] = []

    @llama_cpp.ggml_backend_sched_eval_callback
    def callback(ptr: int, ask: bool, user_data: Any) -> bool:
        try:
            name = (lib.ggml_get_name(ptr) or b"").decode("utf-8", "replace")
            op = (lib.ggml_op_name(tensor_type.from_address(ptr).op) or b"").decode()
            if (name, op) not in targets:
                return not ask  # asked: not wanted (ggml computes on without stopping)
            if not ask:
                captured.setdefault((name, op), []).append(_read(lib, tensor_type, ptr))
            return True
        except Exception as exc:  # never raise through C: recorded, and the capture fails below
            problems.append(f"{type(exc).__name__}: {exc}")
            return True

    for segment, start in zip(segments, range(0, len(ids), len(segments[0])), strict=True):
        _decode_segment(llm, callback, ids[start:start + len(segment)], segment)
    if problems:
        raise RuntimeError(f"the eval callback failed: {problems[0]}")
    return captured


def _read(lib: Any, tensor_type: Any, ptr: int) -> Any:
    """A computed F32 (or I32: expert ids, as float32) tensor's values, flat, copied out of ggml's buffer by
    ggml_backend_tensor_get."""
    import ctypes

    import numpy as np

    t = tensor_type.from_address(ptr)
    ne, nb = list(t.ne), list(t.nb)
    if t.type not in (_GGML_F32, _GGML_I32):
        raise RuntimeError(f"{t.name.decode()} is ggml type {t.type}, not F32 or I32")
    if nb != [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]]:
        raise RuntimeError(f"{t.name.decode()} is not contiguous (ne {ne}, nb {nb})")
    size = int(lib.ggml_nbytes(ptr))
    buf = (ctypes.c_char * size)()
    lib.ggml_backend_tensor_get(ptr, buf, 0, size)
    if t.type == _GGML_I32:  # expert ids (ffn_moe_argsort), as float32 like every other output
        return np.frombuffer(bytes(buf), dtype=np.int32).astype(np.float32)
    return np.frombuffer(bytes(buf), dtype=np.float32).copy()


def _decode_segment(llm: Any, callback: Any, tokens: list[int], positions: list[int]) -> None:
    """`tokens` at `positions` through a fresh context of `llm`'s model with eval callback `callback`: all but the last
    as one batch (prefill), the last through the KV cache (decode)."""
    import llama_cpp

    params = llm.context_params
    params.cb_eval = callback
    params.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context with an eval callback")
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        for lo, hi in ((0, len(tokens) - 1), (len(tokens) - 1, len(tokens))):
            for row, i in enumerate(range(lo, hi)):
                batch.token[row], batch.pos[row], batch.n_seq_id[row] = tokens[i], positions[i], 1
                batch.seq_id[row][0], batch.logits[row] = 0, 1
            batch.n_tokens = hi - lo
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed at positions {positions[lo]}..{positions[hi - 1]}")
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def _module_tensors(plan: list[tuple[str, str]], targets: dict[tuple[str, str], list[tuple[str, str]]],
                    captured: dict[tuple[str, str], list[Any]], segments: list[list[int]], dtype: str,
                    seconds: float) -> tuple[dict[str, Array], dict[str, Any], dict[str, str]]:
    """Each plan key's captured tensors, every evaluation's rows stacked in order: (tensors, rows, key -> why not)."""
    import numpy as np

    tensors: dict[str, Array] = {}
    rows: dict[str, Any] = {}
    why: dict[str, str] = {}
    evaluations = _rows(segments)
    for key, _ in plan:
        names = [(tensor, out) for tensor, outs in targets.items() for k, out in outs if k == key]
        absent = [f"{n} ({o})" for (n, o), _ in names if len(captured.get((n, o), [])) != len(evaluations)]
        if not names or absent:
            why[key] = (f"llama.cpp's graph did not compute {', '.join(absent)} once per evaluation" if names
                        else "no tensor of llama.cpp's graph is this module")
            continue
        for (name, op), out in names:
            flat = [p.reshape(n, -1) for p, n in zip(captured[(name, op)], evaluations, strict=True)]
            tensors[f"ops.{key}.{dtype}.{out}"] = np.ascontiguousarray(np.concatenate(flat, axis=0))
        if f"ops.{key}.{dtype}.ids" in tensors:  # the argsort of every expert: its first k columns are the top-k
            k = tensors[f"ops.{key}.{dtype}.weights"].shape[1]
            tensors[f"ops.{key}.{dtype}.ids"] = np.ascontiguousarray(tensors[f"ops.{key}.{dtype}.ids"][:, :k])
        rows[f"{key}.{dtype}"] = {"status": "ok", "seconds": seconds,
                                  "tensors": {out: f"{name} ({op})" for (name, op), out in names}}
    return tensors, rows, why


def _expert_tensors(plan: list[tuple[str, str]], captures: list[tuple[dict[tuple[str, str], list[Any]], list[list[int]]]],
                    dtype: str, seconds: float, k: int) -> tuple[dict[str, Array], dict[str, Any], dict[str, str]]:
    """Each expert's module op from the blocks llama.cpp computed in `captures` ((captured tensors, their segments),
    in order): the normed input rows routed to it (in_x) and its output on them before the routing weight (its slot of
    ffn_moe_down), every evaluation's rows in order. llama.cpp computes an expert only on the tokens routed to it: an
    expert no captured token was routed to is not reached. Returns (tensors, report rows, key -> why not reached)."""
    import numpy as np

    tensors: dict[str, Array] = {}
    rows: dict[str, Any] = {}
    why: dict[str, str] = {}
    stacked: dict[str, Any] = {}  # layer -> (norm rows, argsort rows, down rows) of every capture, or why not
    for key, kind in plan:
        if kind != "expert":
            continue
        _, layer, _, expert = key.split(".")
        names = [(f"ffn_norm-{layer}", "MUL"), (f"ffn_moe_argsort-{layer}", "ARGSORT"),
                 (f"ffn_moe_down-{layer}", "MUL_MAT_ID")]
        if layer not in stacked:
            absent = sorted({f"{n} ({o})" for captured, segments in captures for n, o in names
                             if len(captured.get((n, o), [])) != len(_rows(segments))})
            stacked[layer] = (f"llama.cpp's graph did not compute {', '.join(absent)} once per evaluation" if absent
                              else tuple(np.concatenate([p.reshape(n, -1) for captured, segments in captures
                                                         for p, n in zip(captured[name], _rows(segments), strict=True)])
                                         for name in names))
        if isinstance(stacked[layer], str):
            why[key] = stacked[layer]
            continue
        norm, order, down = stacked[layer]
        token, slot = np.nonzero(order[:, :k].astype(np.int64) == int(expert))
        if not len(token):
            why[key] = f"no captured token was routed to expert {expert} (llama.cpp computes an expert on its tokens only)"
            continue
        tensors[f"ops.{key}.{dtype}.in_x"] = np.ascontiguousarray(norm[token])
        tensors[f"ops.{key}.{dtype}.out"] = np.ascontiguousarray(down.reshape(len(norm), k, -1)[token, slot])
        rows[f"{key}.{dtype}"] = {"status": "ok", "seconds": seconds, "tokens": int(len(token)),
                                  "tensors": {"in_x": f"{names[0][0]} (MUL)",
                                              "out": f"{names[2][0]} (MUL_MAT_ID, its slot per token)"}}
    return tensors, rows, why


def _rows(segments: list[list[int]]) -> list[int]:
    """The number of tokens of each evaluation, in order: each segment's prefill, then its one decoded token."""
    return [n for segment in segments for n in (len(segment) - 1, 1)]
