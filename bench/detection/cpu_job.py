"""The CPU half of the detection benchmark: honest and swapped runs on this machine (hardware class cpu-x86_64).

    PYTHONPATH=$PWD python bench/detection/cpu_job.py --out bench/results/detection \
        --llama-ref .skupin/detection/ref-llama-1k-bfloat16.safetensors

Every run is compared with the NVIDIA H200 reference, as the gate compares a CPU image: tiny-llama
float32 and bfloat16 with the committed H200 bundles, llama-1k bfloat16 with the reference the H200
job captured (it skips llama-1k when that file is absent). Honest runs: the `skupin calibrate`
recipe (batch 8 and 1 x 1 and 2 torch threads; threads 1 only for llama-1k) plus batch 2/4/16/64,
eager attention, and a second boot in a fresh process; swaps: every swap at batch 8 sdpa and
(tiny-llama) batch 1 eager. Torch is capped at 1 thread except in the 2-thread honest runs of the
tiny model (a second or two each): the machine is shared. Records go to OUT/cpu-records.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.detection import runs  # noqa: E402
from skupin.gates.refdata.fixture import spec_for  # noqa: E402
from skupin.gates.refdata.tensorio import read_safetensors  # noqa: E402

HW = "cpu-x86_64"


def plan(model: str, dtype: str, boot: int) -> list[dict]:
    """The run specs of one (model, dtype) for one boot (boot 2 repeats the calibration recipe's honest runs)."""
    h = dict(hw=HW, model=model, dtype=dtype)
    if model == "tiny-llama":
        if boot == 2:
            return runs.honest_specs(**h, batches=(8, 1), attns=("sdpa",), threads=(1, 2), boot=2)
        return (runs.honest_specs(**h, batches=(8, 1), attns=("sdpa",), threads=(1, 2), boot=1)
                + runs.honest_specs(**h, batches=(2, 4, 16, 64), attns=("sdpa",), threads=(1,), boot=1)
                + runs.honest_specs(**h, batches=(8, 1), attns=("eager",), threads=(1,), boot=1)
                + runs.swap_specs(**h, variations=((8, "sdpa", 1), (1, "eager", 1)), boot=1))
    if boot == 2:
        return runs.honest_specs(**h, batches=(8,), attns=("sdpa",), threads=(1,), boot=2)
    return (runs.honest_specs(**h, batches=(8, 1), attns=("sdpa",), threads=(1,), boot=1)
            + runs.honest_specs(**h, batches=(4,), attns=("sdpa",), threads=(1,), boot=1)
            + runs.honest_specs(**h, batches=(8,), attns=("eager",), threads=(1,), boot=1)
            + runs.swap_specs(**h, variations=((8, "sdpa", 1),), boot=1))


def _ident(spec: dict) -> tuple:
    return tuple(spec.get(k) for k in ("class", "model", "dtype", "role", "swap", "batch", "attn", "threads", "boot"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--boot", type=int, default=1)
    p.add_argument("--llama-ref", type=Path, default=ROOT / ".skupin/detection/ref-llama-1k-bfloat16.safetensors")
    p.add_argument("--llama-dir", type=Path, default=Path("/tmp/fx-1k"))
    p.add_argument("--keys", default="tiny-llama:float32,tiny-llama:bfloat16,llama-1k:bfloat16")
    p.add_argument("--llama-prompts", type=int, default=16,
                   help="llama-1k runs use the first N prompts (bf16 on this CPU takes ~2 min per 64-prompt run)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cpu-records.jsonl"
    done = {_ident(json.loads(line)) for line in path.read_text().splitlines() if line.strip()} if path.is_file() else set()
    records = path.open("a", encoding="utf-8")
    for key in args.keys.split(","):
        model, dtype = key.split(":")
        if model == "tiny-llama":
            folder = ROOT / "gates/fixtures/tiny-llama"
            ref, _ = read_safetensors(ROOT / f"gates/references/tiny-llama/h200-{dtype}/tensors.safetensors")
        else:
            if not args.llama_ref.is_file():
                print(f"skipping {key}: no H200 reference at {args.llama_ref} (run the H200 job first)", flush=True)
                continue
            folder = args.llama_dir
            if not (folder / "model.safetensors").is_file():
                from skupin.gates.refdata.fixture import generate_fixture

                generate_fixture(name="llama-1k", out=folder)
            ref, _ = read_safetensors(args.llama_ref)
        ids = runs.load_ids(folder / "prompts.json")
        if model == "llama-1k" and args.llama_prompts < len(ids):
            ids = ids[: args.llama_prompts]
            ref = {k: (v[: args.llama_prompts] if k.startswith("model.") else v) for k, v in ref.items()}
        t0 = time.perf_counter()
        specs = [s for s in plan(model, dtype, args.boot) if _ident(s) not in done]  # resume: finished runs are kept
        for spec in specs:
            record = runs.run_spec(spec, model_dir=folder, ids=ids, reference=ref, device="cpu",
                                   full=spec_for(model).full_logprobs)
            record["prompts"] = len(ids)
            records.write(json.dumps(record, separators=(",", ":")) + "\n")
            records.flush()
            torch.set_num_threads(1)
        print(f"[{time.strftime('%H:%M:%S')}] boot {args.boot} {model} {dtype}: {len(specs)} runs in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    records.close()
    if args.boot == 1:
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--out",
                str(args.out),
                "--boot",
                "2",
                "--llama-ref",
                str(args.llama_ref),
                "--llama-dir",
                str(args.llama_dir),
                "--keys",
                args.keys,
                "--llama-prompts",
                str(args.llama_prompts),
            ],
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
