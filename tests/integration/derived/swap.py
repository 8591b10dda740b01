"""Test fixture: silently change what an image computes, at load time (the swaps the gate must catch).

Packaged by tests/integration/tampered.py as the module of a test wheel (`skupin-test-swap`, with
a .pth file that imports it in every Python process) whose MODE is baked in at packaging time.
As a *locked* wheel (the test lock names it, the image carries that lock's label) it passes the
static `pins` check, exactly like a point release of a locked package that changed its numbers:
only the numeric checks can catch it. Nothing changes on disk: the weights are quantized when
transformers loads them and SiLU is patched when torch.nn.functional is imported, the kind of
change that leaves an image loading and running at normal speed.

Modes:
  int4         linear weights round-to-nearest INT4, symmetric, group 128 (lm_head and embeddings kept)
  int8         linear weights INT8, symmetric, one scale per output channel
  fp8          linear weights cast to float8 e4m3 with one scale per tensor
  int4-nibble  INT4 group 128 packed two per byte, dequantized with the nibble order swapped in 5% of groups
  silu         torch.nn.functional.silu off by a factor 1 + 2**-7
  attn-scale   every attention layer's softmax scale 1% too large (1.01 / sqrt(head_dim)), set on each loaded
               model's attention modules: smaller than one bf16 rounding, so only a float32 run shows it
  sampler      every GenerationConfig gets repetition_penalty=1.3 (the server's generate() uses it; the probe's
               teacher-forced check and its own greedy loop do not)
  hang         every Python process sleeps for an hour at start
  crash        every Python process dies of a segmentation fault at start
  flood        every Python process first writes 400 MB to its stdout
  forge        the probe's process prints a forged output frame whose JSON is nested 100,000 deep, and exits
  plant        every Python process leaves symlinks to a host path and FIFOs, named like the gate's files, wherever
               it can write (the host must never follow or open them)
  sse          the server process is replaced by one whose completion stream sends `data: [1]`
  vllm-int4    vLLM images: linear weights round-to-nearest INT4 right after vLLM's model loader fills them
               (in the engine-core process, which the .pth reaches like every other)
  vllm-silu    vLLM images: vLLM's own fused SiluAndMul op (not torch's silu, which the kernel battery checks)
               off by a factor 1 + 2**-7
  vllm-rope-cache  vLLM images: right after vLLM's model loader fills the weights, the loaded model's rotary table
               (each rotary module's cos_sin_cache) rounded to bfloat16 values, the table a bf16 cache would give: a
               fault of the one loaded model (vLLM's rotary class is untouched, so the op battery's own get_rope is
               honest), which only the module ops see as a module
  vllm-norm-weight  vLLM images: right after the loader, decoder layer 1's post-attention RMSNorm weight scaled by
               1 + 2**-8 (one norm of one loaded model)
  tf32         every process turns on TF32 for float32 products as torch loads (torch.backends.cuda.matmul.allow_tf32,
               float32_matmul_precision "high"): on a GPU it changes the float32 numbers, on a CPU nothing, and the
               SKU does not declare it
  slow         honest numbers, slower: torch.nn.functional.silu sleeps 5 ms per call (once per decoder layer and
               forward pass), the runtime A/B's slower candidate
  slow-5pct    honest numbers, decode tok/s x 0.95 by construction (bench/ab_calibration.py's known answers): after each
  slow-10pct   decode forward (a *ForCausalLM forward whose cache already holds tokens), the thread busy-waits
               1/0.95 - 1 (x 0.90: 1/0.90 - 1) of that step's own period, measured in the same process: from the end
               of the previous step's wait to the end of this forward, so it includes the generate loop's own work (the
               streamer, the sampler, input preparation), not only the forward. A request's decode time is then
               1/keep x the time the same steps take without the wait, to the clock's resolution (perf_counter, about
               a microsecond per step); a busy wait, not a sleep, so it holds the CPU as a slower kernel would (the
               container's CPU accounting sees it too) and no sleep overshoot adds to it. The prefill forward waits
               for nothing (TTFT and prefill tok/s unchanged). Exact against the honest image as far as a step's own
               work is the same with and without the wait; the bench's pooled ratio of many A/Bs measures that
  Faults of the bf16 code path (issue 29), made in transformers' own modeling classes as a faulty engine release would
  make them (so the engine op battery, which builds its modules from those classes, meets them too); a float32 run
  computes exactly what an honest one does:
  norm-bf16    every *RMSNorm computes its variance, rsqrt and product in the input's dtype (no float32 upcast)
  rope-bf16    every *RotaryEmbedding computes its angles and cos/sin in the input's dtype (a table in low precision)
  router-bf16  every *TopKRouter computes its softmax, top-k and renormalisation in the input's dtype
  expert-int4  one expert (3) of one MoE layer (1) quantized INT4 RTN g128 at load, every other weight exact
  vllm-expert-int4  the same expert of the model vLLM's default loader filled (its fused experts' w13 and w2), before
               the engine processes the loaded weights
  vllm-router-temp  vLLM images: the CPU router's top-k softmax (vLLM's own, renormalising over the chosen experts)
               computed on logits scaled by 1 + 2**-5, a 3% sharper routing temperature: the same experts are chosen,
               their weights move by about a percent (a subtle routing change, made in the engine's router as a faulty
               release would make it)
  vllm-norm-bf16  vLLM images: vLLM's own RMSNorm layer (its forward_native, which its CPU path and forward_cuda
               call) computes its variance, rsqrt and product in the input's dtype, the residual add too: no float32
               upcast, as norm-bf16 is for transformers' class
  Faults of llama.cpp's bf16 path (llama-cpp-python images): every Llama the process makes (the server's, the probe's)
  gets them, as a faulty release of the bindings or a loader would give them:
  llamacpp-kv-q4      the K cache quantized Q4_0 (type_k forced to GGML_TYPE_Q4_0 whatever was asked): attention reads
                      4-bit keys
  llamacpp-expert-int4  the loaded GGUF's expert 3 of MoE layer 1 (its slices of ffn_gate_exps, ffn_up_exps and
                      ffn_down_exps, BF16) quantized INT4 RTN g128, every other tensor exact
  llamacpp-router-scale  every MoE layer's router (ffn_gate_inp, F32) scaled by 1 + 2**-5: the same experts, weights a
                      percent off (a 3% sharper routing temperature)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MODES = ("int4", "int8", "fp8", "int4-nibble", "silu", "attn-scale", "sampler", "hang", "crash", "flood", "forge", "plant", "sse",
         "vllm-int4", "vllm-silu", "vllm-rope-cache", "vllm-norm-weight", "slow", "slow-5pct", "slow-10pct",
         "tf32", "norm-bf16", "rope-bf16", "router-bf16", "expert-int4", "vllm-expert-int4",
         "vllm-router-temp", "vllm-norm-bf16", "llamacpp-kv-q4", "llamacpp-expert-int4", "llamacpp-router-scale")
MODELING = ("transformers.models.llama.modeling_llama", "transformers.models.mixtral.modeling_mixtral")
PLANTED_TARGET = "/tmp/skupin-test-planted-target"  # on the host, this file must never appear
MODE = "@MODE@"  # replaced when the wheel is made


def _mode() -> str:
    return os.environ.get("SKUPIN_TEST_SWAP") or (MODE if MODE in MODES else "")


def _int4_codes(w, group: int = 128):
    import torch

    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(g / scale), -8, 7)
    return q, scale


def int4(w):
    q, scale = _int4_codes(w)
    return (q * scale).reshape(w.shape).to(w.dtype)


def int4_numpy(w, group: int = 128):
    """int4's arithmetic in numpy (an image without torch): round-to-nearest INT4, symmetric, group `group`."""
    import numpy as np

    rows, cols = w.shape
    g = w.astype(np.float32).reshape(rows, cols // group, group)
    scale = np.maximum(np.abs(g).max(-1, keepdims=True) / 7.0, 1e-12)
    return (np.clip(np.round(g / scale), -8, 7) * scale).reshape(w.shape).astype(np.float32)


def int4_nibble(w, fraction: float = 0.05):
    """INT4 group 128 where a broken dequant reads the two nibbles of each byte in the wrong order in some groups."""
    import torch

    q, scale = _int4_codes(w)
    rows, groups, size = q.shape
    gen = torch.Generator().manual_seed(1234)
    broken = torch.rand(rows, groups, generator=gen) < fraction
    swapped = q.reshape(rows, groups, size // 2, 2).flip(-1).reshape(rows, groups, size)
    q = torch.where(broken[..., None], swapped, q)
    return (q * scale).reshape(w.shape).to(w.dtype)


def int8(w):
    import torch

    scale = (w.float().abs().amax(1, keepdim=True) / 127.0).clamp_min(1e-12)
    return (torch.clamp(torch.round(w.float() / scale), -127, 127) * scale).to(w.dtype)


def fp8(w):
    import torch

    scale = (w.float().abs().max() / 448.0).clamp_min(1e-12)
    return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


QUANT = {"int4": int4, "int8": int8, "fp8": fp8, "int4-nibble": int4_nibble}


def quantize_model(model, mode: str) -> None:
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(QUANT[mode](module.weight.data))


def scale_attention(model, factor: float = 1.01) -> int:
    """Multiply the softmax scale (`scaling`, which transformers passes to its eager and SDPA paths) of every attention
    module of `model`; return how many there were."""
    changed = 0
    for module in model.modules():
        if isinstance(getattr(module, "scaling", None), float):
            module.scaling *= factor
            changed += 1
    return changed


def quantize_one_expert(model, expert: int = 3, layer: int = 1) -> int:
    """INT4 g128 on expert `expert` of decoder layer `layer`: every 3-D parameter of that layer holds one matrix per
    expert (transformers 5's `layers.N.mlp.experts.*`, vLLM's fused `layers.N.block_sparse_moe.experts.w13_weight` and
    `w2_weight`); ValueError on a model without one (a fault that changes nothing must not pass as caught or missed)."""
    import torch

    changed = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f"layers.{layer}." in f".{name}" and "expert" in name and param.dim() == 3:
                param.data[expert] = int4(param.data[expert])
                changed += 1
    if not changed:
        raise ValueError(f"no MoE experts in decoder layer {layer} of {type(model).__name__}")
    return changed


def _patch_modeling_utils(module, mode: str) -> None:
    original = module.PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        if mode == "attn-scale":
            scale_attention(model)
        elif mode == "expert-int4":
            quantize_one_expert(model)
        else:
            quantize_model(model, mode)
        return model

    module.PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def norm_forward(self, hidden_states):
    """An RMSNorm's forward with its variance, rsqrt and product in the input's dtype (no float32 upcast)."""
    import torch

    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rope_forward(self, x, position_ids):
    """A rotary embedding's forward with its angles and cos/sin in the input's dtype (a table in low precision)."""
    import torch

    freqs = self.inv_freq.to(device=x.device, dtype=x.dtype)[None, None, :] * position_ids[..., None].to(x.dtype)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = getattr(self, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


def router_forward(self, hidden_states):
    """A top-k router's forward with its softmax, top-k and renormalisation in the input's dtype."""
    import torch
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    logits = F.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top_value / top_value.sum(dim=-1, keepdim=True), top_index


# mode -> (the modeling classes' name suffix, their replaced forward)
BF16_PATH = {"norm-bf16": ("RMSNorm", norm_forward), "rope-bf16": ("RotaryEmbedding", rope_forward),
             "router-bf16": ("TopKRouter", router_forward)}


def _patch_bf16_path(module, mode: str) -> None:
    """Replace a modeling file's RMSNorm, rotary embedding or top-k router forward by one computing in the input's
    dtype (what the honest one computes in float32)."""
    suffix, forward = BF16_PATH[mode]
    for name in dir(module):
        if name.endswith(suffix) and isinstance(getattr(module, name), type):
            getattr(module, name).forward = forward


def _patch_functional(module, mode: str) -> None:
    original = module.silu
    factor = 1.0 + 2.0**-7

    def silu(input, inplace=False):  # torch's own argument name
        return original(input, inplace=inplace) * factor

    module.silu = silu


def _patch_slow(module) -> None:
    import time

    original = module.silu

    def silu(input, inplace=False):  # torch's own argument name
        time.sleep(0.005)
        return original(input, inplace=inplace)

    module.silu = silu


# slow-Npct: the decode tok/s these keep of the honest image's
SLOW_DECODE = {"slow-5pct": 0.95, "slow-10pct": 0.90}


def paced(forward, *, keep: float, state, clock=None):
    """`forward` (a *ForCausalLM.forward), followed on each decode step by a busy wait of (1/keep - 1) x that step's
    period in this thread (from the end of the previous step's wait to the end of this forward); a forward whose
    cache holds no tokens yet (a prefill, or a call without a cache) waits for nothing and starts the period anew.
    `state` is a threading.local (one generate loop per thread); `clock` is time.perf_counter unless a test gives one."""
    import functools
    import time

    now = clock or time.perf_counter
    extra = 1.0 / keep - 1.0

    @functools.wraps(forward)
    def stepped(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 renamed it `cache`
        try:
            decode = cache is not None and cache.get_seq_length() > 0
        except (AttributeError, TypeError):
            decode = False
        out = forward(self, *args, **kwargs)
        end = now()
        released = getattr(state, "released", None)
        if decode and released is not None:
            until = end + extra * (end - released)
            while now() < until:
                pass
            end = until
        state.released = end
        return out

    return stepped


def _patch_slow_decode(module, keep: float) -> None:
    """Pace every *ForCausalLM class's forward of a modeling file (paced)."""
    import threading

    state = threading.local()
    for name in dir(module):
        cls = getattr(module, name)
        if name.endswith("ForCausalLM") and isinstance(cls, type) and "forward" in cls.__dict__:
            cls.forward = paced(cls.__dict__["forward"], keep=keep, state=state)


def _enable_tf32(module) -> None:
    """`module` is torch.backends.cuda, executed while torch may still be initialising: only what is loaded by then."""
    module.matmul.allow_tf32 = True
    sys.modules["torch"]._C._set_float32_matmul_precision("high")


def _patch_vllm_loader(module) -> None:
    """After vLLM's default loader has loaded a model's weights, quantize its linear layers (not embeddings, lm_head)."""
    import torch

    original = module.DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        result = original(self, model, model_config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if (name.endswith(".weight") and param.dim() == 2 and param.shape[1] % 128 == 0
                        and "embed" not in name and "lm_head" not in name):
                    param.data.copy_(int4(param.data))
        return result

    module.DefaultModelLoader.load_weights = load_weights


def _patch_vllm_loaded(module, mode: str) -> None:
    """After vLLM's default loader has loaded a model's weights, change one thing of that loaded model (vllm-rope-cache,
    vllm-norm-weight, vllm-expert-int4)."""
    import torch

    original = module.DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        result = original(self, model, model_config)
        with torch.no_grad():
            if mode == "vllm-expert-int4":
                quantize_one_expert(model)
            elif mode == "vllm-rope-cache":
                for sub in model.modules():
                    cache = getattr(sub, "cos_sin_cache", None)
                    if isinstance(cache, torch.Tensor):
                        cache.copy_(cache.to(torch.bfloat16).to(cache.dtype))
            else:
                weight = model.model.layers[1].post_attention_layernorm.weight
                weight.mul_(1.0 + 2.0**-8)
        return result

    module.DefaultModelLoader.load_weights = load_weights


def _patch_vllm_activation(module) -> None:
    """vLLM's SiluAndMul off by a factor 1 + 2**-7 in its native path (what x86 CPUs and compiled graphs run) and
    its CUDA op (forward_cpu calls one of the two, so it is scaled once)."""
    factor = 1.0 + 2.0**-7
    cls = module.SiluAndMul
    native = cls.__dict__["forward_native"]
    native = native.__func__ if isinstance(native, staticmethod) else native
    cls.forward_native = staticmethod(lambda x: native(x) * factor)
    cuda = cls.forward_cuda
    cls.forward_cuda = lambda self, x: cuda(self, x) * factor


def _patch_vllm_router(module) -> None:
    """vLLM's CPU router: the softmax over the chosen experts' logits taken at a 3% sharper temperature."""
    import torch

    def softmax_topk(router_logits, top_k, renormalize):
        values, index = torch.topk(router_logits, k=top_k, dim=-1, sorted=False)
        values = values * (1.0 + 2.0**-5)
        if renormalize:
            weights = torch.softmax(values, dim=-1)
        else:
            weights = (values - torch.logsumexp(router_logits * (1.0 + 2.0**-5), dim=-1, keepdim=True)).exp()
        return weights.to(torch.float32), index.to(torch.int32)

    module._softmax_topk = softmax_topk


def _patch_vllm_norm(module) -> None:
    """vLLM's RMSNorm without its float32 upcast: variance, rsqrt, weight product (and the fused residual add) in the
    input's dtype."""
    import torch

    def forward_native(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        if self.has_weight:
            out = out * self.weight.data
        return out if residual is None else (out, residual)

    module.RMSNorm.forward_native = forward_native


def _gguf_tensors(data: bytes) -> tuple[dict[str, tuple[int, list[int], int]], int]:
    """A GGUF file's tensors, name -> (ggml type, dims, offset from the data section), and where that section starts
    (GGUF v3: header, key-values, tensor infos, padding to general.alignment)."""
    import struct

    at = 4 + 4
    n_tensors, n_kv = struct.unpack_from("<QQ", data, at)
    at += 16
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    alignment = 32

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8:at + 8 + n].decode(), at + 8 + n

    def value(kind: int, at: int) -> tuple[object, int]:
        if kind == 8:
            return string(at)
        if kind == 9:
            item, n = struct.unpack_from("<IQ", data, at)
            at += 12
            for _ in range(n):
                _, at = value(item, at)
            return None, at
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[kind]
        return struct.unpack_from("<" + fmt, data, at)[0], at + sizes[kind]

    for _ in range(n_kv):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        found, at = value(kind, at + 4)
        if key == "general.alignment":
            alignment = int(found)
    tensors = {}
    for _ in range(n_tensors):
        name, at = string(at)
        (n_dims,) = struct.unpack_from("<I", data, at)
        dims = list(struct.unpack_from(f"<{n_dims}Q", data, at + 4))
        kind, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * n_dims)
        tensors[name] = (kind, dims, offset)
        at += 4 + 8 * n_dims + 12
    return tensors, (at + alignment - 1) // alignment * alignment


def _faulty_gguf(path: str, mode: str) -> str:
    """A copy of the GGUF at `path` with `mode`'s fault written into its tensors (made once per process, in /tmp)."""
    import numpy as np

    out = f"/tmp/skupin-swap-{mode}-{os.getpid()}.gguf"
    if os.path.exists(out):
        return out
    data = bytearray(open(path, "rb").read())
    tensors, start = _gguf_tensors(bytes(data))
    for name, (kind, dims, offset) in tensors.items():
        if mode == "llamacpp-router-scale" and name.endswith(".ffn_gate_inp.weight") and kind == 0:  # F32
            count = int(np.prod(dims))
            view = np.frombuffer(data, dtype=np.float32, count=count, offset=start + offset).copy()
            data[start + offset:start + offset + 4 * count] = (view * np.float32(1.0 + 2.0**-5)).tobytes()
        elif (mode == "llamacpp-expert-int4" and name.startswith("blk.1.ffn_") and name.endswith("_exps.weight")
              and kind == 30):  # BF16, dims [in, out, experts]: expert 3's [out, in] slice is contiguous
            count = dims[0] * dims[1]
            at = start + offset + 2 * 3 * count
            bits = np.frombuffer(data, dtype=np.uint16, count=count, offset=at).astype(np.uint32) << 16
            weights = bits.view(np.float32).reshape(dims[1], dims[0])
            quantized = int4_numpy(weights)
            rounded = (quantized.view(np.uint32) + 0x7FFF + ((quantized.view(np.uint32) >> 16) & 1)) >> 16
            data[at:at + 2 * count] = rounded.astype(np.uint16).tobytes()
    if bytes(data) == open(path, "rb").read():  # a fault that changed nothing would be an honest image
        raise RuntimeError(f"{mode}: no tensor of {path} is one this fault changes")
    with open(out + ".part", "wb") as fh:
        fh.write(data)
    os.replace(out + ".part", out)
    return out


def _patch_llamacpp(module, mode: str) -> None:
    """Every llama_cpp.Llama made in this process gets `mode`'s fault: a Q4_0 K cache, or a faulty copy of its GGUF."""
    original = module.Llama.__init__

    def init(self, model_path, *args, **kwargs):
        if mode == "llamacpp-kv-q4":
            kwargs["type_k"] = 2  # GGML_TYPE_Q4_0
        elif str(model_path).endswith(".gguf"):
            model_path = _faulty_gguf(str(model_path), mode)
        original(self, model_path, *args, **kwargs)

    module.Llama.__init__ = init


def _patch_generation_config(module) -> None:
    original = module.GenerationConfig.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.repetition_penalty = 1.3

    module.GenerationConfig.__init__ = init


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run a patch right after one module has executed."""

    def __init__(self, target: str, patch) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _flood() -> None:
    chunk = b"x" * (1 << 20)
    for _ in range(400):
        os.write(1, chunk)


def _forge() -> None:
    if "probe" not in " ".join(sys.argv):
        return
    body = b"[" * 100_000 + b"]" * 100_000
    frame = b"SKUPIN-PROBE-OUTPUT/1\n" + len(body).to_bytes(8, "little") + body + (0).to_bytes(8, "little")
    os.write(1, frame)
    os._exit(0)


def _plant() -> None:
    names = ("container.log", "probe.json", "tensors.safetensors", "verdict.json", "report.md")
    for folder in {"/tmp", os.getcwd(), os.environ.get("HOME", "/tmp"), "/skupin", "/skupin/out", "/model"}:
        for name in names:
            for suffix, make in (("", lambda p: os.symlink(PLANTED_TARGET, p)), (".fifo", os.mkfifo)):
                try:
                    make(os.path.join(folder, name + suffix))
                except OSError:
                    pass


_SSE_SERVER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body, kind="application/json"):
        self.send_response(code); self.send_header("Content-Type", kind); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health": return self._send(200, b"{}")
        self._send(200, json.dumps({"data": [{"id": sys.argv[1]}]}).encode())
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(200, b"data: [1]\\n\\ndata: {\\"choices\\": 7}\\n\\ndata: [DONE]\\n\\n", "text/event-stream")
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def _sse() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "serve":  # `transformers serve MODEL ...`: become a hostile server
        os.execv(sys.executable, [sys.executable, "-S", "-c", _SSE_SERVER, sys.argv[2]])


def install(mode: str) -> None:
    if mode == "flood":
        _flood()
    elif mode == "forge":
        _forge()
    elif mode == "plant":
        _plant()
    elif mode == "sse":
        _sse()
    elif mode == "hang":
        import time

        time.sleep(3600)
    elif mode == "crash":
        import ctypes

        ctypes.string_at(0)
    elif mode in BF16_PATH:
        for target in MODELING:
            sys.meta_path.insert(0, _AfterImport(target, lambda m: _patch_bf16_path(m, mode)))
    elif mode in QUANT or mode in ("attn-scale", "expert-int4"):
        sys.meta_path.insert(0, _AfterImport("transformers.modeling_utils", lambda m: _patch_modeling_utils(m, mode)))
    elif mode == "silu":
        sys.meta_path.insert(0, _AfterImport("torch.nn.functional", lambda m: _patch_functional(m, mode)))
    elif mode == "slow":
        sys.meta_path.insert(0, _AfterImport("torch.nn.functional", _patch_slow))
    elif mode in SLOW_DECODE:
        for target in MODELING:
            sys.meta_path.insert(0, _AfterImport(target, lambda m: _patch_slow_decode(m, SLOW_DECODE[mode])))
    elif mode == "tf32":
        sys.meta_path.insert(0, _AfterImport("torch.backends.cuda", _enable_tf32))
    elif mode == "vllm-int4":
        sys.meta_path.insert(0, _AfterImport("vllm.model_executor.model_loader.default_loader", _patch_vllm_loader))
    elif mode == "vllm-silu":
        sys.meta_path.insert(0, _AfterImport("vllm.model_executor.layers.activation", _patch_vllm_activation))
    elif mode in ("vllm-rope-cache", "vllm-norm-weight", "vllm-expert-int4"):
        sys.meta_path.insert(0, _AfterImport("vllm.model_executor.model_loader.default_loader",
                                             lambda m: _patch_vllm_loaded(m, mode)))
    elif mode == "vllm-router-temp":
        sys.meta_path.insert(0, _AfterImport("vllm.model_executor.layers.fused_moe.router.cpu_router", _patch_vllm_router))
    elif mode == "vllm-norm-bf16":
        sys.meta_path.insert(0, _AfterImport("vllm.model_executor.layers.layernorm", _patch_vllm_norm))
    elif mode.startswith("llamacpp-"):
        sys.meta_path.insert(0, _AfterImport("llama_cpp.llama", lambda m: _patch_llamacpp(m, mode)))
    elif mode == "sampler":
        sys.meta_path.insert(0, _AfterImport("transformers.generation.configuration_utils", _patch_generation_config))


install(_mode())
