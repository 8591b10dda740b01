"""Honest and swapped runs of tiny-llama on the NVIDIA H200 for the `nvidia-hopper` tolerance entries (issue 18).

Runs on the reference machine through the `run` tool (torch + transformers + numpy; no pydantic, no Docker):

    PYTHONPATH=$PWD python3 bench/calibrate_h200.py --out $OUT

Everything runs in-process with the probe's own code (imagetools/probe.py through
bench/detection/runs.py: the transformers loading, the kernel battery, the teacher-forced Collector)
and is measured against the committed H200 bundles gates/references/tiny-llama/h200-{bfloat16,float32}
with the gate's own gates/compare.py, as bench/detection/h200_job.py does. Four fresh Python
processes ("boots"), each a new CUDA context:

- boots 1 and 2, split "calibration": batch 1/2/4/8/16/64 x sdpa/eager attention;
- boots 3 and 4, split "heldout": batch 1/2/3/4/7/8/16/32/64 x sdpa/eager (3, 7 and 32 never
  calibrated on), never used to derive the entries;
- boot 1 also runs every swap of bench/detection/swaps.py at (batch 8, sdpa), (batch 1, eager) and
  (batch 64, sdpa), split "swap".

One JSON line per run goes to OUT/h200-calib-records.jsonl (the spec, per-prompt statistics,
kernel errors); OUT/h200-calib-env.json holds the machine's versions. The entries are derived on
the development machine from these records with gates.calibrate.derive_entry_from_measurements
(bench/calibrate_h200_derive.py), which needs pydantic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.detection import runs  # noqa: E402
from gates.tensorio import read_safetensors  # noqa: E402
from imagetools import probe  # noqa: E402

HW = "nvidia-hopper"
MODEL = "tiny-llama"
DTYPES = ("bfloat16", "float32")
ATTNS = ("sdpa", "eager")
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 64)
HELDOUT_BATCHES = (1, 2, 3, 4, 7, 8, 16, 32, 64)
SWAP_VARIATIONS = ((8, "sdpa", 0), (1, "eager", 0), (64, "sdpa", 0))
BOOTS = {1: "calibration", 2: "calibration", 3: "heldout", 4: "heldout"}
FULL = 4  # prompts with full-vocabulary logprobs (the probe's default for tiny-llama)
ENV_KEYS = ("python", "torch", "cuda", "cudnn", "triton", "engines", "driver", "device", "settings", "cpu_model",
            "cpu_capability", "distributions")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def specs_for(boot: int, dtype: str) -> list[dict]:
    """The run specs of one boot for one dtype, each tagged with its split."""
    split = BOOTS[boot]
    batches = CALIBRATION_BATCHES if split == "calibration" else HELDOUT_BATCHES
    specs = [{**s, "split": split} for s in runs.honest_specs(hw=HW, model=MODEL, dtype=dtype, batches=batches,
                                                              attns=ATTNS, threads=(0,), boot=boot)]
    if boot == 1:
        specs += [{**s, "split": "swap"} for s in runs.swap_specs(hw=HW, model=MODEL, dtype=dtype,
                                                                  variations=SWAP_VARIATIONS, boot=1)]
    return specs


def one_boot(boot: int, out: Path, *, smoke: bool = False) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fixture = ROOT / "gates/fixtures" / MODEL
    ids = runs.load_ids(fixture / "prompts.json")
    if boot == 1:
        env = probe.environment(device)
        (out / "h200-calib-env.json").write_text(json.dumps({k: env.get(k) for k in ENV_KEYS}, indent=1, default=str)
                                                 + "\n")
    with (out / "h200-calib-records.jsonl").open("a", encoding="utf-8") as records:
        for dtype in DTYPES:
            ref, _ = read_safetensors(ROOT / f"gates/references/{MODEL}/h200-{dtype}/tensors.safetensors")
            t0 = time.perf_counter()
            specs = specs_for(boot, dtype)
            if smoke:
                specs = specs[:1] + specs[-1:]
            for spec in specs:
                record = runs.run_spec(spec, model_dir=fixture, ids=ids, reference=ref, device=device, full=FULL)
                records.write(json.dumps(record, separators=(",", ":")) + "\n")
                records.flush()
            log(f"boot {boot} ({BOOTS[boot]}) {dtype}: {len(specs)} runs in {time.perf_counter() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--boot", type=int, default=0, help="run one boot (a child process); 0 = run every boot in turn")
    p.add_argument("--boot-timeout", type=float, default=150.0)
    p.add_argument("--smoke", action="store_true", help="two runs per boot and dtype (a quick check)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.boot:
        one_boot(args.boot, args.out, smoke=args.smoke)
        return 0
    failed = 0
    for boot in BOOTS:  # every boot a fresh process: a new CUDA context, new allocator state, new kernel choices
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--boot", str(boot)]
                                  + (["--smoke"] if args.smoke else []), check=False,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=args.boot_timeout)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = 124
        log(f"boot {boot}: exit {rc} after {time.perf_counter() - t0:.1f} s")
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
