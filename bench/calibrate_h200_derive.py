"""Derive the `nvidia-hopper` tolerance entries from the H200 records and judge the held-out runs with the gate's code.

    PYTHONPATH=$PWD .venv/bin/python bench/calibrate_h200_derive.py            # derive, merge, judge, write results
    PYTHONPATH=$PWD .venv/bin/python bench/calibrate_h200_derive.py --dry-run  # judge only; tolerances.yaml untouched

Input: bench/results/calibration/h200-calib-records.jsonl and h200-calib-env.json, brought back by
bench/calibrate_h200.py from the H200. Per dtype (bfloat16, float32):

1. calibration: the "calibration" split (boots 1 and 2 x batch 1/2/4/8/16/64 x sdpa/eager) ->
   `gates.calibrate.derive_entry_from_measurements` (the code `skupin calibrate` runs after its
   containers: margin 4, dtype floors, Clopper-Pearson honest rate), against the committed bundle's
   sha256, merged with `gates.tolerance.merge_entry` (other classes' entries untouched) and written;
2. judgement: every "heldout" run (boots 3 and 4, batch 1/2/3/4/7/8/16/32/64 x sdpa/eager) and every
   "swap" run decided with the gate's own rules (`gates.verdict.kernel_hard_failures`,
   `judge_kernels`, `judge_model`: bench/detection/analysis.decide) on all 64 prompts (what the gate
   does) and on disjoint 8-prompt blocks; also without the hidden states (engines whose probe
   adapter returns none lose 1 - cos) and with no entry at all (what an uncalibrated gate can say).

Output: bench/results/calibration/h200-calibration.json (entries' thresholds, decisions, margins).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.detection import analysis  # noqa: E402
from gates.bundle import bundle_sha256  # noqa: E402
from gates.calibrate import Measurement, derive_entry_from_measurements  # noqa: E402
from gates.compare import ModelStatistics  # noqa: E402
from gates.tolerance import (  # noqa: E402
    DEFAULT_PATH,
    ToleranceEntry,
    ToleranceKey,
    load_tolerances,
    merge_entry,
    write_tolerances,
)
from gates.verdict import hard_bound_failures, kernel_hard_failures  # noqa: E402

RESULTS = ROOT / "bench/results/calibration"
HW, MODEL, MARGIN = "nvidia-hopper", "tiny-llama", 4.0
DTYPES = ("bfloat16", "float32")
IMAGE = ("in-process on the H200 (no Docker there): imagetools/probe.py's transformers path via "
         "bench/calibrate_h200.py, transformers {transformers}, torch {torch}")


def without_hidden(stats: ModelStatistics) -> ModelStatistics:
    """The statistics an engine without hidden states leaves: 1 - cos gone."""
    return ModelStatistics(per_prompt=stats.per_prompt, available=tuple(s for s in stats.available if s != "one_minus_cos"),
                           nonfinite=stats.nonfinite)


def uncalibrated(record: dict) -> str:
    """What a gate with no entry decides: 'hard' when a calibration-free bound breaks, else 'uncalibrated'."""
    hard = analysis.DEFAULT_HARD
    if kernel_hard_failures(results=analysis.to_kernels(record), hard=hard):
        return "hard"
    return "hard" if hard_bound_failures(analysis.to_stats(record), hard) else "uncalibrated"


def decide_runs(records: list[dict], entry: ToleranceEntry, *, size: int, hidden: bool = True) -> list[str]:
    """One gate decision per disjoint block of `size` prompts of every run (size 64 = the whole run, as the gate)."""
    out = []
    for i, r in enumerate(records):
        stats, kernels = analysis.to_stats(r), analysis.to_kernels(r)
        if not hidden:
            stats = without_hidden(stats)
        for idx in analysis.blocks(stats.num_prompts, size, seed=i):
            out.append(analysis.decide(stats=analysis.subset(stats, np.sort(idx)), kernels=kernels, entry=entry))
    return out


def entry_for(dtype: str, calib: list[dict], env: dict) -> ToleranceEntry:
    """The project's calibration of (nvidia-hopper, dtype, tiny-llama) from the calibration split."""
    measured = [Measurement(label=analysis.label(r), stats=analysis.to_stats(r), kernels=analysis.to_kernels(r), env=env)
                for r in calib]
    key = ToleranceKey(hardware_class=HW, dtype=dtype, model=MODEL)
    engines = env.get("engines") or {}
    entry = derive_entry_from_measurements(
        key=key, measurements=measured, margin=MARGIN, date="2026-12-01T03:23:23+00:00",
        reference_sha256=bundle_sha256(ROOT / f"gates/references/{MODEL}/h200-{dtype}"),
        image=IMAGE.format(transformers=engines.get("transformers"), torch=env.get("torch")))
    boots = sorted({r["boot"] for r in calib})
    note = (f"; runs made in-process on one NVIDIA H200 (driver {(env.get('driver') or {}).get('version')}, "
            f"CUDA {env.get('cuda')}) by bench/calibrate_h200.py with the probe's own code, one process per boot "
            f"(boots {', '.join(map(str, boots))}), batch sizes {sorted({r['batch'] for r in calib})}, attention "
            f"{sorted({r['attn'] for r in calib})}; derived by bench/calibrate_h200_derive.py with "
            "gates.calibrate.derive_entry_from_measurements")
    return entry.model_copy(update={"provenance": entry.provenance.model_copy(
        update={"method": entry.provenance.method + note})})


def summary(records: list[dict], entry: ToleranceEntry) -> dict:
    """Decisions at 64 and 8 prompts, with and without hidden states, and with no entry."""
    out: dict = {}
    positive = bool(records) and records[0]["role"] == "swap"
    for size in (64, 8):
        out[f"n{size}"] = analysis.count(decide_runs(records, entry, size=size), positive=positive)
        out[f"n{size}_no_hidden"] = analysis.count(decide_runs(records, entry, size=size, hidden=False),
                                                   positive=positive)
    unc = [uncalibrated(r) for r in records]
    out["uncalibrated"] = {"hard_bound": unc.count("hard"), "uncalibrated": unc.count("uncalibrated"), "runs": len(unc)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="judge only; leave gates/data/tolerances.yaml as it is")
    p.add_argument("--tolerances", type=Path, default=DEFAULT_PATH)
    args = p.parse_args(argv)
    env = json.loads((RESULTS / "h200-calib-env.json").read_text(encoding="utf-8"))
    records = analysis.load_records([RESULTS / "h200-calib-records.jsonl"])
    tolerances = load_tolerances(args.tolerances)
    result: dict = {"source": "bench/results/calibration/h200-calib-records.jsonl", "margin": MARGIN, "keys": {}}
    for dtype in DTYPES:
        mine = [r for r in records if r["dtype"] == dtype and r["model"] == MODEL]
        calib = [r for r in mine if r["split"] == "calibration"]
        held = [r for r in mine if r["split"] == "heldout"]
        swapped = [r for r in mine if r["split"] == "swap"]
        entry = entry_for(dtype, calib, env)
        tolerances = merge_entry(tolerances, entry)
        swaps = {}
        for name in dict.fromkeys(r["swap"] for r in swapped):
            runs = [r for r in swapped if r["swap"] == name]
            swaps[name] = {**summary(runs, entry), "margin": analysis.margins(runs, entry)}
        result["keys"][entry.key.label()] = {
            "runs": {"calibration": len(calib), "heldout": len(held), "swap": len(swapped)},
            "thresholds": {"per_prompt": entry.model.per_prompt, "mean": entry.model.mean,
                           "honest_rate": entry.model.honest_rate},
            "honest_max": {k: v for k, v in entry.provenance.honest_max.items() if not k.startswith("kernels.")},
            "heldout": {**summary(held, entry), "per_prompt_exceed": analysis.per_prompt_exceed(held, entry),
                        "max_over_threshold": analysis.honest_max_ratio(held, entry)},
            "swaps": swaps,
        }
    if not args.dry_run:
        write_tolerances(tolerances, args.tolerances)
    (RESULTS / "h200-calibration.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for key, r in result["keys"].items():
        h = r["heldout"]
        print(f"{key}: {r['runs']}; held-out honest rejected {h['n64']['rejected']}/{h['n64']['total']} at 64 prompts, "
              f"{h['n8']['rejected']}/{h['n8']['total']} at 8 (CI {h['n8']['ci95']}); max/threshold {h['max_over_threshold']}")
        for name, s in r["swaps"].items():
            print(f"  {name:13s} caught {s['n64']['caught']}/{s['n64']['total']} (64), {s['n8']['caught']}/{s['n8']['total']} "
                  f"(8), no hidden {s['n8_no_hidden']['caught']}/{s['n8_no_hidden']['total']} (8); uncalibrated: "
                  f"{s['uncalibrated']['hard_bound']}/{s['uncalibrated']['runs']} by hard bounds; by {s['n8']['by']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
