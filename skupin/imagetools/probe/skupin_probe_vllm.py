"""The probe's vLLM adapter: prompt logprobs and greedy continuations through vLLM's offline LLM API, final hidden
states through its pooling runner.

An Adapter of the probe (skupin_probe.py): the standard library at import, torch and vllm inside `run`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .skupin_probe import Collector, Options

NEEDS_TORCH = True


def _hidden(model_dir: str, ids: list[list[int]], opts: Options, col: Collector) -> str:
    """Final hidden states of every prompt position through vLLM's own pooling runner, then the engine is shut down.

    The causal LM is loaded as a token-embedding model (runner "pooling", convert "embed") with ALL-token
    pooling and no activation (no normalisation): each output row is the decoder's last hidden state after
    the final norm, the same tensor the transformers adapter stores. This engine runs eagerly (same weights,
    loader and kernels; no graph compilation, which on a CPU costs about a minute per engine): the compiled
    graph the server runs is what the logprob statistics and the greedy check measure.
    """
    from vllm import LLM, PoolingParams
    from vllm.config import PoolerConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, tokenizer=model_dir, dtype=opts["dtype"], seed=0, runner="pooling", convert="embed",
              max_num_seqs=opts["batch_size"], max_model_len=max(map(len, ids)) + opts["new_tokens"] + 8, enforce_eager=True,
              pooler_config=PoolerConfig(task="token_embed", pooling_type="ALL", use_activation=False))
    try:
        outs = llm.encode([TokensPrompt(prompt_token_ids=p) for p in ids], pooling_task="token_embed",
                          pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        for prompt, out in zip(ids, outs, strict=True):
            hidden = out.outputs.data
            if tuple(hidden.shape[:1]) != (len(prompt),):
                raise RuntimeError(f"vLLM's pooling runner returned hidden states of shape {tuple(hidden.shape)} "
                                   f"for a prompt of {len(prompt)} tokens")
            col.add("hidden", hidden.float().cpu())
    finally:
        _shutdown(llm)
    return "vLLM pooling runner, eager: all tokens, no activation (decoder output after the final norm)"


def _shutdown(llm: Any) -> None:
    """Stop an offline vLLM engine's core process before the next one starts (its memory is reserved per engine)."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm, engine, core
    gc.collect()


def run(model_dir: str, ids: list[list[int]], opts: Options, device: str, col: Collector) -> dict[str, Any]:
    """The same outputs through vLLM's own engine: prompt logprobs (top-k and full vocabulary), greedy
    continuations with the offline LLM API, final hidden states with its pooling runner."""
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older vLLM
        TokensPrompt = dict
    vocab = opts["vocab"]
    t0 = time.perf_counter()
    hidden_how = _hidden(model_dir, ids, opts, col)
    hidden_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, tokenizer=model_dir, dtype=opts["dtype"], seed=0, max_num_seqs=opts["batch_size"],
              max_logprobs=max(opts["top_k"], vocab if opts["full_logprobs"] else 0, 2),
              max_model_len=max(map(len, ids)) + opts["new_tokens"] + 8, enforce_eager=opts["attn"] == "eager")
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    t1 = time.perf_counter()
    teacher = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=opts["top_k"]),
                           use_tqdm=False)
    full = (llm.generate(prompts[: opts["full_logprobs"]],
                         SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab), use_tqdm=False)
            if opts["full_logprobs"] else [])
    forward_s = time.perf_counter() - t1
    for i, (prompt, out) in enumerate(zip(ids, teacher, strict=True)):
        per_pos = [[(lp.logprob, tid) for tid, lp in d.items() if lp.rank <= opts["top_k"]] for d in out.prompt_logprobs[1:]]
        target = [d[prompt[t + 1]].logprob for t, d in enumerate(out.prompt_logprobs[1:])]
        dense = ([[(lp.logprob, tid) for tid, lp in d.items()] for d in full[i].prompt_logprobs[1:]]
                 if i < len(full) else None)
        col.engine_prompt(i, per_pos, target, dense, vocab)
    t2 = time.perf_counter()
    greedy = llm.generate(prompts, SamplingParams(max_tokens=opts["new_tokens"], temperature=0.0, logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)
    for out in greedy:
        seq = out.outputs[0]
        col.greedy(list(seq.token_ids), [[(lp.logprob, tid) for tid, lp in d.items()] for d in seq.logprobs])
    generate_s = time.perf_counter() - t2
    _shutdown(llm)
    info = {"attn_implementation": os.environ.get("VLLM_ATTENTION_BACKEND", "vllm-default"),
            "compiled": opts["attn"] != "eager", "hidden_states": hidden_how,
            "logprobs": f"vLLM prompt_logprobs: top-{opts['top_k']} for every prompt, the full vocabulary ({vocab}) "
                        f"for the first {opts['full_logprobs']}",
            "greedy": "vLLM temperature 0, ignore_eos", "load_s": load_s, "hidden_s": hidden_s,
            "forward_s": forward_s, "generate_s": generate_s}
    return info


# ---------------------------------------------------------------- the op battery (skupin_probe_ops.py)

# The ops of a vLLM decoder's path the battery cannot call outside a running engine, and why.
UNREACHED = {
    "attention.prefill": "vLLM's attention backends run only inside a running engine's forward context (paged KV "
                         "cache, attention metadata); checked end to end by the model check",
    "attention.decode": "vLLM's paged decode attention runs only inside a running engine's forward context; checked "
                        "end to end by the model check",
    "moe.block": "vLLM's FusedMoE layer needs the engine's parallel and quantization config; checked end to end by "
                 "the model check",
}


def op_battery(model_dir: str, opts: Options, device: str, spec: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's own layers for each op on a decoder's path it can run outside an engine: RMSNorm (alone and with the
    fused residual add), SiluAndMul, its rotary embedding (get_rope, cache at the serving dtype as vLLM builds it),
    the router's fused_topk, the unquantized linear layer's GEMM. Built under a vLLM config whose compilation mode is
    the model check's (compiled unless --attn eager), so each CustomOp dispatches as it does in the engine: its own
    kernel or the native torch code its compiled graph is built from."""
    import json

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        moe = bool(json.load(fh).get("num_local_experts"))
    config = _vllm_config(eager=opts["attn"] == "eager")
    impls: dict[str, Any] = {}
    uncovered = {op: why for op, why in UNREACHED.items() if op != "moe.block" or moe}
    makers = {"rmsnorm": _rmsnorm, "add_rmsnorm": _rmsnorm, "silu_mul": _silu_mul, "rope.short": _rope,
              "rope.long": _rope, "matmul": _matmul, **({"moe.route": _route} if moe else {})}
    for op, make in makers.items():
        try:
            with _config_scope(config):
                impls[op] = _scoped(config, make(device, spec))
        except Exception as exc:  # a layer that cannot be built outside an engine is uncovered, with why
            uncovered[op] = f"could not be built outside an engine: {type(exc).__name__}: {exc}"[:300]
    return impls, uncovered


def _rmsnorm(device: str, spec: Any) -> Any:
    from vllm.model_executor.layers.layernorm import RMSNorm

    RMSNorm(8, eps=spec.EPS)  # importable and buildable here, or the op is uncovered

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = RMSNorm(x["x"].shape[-1], eps=spec.EPS).to(device=device, dtype=x["x"].dtype)
        layer.weight.data.copy_(x["weight"])
        if "residual" in x:
            out, residual = layer(x["x"].clone(), x["residual"].clone())
            return {"out": out, "residual": residual}
        return {"out": layer(x["x"].clone())}

    return run


def _silu_mul(device: str, spec: Any) -> Any:
    from vllm.model_executor.layers.activation import SiluAndMul

    layer = SiluAndMul()
    return lambda x: {"out": layer(x["x"])}


def _rope(device: str, spec: Any) -> Any:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = get_rope(spec.HD, 8192, is_neox_style=True, dtype=x["q"].dtype,
                         rope_parameters={"rope_theta": spec.THETA, "rope_type": "default"}).to(device)
        t = x["q"].shape[0]
        q, k = layer(x["positions"], x["q"].reshape(t, -1).clone(), x["k"].reshape(t, -1).clone())
        return {"q": q.reshape(x["q"].shape), "k": k.reshape(x["k"].shape)}

    return run


def _route(device: str, spec: Any) -> Any:
    """The router the platform's MoE experts use: CPURouter's select_experts on a CPU, fused_topk elsewhere."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts

        def topk(hidden: Any, logits: Any) -> Any:
            return select_experts(hidden, logits, spec.TOPK, use_grouped_topk=False, renormalize=True)
    else:
        from vllm.model_executor.layers.fused_moe import fused_topk

        def topk(hidden: Any, logits: Any) -> Any:
            return fused_topk(hidden, logits, spec.TOPK, True)

    def run(x: dict[str, Any]) -> dict[str, Any]:
        hidden = torch.zeros((x["logits"].shape[0], 8), dtype=x["logits"].dtype, device=device)
        weights, ids, *_ = topk(hidden, x["logits"])
        return {"weights": weights.to(x["logits"].dtype), "ids": ids.to(torch.int32)}

    return run


def _matmul(device: str, spec: Any) -> Any:
    """The unquantized linear layer's GEMM as the platform dispatches it (on a CPU: the layer's prepared cpu_linear)."""
    import torch
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    gemm = utils.dispatch_unquantized_gemm()

    def run(x: dict[str, Any]) -> dict[str, Any]:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(x["weight"].clone(), requires_grad=False)
        if current_platform.is_cpu():
            utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        return {"out": gemm(layer, x["x"], layer.weight, None)}

    return run


def _vllm_config(*, eager: bool) -> Any:
    """A vLLM config whose compilation mode is the model check's (None when this vLLM has no such config)."""
    try:
        from vllm.config import CompilationConfig, VllmConfig

        try:
            from vllm.config import CompilationMode

            compilation = CompilationConfig(mode=CompilationMode.NONE if eager else CompilationMode.VLLM_COMPILE)
        except ImportError:
            compilation = CompilationConfig()
        return VllmConfig(compilation_config=compilation)
    except Exception:
        return None


def _config_scope(config: Any) -> Any:
    import contextlib

    if config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


def _scoped(config: Any, impl: Any) -> Any:
    """`impl` run under the vLLM config (layers read it when they are built and when they run)."""
    def run(x: dict[str, Any]) -> Any:
        with _config_scope(config):
            return impl(x)

    return run


# ---------------------------------------------------------------- the module ops (skupin_probe_ops.py MODULE_OUTPUTS)

# The in-process engines module_ops started and the process state each changed, undone by release_modules.
_LOADED: list[tuple[Any, Any]] = []


def module_ops(model_dir: str, opts: Options, device: str, spec: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The modules of the model as vLLM loads it (the offline LLM at opts["dtype"], eager), one implementation per key of
    spec.module_plan: (key -> implementation, key -> why it is not reached). The caller runs them, then calls
    release_modules, which shuts the engine down.

    The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that its model instance -- the weights its
    loader filled and processed, the layers its platform dispatched -- is the object the implementations call
    (LLM.apply_model hands it over; with a separate engine-core process it would be pickled). Modules that run outside
    a forward (embedding, norms, MLP, router, final norm, logits) are called directly under the engine's config; those
    that run only inside one (attention: its backend's metadata and paged KV cache; the fused MoE block and its
    experts) are run inside a real forward pass of the engine, a one-token generation of an LT-token prompt, whose
    call of that module has its inputs replaced by the seeded ones and its output taken (forward hooks; the pass runs
    eagerly, so they fire: the compiled graph the server runs is the model check's). A single expert runs through the
    engine's own fused-experts path with the router's logits forced to that expert (the other top-k weights underflow
    to zero), on the loaded stacked weights."""
    import json

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        plan = spec.module_plan(json.load(fh))
    llm, model = _load_in_process(model_dir, opts["dtype"], spec.LT)
    loaded = _Loaded(llm, model, spec)
    impls: dict[str, Any] = {"embed": loaded.direct(lambda x: {"out": loaded.decoder.embed_tokens(x["ids"])}),
                             "rotary": loaded.rotary, "final_norm": loaded.direct(_applied(loaded.decoder.norm)),
                             "lm_head": loaded.direct(lambda x: {"out": model.compute_logits(x["x"])})}
    uncovered: dict[str, str] = {}
    for key, _ in plan:
        if key.startswith("layer."):
            _, index, part, *rest = key.split(".")
            found = loaded.layer_module(int(index), part, rest)
            if isinstance(found, str):
                uncovered[key] = found
            else:
                impls[key] = found
    return impls, uncovered


def release_modules() -> None:
    """Shut down the engines module_ops started and give the probe's process back what they changed in it: its
    environment (VLLM_ENABLE_V1_MULTIPROCESSING, VLLM_DIST_IDENT), vLLM's env cache and frozen GC heap, its
    distributed state, the CPU worker's thread binding (the main thread's CPU affinity, which the model check's engine
    processes would inherit) and torch.set_num_threads, which the CPU worker replaces with a no-op."""
    while _LOADED:
        llm, state = _LOADED.pop()
        try:
            _shutdown(llm)
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        finally:
            state.restore()


class _ProcessState:
    """What an in-process vLLM engine changes in the probe's process, saved to be restored."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.set_num_threads = torch.set_num_threads
        self.threads = torch.get_num_threads()

    def restore(self) -> None:
        import gc

        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        try:
            import vllm.envs

            vllm.envs.disable_envs_cache()
        except Exception:
            pass
        gc.unfreeze()
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)


def _load_in_process(model_dir: str, dtype: str, tokens: int) -> tuple[Any, Any]:
    """The offline LLM at `dtype` with its engine in this process (eager, no prefix caching: every pass computes its
    whole prompt), and the model instance its worker loaded."""
    state = _ProcessState()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm.envs
        from vllm import LLM

        vllm.envs.disable_envs_cache()  # read the variable now, whatever an earlier engine cached
        llm = LLM(model=model_dir, tokenizer=model_dir, dtype=dtype, seed=0, max_num_seqs=1,
                  max_model_len=tokens + 8, enforce_eager=True, enable_prefix_caching=False)
    except BaseException:
        state.restore()
        raise
    _LOADED.append((llm, state))
    model = llm.apply_model(lambda m: m)[0]  # in process: the instance itself, not a copy
    return llm, model


def _applied(module: Any) -> Any:
    return lambda x: {"out": _first(module(x["x"]))}


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


class _Loaded:
    """One loaded vLLM model and the ways its modules are run: directly under the engine's config and a forward
    context without attention metadata, or inside a real forward pass of the engine."""

    def __init__(self, llm: Any, model: Any, spec: Any) -> None:
        self.llm, self.model, self.spec = llm, model, spec
        self.decoder = model.model
        self.config = llm.llm_engine.vllm_config
        self.passes = 0

    def direct(self, impl: Any) -> Any:
        def run(x: dict[str, Any]) -> dict[str, Any]:
            from vllm.config import set_current_vllm_config
            from vllm.forward_context import set_forward_context

            with set_current_vllm_config(self.config), set_forward_context(None, self.config):
                return impl(x)

        return run

    # ---- the rotary table

    def _rotaries(self) -> list[Any]:
        found: dict[int, Any] = {}
        for layer in self.decoder.layers:
            rot = layer.self_attn.rotary_emb
            found[id(rot)] = rot
        return list(found.values())

    def _table(self, rot: Any, rows: int) -> Any:
        """The loaded rotary module's cos_sin_cache (the table the engine serves with), extended to `rows` positions by
        the module's own _compute_cos_sin_cache where the loaded table ends (at max_position_embeddings: the module
        ops read positions past it, where float32 angles lose precision; the engine never serves there)."""
        import torch

        cache = rot.cos_sin_cache
        if cache.shape[0] >= rows:
            return cache
        saved = rot.max_position_embeddings
        rot.max_position_embeddings = rows
        try:
            longer = rot._compute_cos_sin_cache()
        finally:
            rot.max_position_embeddings = saved
        return torch.cat((cache, longer[cache.shape[0]:].to(device=cache.device, dtype=cache.dtype)))

    def rotary(self, x: dict[str, Any]) -> dict[str, Any]:
        """cos and sin [positions, head_dim] of layer 0's rotary module as it applies them: its table's rows at the
        positions (the query's dtype: the engine casts the table to it), each half repeated (neox pairs i, i+d/2)."""
        import torch

        rot = self.decoder.layers[0].self_attn.rotary_emb
        if rot.rotary_dim != rot.head_size:
            raise RuntimeError(f"partial rotary (rotary_dim {rot.rotary_dim} of head {rot.head_size}) is not the "
                               "plan's table")
        positions = x["positions"]
        table = self._table(rot, int(positions.max()) + 1).to(self.model_dtype())
        cos, sin = table.index_select(0, positions.to(table.device)).chunk(2, dim=-1)
        return {"cos": torch.cat((cos, cos), -1), "sin": torch.cat((sin, sin), -1)}

    def model_dtype(self) -> Any:
        return self.config.model_config.dtype

    # ---- a module inside a real forward pass

    def in_forward(self, module: Any, rewrite: Any, rows: int) -> Any:
        """The output of `module` (its first `rows` rows) when the engine calls it in a real forward pass, with its
        arguments replaced by rewrite(args, kwargs) -> (args, kwargs). The pass prefills a prompt of `rows` tokens, one
        sequence, so the engine's attention metadata is causal over exactly those rows. Positions past the loaded
        rotary table are served by the table extended with the module's own formula (see _table) for this pass."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        taken: list[Any] = []

        def before(mod: Any, args: Any, kwargs: Any) -> Any:
            if taken:
                return None
            return rewrite(args, kwargs)

        def after(mod: Any, args: Any, kwargs: Any, out: Any) -> None:
            if not taken:
                taken.append(_first(out)[:rows].clone())

        vocab = int(self.config.model_config.get_vocab_size())
        self.passes += 1
        prompt = [1 + (self.passes * 7919 + t * 31) % (vocab - 1) for t in range(rows)]
        hooks = [module.register_forward_pre_hook(before, with_kwargs=True),
                 module.register_forward_hook(after, with_kwargs=True)]
        rotaries = self._rotaries()
        saved = [rot.cos_sin_cache for rot in rotaries]
        try:
            for rot in rotaries:
                rot.cos_sin_cache = self._table(rot, max(self.spec.LONG) + 1)
            self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1, temperature=0.0),
                              use_tqdm=False)
        finally:
            for hook in hooks:
                hook.remove()
            for rot, cache in zip(rotaries, saved, strict=True):
                rot.cos_sin_cache = cache
        if not taken:
            raise RuntimeError("the engine's forward pass did not call the module")
        return taken[0]

    # ---- a decoder layer's parts

    def layer_module(self, index: int, part: str, rest: list[str]) -> Any:
        """The implementation of one part of decoder layer `index` (input_norm, attention, post_norm, mlp, router,
        expert.<j>, moe), or why it cannot be reached (a string)."""
        layer = self.decoder.layers[index]
        if part in ("input_norm", "post_norm"):
            return self.direct(_applied(layer.input_layernorm if part == "input_norm" else layer.post_attention_layernorm))
        if part == "attention":
            return self._attention(layer.self_attn)
        block = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
        if block is None:
            return f"vLLM's layer {index} has no MLP module to call for {part}"
        if part == "mlp":
            return self.direct(_applied(block))
        if part == "moe":
            return self._moe(block)
        if part == "router":
            return self._router(block)
        if part == "expert":
            return self._expert(block, int(rest[0]))
        return f"no module for {part}"

    def _attention(self, attn: Any) -> Any:
        """The layer's attention (its qkv projection, rotary module, the engine's attention backend with its metadata
        and KV cache, output projection), in a forward pass whose call of it gets the seeded hidden states and
        positions."""
        def run(x: dict[str, Any]) -> dict[str, Any]:
            h, p = x["x"], x["positions"]

            def rewrite(args: Any, kwargs: Any) -> Any:
                positions = kwargs["positions"] if "positions" in kwargs else args[0]
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
                return (), {**kwargs, "positions": _rows(positions, p), "hidden_states": _rows(hidden, h)}

            return {"out": self.in_forward(attn, rewrite, h.shape[0])}

        return run

    def _moe(self, block: Any) -> Any:
        """The whole MoE block (router, top-k, the fused experts) inside a forward pass, on the seeded hidden states."""
        def run(x: dict[str, Any]) -> dict[str, Any]:
            h = x["x"]

            def rewrite(args: Any, kwargs: Any) -> Any:
                hidden = args[0] if args else kwargs.pop("hidden_states")
                return (_rows(hidden, h), *args[1:]), kwargs

            return {"out": self.in_forward(block, rewrite, h.shape[0])}

        return run

    def _router(self, block: Any) -> Any:
        """The block's gate (its logits) and the fused experts' own router (top-k weights and ids of those logits)."""
        runner = getattr(block, "experts", None)
        select = getattr(getattr(runner, "router", None), "select_experts", None)
        gate = getattr(block, "gate", None)
        if gate is None or select is None:
            return "this vLLM's MoE block has no gate and router to call (FusedMoE routes inside its runner)"

        def run(x: dict[str, Any]) -> dict[str, Any]:
            import torch

            logits = _first(gate(x["x"]))
            weights, ids = select(x["x"], logits)
            return {"logits": logits, "weights": weights.float(), "ids": ids.to(torch.int32)}

        return self.direct(run)

    def _expert(self, block: Any, j: int) -> Any:
        """Expert j alone with routing weight 1: the block's fused experts called, inside a forward pass, on the seeded
        hidden states with router logits that put expert j 120 above every other (the second expert's softmax weight,
        exp(-120), underflows to zero in float32 and below: its output adds nothing)."""
        runner = getattr(block, "experts", None)
        if runner is None:
            return "this vLLM's MoE block has no experts module"

        def run(x: dict[str, Any]) -> dict[str, Any]:
            h = x["x"]

            def rewrite(args: Any, kwargs: Any) -> Any:
                hidden = args[0] if args else kwargs.pop("hidden_states")
                logits = args[1] if len(args) > 1 else kwargs.pop("router_logits")
                forced = logits.clone()
                forced[: h.shape[0]] = -60.0
                forced[: h.shape[0], j] = 60.0
                return (_rows(hidden, h), forced, *args[2:]), kwargs

            return {"out": self.in_forward(runner, rewrite, h.shape[0])}

        return run


def _rows(engine: Any, seeded: Any) -> Any:
    """The engine's tensor with its first rows (the prompt's tokens) replaced by the seeded ones, on its device and in
    its dtype; the rows past them (padding the engine may add) kept."""
    if engine.shape[0] < seeded.shape[0] or engine.shape[1:] != seeded.shape[1:]:
        raise RuntimeError(f"the engine called the module with shape {tuple(engine.shape)}, not room for "
                           f"{tuple(seeded.shape)}")
    out = engine.clone()
    out[: seeded.shape[0]] = seeded.to(device=engine.device, dtype=engine.dtype)
    return out
