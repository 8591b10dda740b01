"""Run the probe's kernel battery and teacher-forced model check in-process (honest or swapped) and measure each run.

Used both on this CPU and on the NVIDIA H200 (which has torch, transformers and numpy but no
pydantic): it imports the probe (skupin/imagetools/probe/, the folder the gate mounts into images: its shared
machinery and its transformers adapter), gates/judge/compare.py and
gates/refdata/tensorio.py only. Each run loads the fixture with transformers exactly as the probe's
transformers adapter does, applies a swap (bench/detection/swaps.py), runs the kernel battery and
the teacher-forced forward passes through the probe's own Collector, and is compared with the
reference tensors by gates.judge.compare. A run becomes one JSON record: what ran, and per prompt every
statistic the gate uses, plus every kernel op's error. Greedy decoding is skipped (the gate's
statistics do not use it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from bench.detection import swaps
from skupin.gates.judge.compare import ALL_STATS, kernel_errors, model_statistics
from skupin.imagetools import probe
from skupin.imagetools.probe import skupin_probe_transformers as adapter

TOP_K = 20


def load_ids(prompts: Path) -> list[list[int]]:
    """The prompt ids of a fixture's prompts.json."""
    doc = json.loads(Path(prompts).read_text(encoding="utf-8"))
    return [list(map(int, p["ids"])) for p in doc["prompts"]]


def load_model(model_dir: Path, *, dtype: str, attn: str, device: str):
    """The fixture loaded as the probe's transformers adapter loads it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=adapter.torch_dtype(dtype), attn_implementation=attn)
    return model.to(device).eval()


def teacher_forced(model, ids: list[list[int]], *, batch: int, device: str, full: int) -> dict:
    """The probe's model.* tensors (top-k, target logprob, hidden, full logprobs of the first `full` prompts)."""
    import torch

    col = probe.Collector(TOP_K, full)
    with torch.inference_mode():
        adapter.teacher_forced(model, ids, batch_size=batch, device=device, col=col)
    return {**col.tensors(), **probe.prompt_tensors(ids, lambda v: torch.tensor(v, dtype=torch.int32))}


def to_numpy(tensors: dict) -> dict[str, np.ndarray]:
    """torch tensors -> numpy (bfloat16/float16 widened to float32, as gates.refdata.tensorio reads them)."""
    import torch

    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        out[name] = t.numpy()
    return out


def probe_run(*, model_dir: Path, ids: list[list[int]], dtype: str, attn: str, batch: int, device: str,
              swap: str | None, full: int, threads: int = 0) -> dict:
    """Kernel battery + teacher-forced model check under `swap`, as torch tensors (the probe's names)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    with swaps.kernel_swap(swap):
        model = load_model(model_dir, dtype=dtype, attn=attn, device=device)
        if swap in swaps.WEIGHT_SWAPS:
            swaps.apply_weight_swap(model, swap)
        elif swap in (*swaps.MODEL_SWAPS, *swaps.PRECISION_SWAPS, *swaps.MOE_SWAPS, *swaps.RAGGED_SWAPS):
            swaps.apply_model_swap(model, swap)
        kernels, _ = probe.kernel_battery(device)
        tensors = teacher_forced(model, ids, batch=batch, device=device, full=full)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    del model
    return {**kernels, **tensors}


def _num(x) -> float | None:
    x = float(x)
    return None if not np.isfinite(x) else float(f"{x:.6g}")


def measure(reference: dict[str, np.ndarray], tensors: dict[str, np.ndarray]) -> dict:
    """Per-prompt statistics and kernel errors of a run against the reference (JSON-ready)."""
    stats = model_statistics(reference, tensors)
    errors = kernel_errors(reference, tensors)
    kernels = {k.op: (_num(k.rel_err) if k.rel_err is not None else None) for k in errors}
    problems = {k.op: k.problem for k in errors if k.problem}
    return {"stats": {s: [_num(v) for v in stats.per_prompt[s]] for s in ALL_STATS},
            "available": list(stats.available), "nonfinite": list(stats.nonfinite),
            "kernels": kernels, "kernel_problems": problems}


def run_spec(spec: dict, *, model_dir: Path, ids: list[list[int]], reference: dict[str, np.ndarray], device: str,
             full: int) -> dict:
    """One record: the spec, its measurement against `reference`, and its wall time."""
    t0 = time.perf_counter()
    tensors = to_numpy(probe_run(model_dir=model_dir, ids=ids, dtype=spec["dtype"], attn=spec["attn"],
                                 batch=spec["batch"], device=device, swap=spec.get("swap"), full=full,
                                 threads=spec.get("threads", 0)))
    record = {**spec, **measure(reference, tensors)}
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    return record


def honest_specs(*, hw: str, model: str, dtype: str, batches, attns, threads, boot: int) -> list[dict]:
    """Honest run specs: every batch x attention x threads of one boot."""
    return [{"class": hw, "model": model, "dtype": dtype, "role": "honest", "swap": None, "batch": b, "attn": a,
             "threads": t, "boot": boot} for a in attns for b in batches for t in threads]


def swap_specs(*, hw: str, model: str, dtype: str, variations, boot: int, names=swaps.SWAPS) -> list[dict]:
    """Swap run specs: every swap under every (batch, attention, threads) variation."""
    return [{"class": hw, "model": model, "dtype": dtype, "role": "swap", "swap": s, "batch": b, "attn": a,
             "threads": t, "boot": boot} for s in names for b, a, t in variations]
