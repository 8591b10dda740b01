"""Honest and swapped runs of the gate's fixtures on the NVIDIA H200: `nvidia-hopper` entries and the detection bench.

Runs on the reference machine through the `run` tool (torch + transformers + numpy; no pydantic, no Docker):

    PYTHONPATH=$PWD python3 bench/calibrate_h200.py --out $OUT [--boots 1,2] [--models tiny-moe,deep-llama]

Everything runs in-process with the probe's own code (skupin/imagetools/probe/ through
bench/detection/runs.py: the transformers loading, the kernel battery, the teacher-forced Collector)
and is measured against the H200 references with the gate's own gates/judge/compare.py. References:
the committed bundles gates/references/<model>/h200-{bfloat16,float32} (tiny-llama, tiny-moe, deep-llama),
and for llama-1k (8 decoder layers, 14 MB per reference: not committed) a capture made by boot 1
(batch 8, sdpa, as the bundles were) in --refs, re-captured by the first boot of a later device call
(the H200 reproduces it bit for bit). Every boot is a fresh Python process (a new CUDA context, new
allocator state, new kernel choices):

- boots 1 and 2, split "calibration": batch 1/2/4/8/16/64 x sdpa/eager attention;
- boots 3 to 6, split "heldout": batch 1-24/32/48/64 x sdpa/eager (every size but 1/2/4/8/16/64
  never calibrated on), never used to derive the entries;
- boot 1 also runs every swap of bench/detection/swaps.py that applies to the model (the MoE
  faults to tiny-moe only, the dropped attention mask to the ragged prompt sets of tiny-moe and deep-llama) at
  (batch 8, sdpa), (batch 1, eager) and (batch 64, sdpa), split "swap".

One JSON line per run goes to OUT/h200-calib-records.jsonl (the spec, per-prompt statistics,
kernel errors); OUT/h200-calib-env.json holds the machine's versions. The entries and the bench's
decisions are derived on the development machine from these records with the gate's own code
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

from bench.detection import runs, swaps  # noqa: E402
from skupin.gates.refdata.fixture import spec_for  # noqa: E402
from skupin.gates.refdata.tensorio import read_safetensors  # noqa: E402
from skupin.imagetools import probe  # noqa: E402

HW = "nvidia-hopper"
MODELS = ("tiny-llama", "tiny-moe", "deep-llama", "llama-1k", "peaked-moe")
COMMITTED = ("tiny-llama", "tiny-moe", "deep-llama", "peaked-moe")  # models whose H200 references are committed bundles
RAGGED = ("tiny-moe", "deep-llama", "peaked-moe")  # ragged prompt sets: batches pad
MOE = ("tiny-moe", "peaked-moe")
DTYPES = ("bfloat16", "float32")
ATTNS = ("sdpa", "eager")
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 64)
HELDOUT_BATCHES = (*range(1, 25), 32, 48, 64)
SWAP_VARIATIONS = ((8, "sdpa", 0), (1, "eager", 0), (64, "sdpa", 0))
BOOTS = {1: "calibration", 2: "calibration", 3: "heldout", 4: "heldout", 5: "heldout", 6: "heldout"}
ENV_KEYS = ("python", "torch", "cuda", "cudnn", "triton", "engines", "driver", "device", "settings", "cpu_model",
            "cpu_capability", "distributions")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def specs_for(boot: int, model: str, dtype: str, only_swaps: tuple[str, ...] = ()) -> list[dict]:
    """The run specs of one boot for one model and dtype, each tagged with its split (with `only_swaps`: boot 1's runs
    of those swaps alone, no honest run)."""
    split = BOOTS[boot]
    batches = CALIBRATION_BATCHES if split == "calibration" else HELDOUT_BATCHES
    specs = [] if only_swaps else [
        {**s, "split": split} for s in runs.honest_specs(hw=HW, model=model, dtype=dtype, batches=batches,
                                                         attns=ATTNS, threads=(0,), boot=boot)]
    if boot == 1:
        names = [n for n in only_swaps or swaps.SWAPS + swaps.PRECISION_SWAPS + swaps.MOE_SWAPS + swaps.RAGGED_SWAPS
                 if swaps.applies_to(n, moe=model in MOE, ragged=model in RAGGED)]
        specs += [{**s, "split": "swap"} for s in runs.swap_specs(hw=HW, model=model, dtype=dtype,
                                                                  variations=SWAP_VARIATIONS, boot=1, names=names)]
    return specs


def fixture_dir(model: str, fixtures: Path) -> Path:
    """The committed fixture folder (tiny-llama), or one generated here (sha256 checked against the record)."""
    if (ROOT / "gates/fixtures" / model).is_dir():
        return ROOT / "gates/fixtures" / model
    folder = fixtures / model
    if not (folder / "SHA256SUMS").is_file():
        from skupin.gates.refdata.fixture import generate_fixture

        log(f"generating the {model} fixture")
        generate_fixture(name=model, out=folder)
    return folder


def reference(model: str, dtype: str, *, folder: Path, ids, device: str, boot: int, refs: Path):
    """The reference tensors of (model, dtype): the committed bundle, or a capture made by boot 1 in `refs`."""
    if model in COMMITTED:
        tensors, _ = read_safetensors(ROOT / f"gates/references/{model}/h200-{dtype}/tensors.safetensors")
        return tensors
    path = refs / f"ref-{model}-{dtype}.safetensors"
    if not path.is_file():  # boot 1, or the first boot of a later call on a fresh machine (the capture is deterministic)
        log(f"capturing the {model} {dtype} reference (batch 8, sdpa) in boot {boot}")
        captured = runs.probe_run(model_dir=folder, ids=ids, dtype=dtype, attn="sdpa", batch=8, device=device,
                                  swap=None, full=spec_for(model).full_logprobs)
        probe.write_safetensors(str(path), captured, {"format": probe.FORMAT, "probe_version": probe.PROBE_VERSION,
                                                      "detection": f"{model} {dtype} batch 8 sdpa"})
    tensors, _ = read_safetensors(path)
    return tensors


def one_boot(boot: int, out: Path, *, models: list[str], fixtures: Path, refs: Path, smoke: bool = False,
             only_swaps: tuple[str, ...] = ()) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if boot == 1:
        env = probe.environment(device)
        (out / "h200-calib-env.json").write_text(json.dumps({k: env.get(k) for k in ENV_KEYS}, indent=1, default=str)
                                                 + "\n")
    with (out / "h200-calib-records.jsonl").open("a", encoding="utf-8") as records:
        for model in models:
            folder = fixture_dir(model, fixtures)
            ids = runs.load_ids(folder / "prompts.json")
            for dtype in DTYPES:
                ref = reference(model, dtype, folder=folder, ids=ids, device=device, boot=boot, refs=refs)
                t0 = time.perf_counter()
                specs = specs_for(boot, model, dtype, only_swaps)
                if smoke:
                    specs = specs[:1] + specs[-1:]
                for spec in specs:
                    record = runs.run_spec(spec, model_dir=folder, ids=ids, reference=ref, device=device,
                                           full=spec_for(model).full_logprobs)
                    records.write(json.dumps(record, separators=(",", ":")) + "\n")
                    records.flush()
                log(f"boot {boot} ({BOOTS[boot]}) {model} {dtype}: {len(specs)} runs in "
                    f"{time.perf_counter() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--boot", type=int, default=0, help="run one boot (a child process); 0 = run every boot in turn")
    p.add_argument("--boots", default=",".join(map(str, BOOTS)), help="the boots to run, each a child process")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--fixtures", type=Path, default=Path("/tmp/skupin-fixtures"))
    p.add_argument("--refs", type=Path, default=Path("/tmp/skupin-detection-refs"))
    p.add_argument("--boot-timeout", type=float, default=400.0)
    p.add_argument("--smoke", action="store_true", help="two runs per boot, model and dtype (a quick check)")
    p.add_argument("--only-swaps", default="", help="comma-separated swaps: boot 1 runs these alone (no honest run)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.refs.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    if args.boot:
        one_boot(args.boot, args.out, models=models, fixtures=args.fixtures, refs=args.refs, smoke=args.smoke,
                 only_swaps=tuple(filter(None, args.only_swaps.split(","))))
        return 0
    failed = 0
    for boot in map(int, args.boots.split(",")):  # every boot a fresh process: a new CUDA context, allocator state
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--boot", str(boot),
                                   "--models", args.models, "--fixtures", str(args.fixtures), "--refs", str(args.refs),
                                   "--only-swaps", args.only_swaps]
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
