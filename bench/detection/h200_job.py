"""The NVIDIA H200 half of the detection benchmark: honest and swapped runs of both fixtures, measured on the device.

Runs on the reference machine through the `run` tool (torch + transformers + numpy, no pydantic):

    PYTHONPATH=$PWD python3 bench/detection/h200_job.py --out $OUT

Boot 1 (this process): generates the llama-1k fixture (sha256 checked against the record),
captures the llama-1k references (batch 8, sdpa, as the committed tiny bundles were), then runs
honest variations (batch 1/2/4/8/16/64 x sdpa/eager) and every swap (bench/detection/swaps.py)
under four variations, for tiny-llama and llama-1k in bfloat16 and float32. Boot 2 (a fresh
Python process) repeats the honest variations. Every run is measured on the device against its
reference (tiny: the committed H200 bundles; llama-1k: the references captured here) and written
as one JSON line to OUT/h200-records.jsonl. The llama-1k bfloat16 reference comes back too
(OUT/ref-llama-1k-bfloat16.safetensors, written by the probe's own writer) so CPU runs can be
compared with it.
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
from skupin.imagetools import probe  # noqa: E402

HW = "nvidia-hopper"
BATCHES = (1, 2, 4, 8, 16, 64)
ATTNS = ("sdpa", "eager")
SWAP_VARIATIONS = ((8, "sdpa", 0), (1, "sdpa", 0), (8, "eager", 0), (4, "eager", 0))
KEYS = (("tiny-llama", "bfloat16"), ("tiny-llama", "float32"), ("llama-1k", "bfloat16"), ("llama-1k", "float32"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def reference(model: str, dtype: str, *, refs: Path, fixture: Path, ids, device: str, boot: int, out: Path):
    """The reference tensors of (model, dtype): the committed bundle, or a llama-1k capture made here (boot 1)."""
    if model == "tiny-llama":
        tensors, _ = read_safetensors(ROOT / f"gates/references/tiny-llama/h200-{dtype}/tensors.safetensors")
        return tensors
    path = refs / f"ref-{model}-{dtype}.safetensors"
    if not path.is_file():
        if boot != 1:
            raise RuntimeError(f"{path} missing: boot 1 captures it")
        log(f"capturing the {model} {dtype} reference (batch 8, sdpa)")
        probe_tensors = runs.probe_run(model_dir=fixture, ids=ids, dtype=dtype, attn="sdpa", batch=8,
                                       device=device, swap=None, full=spec_for(model).full_logprobs)
        probe.write_safetensors(str(path), probe_tensors, {"format": probe.FORMAT, "probe_version": probe.PROBE_VERSION,
                                                           "detection": f"{model} {dtype} batch 8 sdpa"})
        if dtype == "bfloat16":
            (out / path.name).write_bytes(path.read_bytes())
        del probe_tensors
    tensors, _ = read_safetensors(path)
    return tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--boot", type=int, default=1)
    p.add_argument("--refs", type=Path, default=Path("/tmp/detection-refs"))
    p.add_argument("--fixture", type=Path, default=Path("/tmp/fx-1k"))
    p.add_argument("--keys", default=",".join(f"{m}:{d}" for m, d in KEYS))
    p.add_argument("--smoke", action="store_true", help="two honest and two swapped runs per key (a quick check)")
    args = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    args.refs.mkdir(parents=True, exist_ok=True)
    if args.boot == 1:
        from skupin.gates.refdata.fixture import generate_fixture

        if not (args.fixture / "model.safetensors").is_file():
            log("generating the llama-1k fixture")
            generate_fixture(name="llama-1k", out=args.fixture)
        env = probe.environment(device)
        (args.out / "h200-env.json").write_text(json.dumps(
            {k: env.get(k) for k in ("python", "torch", "cuda", "cudnn", "triton", "engines", "driver", "device",
                                     "settings", "cpu_model")}, indent=1, default=str) + "\n")
    fixtures = {"tiny-llama": ROOT / "gates/fixtures/tiny-llama", "llama-1k": args.fixture}
    records = (args.out / "h200-records.jsonl").open("a", encoding="utf-8")
    for key in args.keys.split(","):
        model, dtype = key.split(":")
        ids = runs.load_ids(fixtures[model] / "prompts.json")
        ref = reference(model, dtype, refs=args.refs, fixture=fixtures[model], ids=ids, device=device, boot=args.boot,
                        out=args.out)
        specs = runs.honest_specs(hw=HW, model=model, dtype=dtype, batches=BATCHES, attns=ATTNS, threads=(0,),
                                  boot=args.boot)
        if args.boot == 1:
            specs += runs.swap_specs(hw=HW, model=model, dtype=dtype, variations=SWAP_VARIATIONS, boot=1)
        if args.smoke:
            specs = specs[:2] + specs[-2:]
        t0 = time.perf_counter()
        for spec in specs:
            record = runs.run_spec(spec, model_dir=fixtures[model], ids=ids, reference=ref, device=device,
                                   full=spec_for(model).full_logprobs)
            records.write(json.dumps(record, separators=(",", ":")) + "\n")
            records.flush()
        log(f"boot {args.boot} {model} {dtype}: {len(specs)} runs in {time.perf_counter() - t0:.1f} s")
    records.close()
    if args.boot == 1:
        log("boot 2: a fresh process repeats the honest runs")
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--out",
                str(args.out),
                "--boot",
                "2",
                "--refs",
                str(args.refs),
                "--fixture",
                str(args.fixture),
                "--keys",
                args.keys,
            ]
            + (["--smoke"] if args.smoke else []),
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        if done.returncode:
            log(f"boot 2 failed with {done.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
