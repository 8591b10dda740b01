"""Honest bf16 runs on fresh prompt sets: the gate's honest-reject rate at 64 prompts, with enough distinct decisions.

Runs on the NVIDIA H200 through the `run` tool (torch + transformers + numpy; no pydantic), with the probe's own
code through bench/detection/runs.py. The committed fixture's weights stay; each prompt set is a new draw of the
fixture's prompt recipe (gates/refdata/fixture.prompt_set with prompt_seed = SEED0 + set number: lengths and
texts drawn anew), so every set's decisions are distinct evidence rather than repeats of one set's bits. Per set:

- the set's reference: batch 8, sdpa attention, bfloat16 (how the committed bundles were captured);
- every honest variation of VARIATIONS (other batch sizes, eager attention), each measured against that reference
  with the gate's own statistics (gates/judge/compare.py): one JSON line per run in OUT/honest-<model>-<worker>.jsonl.

Several workers share the GPU (each a separate process: its own CUDA context and kernel choices) and stop starting
sets at --deadline seconds. The records need not be committed whole: bench/calibrate_h200_derive.py judges them with
the committed `nvidia-hopper` entries (the decisions and counts are committed in bench/results/calibration/).

    PYTHONPATH=$PWD python3 bench/h200/honest_sets.py --out $OUT/honest --model peaked-moe --worker 0 --workers 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.detection import runs  # noqa: E402
from skupin.gates.refdata import fixture  # noqa: E402

SEED0 = 1000
REFERENCE = {"batch": 8, "attn": "sdpa"}
VARIATIONS = ((4, "sdpa"), (16, "sdpa"), (64, "sdpa"), (3, "sdpa"), (4, "eager"), (8, "eager"), (16, "eager"),
              (64, "eager"))


def prompt_ids(spec: fixture.FixtureSpec, tokenizer, words: list[str], number: int) -> list[list[int]]:
    """The ids of prompt set `number`: the fixture's recipe with prompt_seed SEED0 + number."""
    drawn = dataclasses.replace(spec, prompt_seed=SEED0 + number)
    return [p["ids"] for p in fixture.prompt_set(drawn, tokenizer, words)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="peaked-moe")
    p.add_argument("--fixtures", type=Path, default=Path("/tmp/skupin-fixtures"))
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--sets", type=int, default=1000, help="the most sets (numbers worker, worker + workers, ...)")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds after which no new set is started")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    import torch

    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = args.fixtures / args.model
    if not (folder / "SHA256SUMS").is_file():
        fixture.generate_fixture(name=args.model, out=folder)
    spec = fixture.spec_for(args.model)
    words = fixture.word_list(spec)
    tokenizer = fixture.train_tokenizer(spec, words)
    full = spec.full_logprobs  # as the committed bundle and the gate's probe
    args.out.mkdir(parents=True, exist_ok=True)
    done = 0
    with (args.out / f"honest-{args.model}-{args.worker}.jsonl").open("a", encoding="utf-8") as records:
        for number in range(args.worker, args.sets, args.workers):
            if time.perf_counter() - t0 > args.deadline:
                break
            ids = prompt_ids(spec, tokenizer, words, number)
            ref = runs.to_numpy(runs.probe_run(model_dir=folder, ids=ids, dtype=args.dtype, device=device, swap=None,
                                               full=full, **REFERENCE))
            for batch, attn in VARIATIONS:
                run = {"class": "nvidia-hopper", "model": args.model, "dtype": args.dtype, "role": "honest",
                       "split": "prompt-set", "swap": None, "set": number, "batch": batch, "attn": attn,
                       "boot": args.worker}
                records.write(json.dumps(runs.run_spec(run, model_dir=folder, ids=ids, reference=ref, device=device,
                                                       full=full), separators=(",", ":")) + "\n")
            records.flush()
            done += 1
    print(f"worker {args.worker}: {done} prompt sets x {len(VARIATIONS)} runs in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
