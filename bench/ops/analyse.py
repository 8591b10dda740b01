#!/usr/bin/env python3
"""Judge the op battery bench (bench/ops/job.py output) with the gate's own code (gates/judge/ops.py).

    PYTHONPATH=$PWD .venv/bin/python bench/ops/analyse.py \\
        --class nvidia-hopper=RUNS/h200-boot1,RUNS/h200-boot2 --class cpu-x86_64=RUNS/cpu --json bench/results/ops.json

Per hardware class: the honest runs at the gate's attention (sdpa, every boot) are the calibration
(gates.judge.ops.derive_bounds, what `skupin calibrate` runs); then every variant of every boot is judged twice,
by the hard bounds alone (what an uncalibrated class gets) and with the calibrated bounds. A fault counts as caught
when its op fails at the dtype the fault lives in (the serving dtype for a bf16-path fault, float32 for TF32); the
float32 pass is not used. Writes the honest errors (what bench/calibrate_h200_derive.py derives the committed
nvidia-hopper op bounds from), the bounds and every decision as JSON, and prints the tables of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from skupin.gates.judge.ops import (  # noqa: E402
    Battery,
    OpResult,
    derive_bounds,
    hard_bounds,
    judge_battery,
    reduced_precision,
)
from skupin.gates.refdata.probe_output import read_output_folder  # noqa: E402

CALIBRATION = "honest.sdpa."  # the gate probes with sdpa attention


def load(folders: list[Path]) -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """boot/variant -> (its ops report, tensors, variant metadata) over every runs folder of one class."""
    out = {}
    for runs in folders:
        for folder in sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith("_")):
            report, tensors = read_output_folder(folder)
            out[f"{runs.name}/{folder.name}"] = (report["checks"]["ops"], tensors, report.get("variant") or {})
    return out


def battery_from(errors: dict[str, dict[str, float]]) -> Battery:
    """A Battery rebuilt from recorded errors (op.dtype -> measure -> units), as derive_bounds takes it."""
    rows = []
    for key, e in sorted(errors.items()):
        op, _, dtype = key.rpartition(".")
        rows.append(OpResult(op=op, dtype=dtype, errors=dict(e), nmse=None, hard=hard_bounds(op, dtype)))
    return Battery(results=tuple(rows))


def analyse(name: str, folders: list[Path]) -> dict[str, Any]:
    runs = load(folders)
    env = json.loads((folders[0] / "env.json").read_text(encoding="utf-8"))
    plain = {k: judge_battery(t, r) for k, (r, t, _) in runs.items()}
    honest = {k: {r.key: r.errors for r in b.results} for k, b in plain.items() if k.split("/")[1].startswith("honest.")}
    bounds = derive_bounds([plain[k] for k in honest if k.split("/")[1].startswith(CALIBRATION)])
    variants: dict[str, Any] = {}
    for key, (report, tensors, meta) in runs.items():
        cal = judge_battery(tensors, report, calibrated=bounds)
        served = next((r.dtype for r in cal.results if r.dtype != "float32"), "float32")
        row: dict[str, Any] = {"kind": meta.get("kind"), "attn": meta.get("attn")}
        if meta.get("kind") == "fault":
            at = f"{meta['op']}.{'float32' if meta.get('class') == 'reduced float32 precision' else served}"
            hard = next(r for r in plain[key].results if r.key == at)
            calibrated = next(r for r in cal.results if r.key == at)
            row.update({"class": meta["class"], "judged_at": at, "hard": hard.failed, "calibrated": calibrated.failed,
                        "ratio": round(calibrated.ratio, 3), "decided_by": calibrated.worst(),
                        "named": reduced_precision(calibrated)})
        else:
            row.update({"hard_failures": [r.key for r in plain[key].failures()],
                        "calibrated_failures": [r.key for r in cal.failures()],
                        "worst_hard": round(max(r.hard_ratio for r in plain[key].results), 3),
                        "named": sorted({reduced_precision(r) for r in cal.failures()} - {""})})
        variants[key] = row
    return {"device": (env.get("device") or {}).get("name") or env.get("cpu_model"), "torch": env.get("torch"),
            "transformers": (env.get("engines") or {}).get("transformers"), "calibration": CALIBRATION + "*",
            "bounds": bounds, "honest_errors": honest, "variants": variants}


def table(name: str, result: dict[str, Any]) -> str:
    lines = [f"### {name}: {result['device']} (torch {result['torch']}, transformers {result['transformers']})", "",
             "| variant | class | judged at | hard bounds | calibrated | ratio | decided by |", "|---|---|---|---|---|---|---|"]
    faults = {k.split("/", 1)[1]: v for k, v in result["variants"].items() if v["kind"] == "fault"}
    for variant, v in sorted(faults.items()):
        lines.append(f"| {variant.removeprefix('fault.')} | {v['class']} | {v['judged_at']} | "
                     f"{'caught' if v['hard'] else 'passes'} | {'caught' if v['calibrated'] else 'MISSED'} | "
                     f"{v['ratio']} | {v['decided_by']}{'; named: TF32' if v['named'] else ''} |")
    lines += ["", "| honest variant | hard bounds (worst ratio) | calibrated bounds |", "|---|---|---|"]
    for variant, v in sorted(result["variants"].items()):
        if v["kind"] == "fault":
            continue
        cal = "pass" if not v["calibrated_failures"] else "fails " + ", ".join(v["calibrated_failures"][:4])
        hard = "pass" if not v["hard_failures"] else "fails " + ", ".join(v["hard_failures"][:4])
        lines.append(f"| {variant} ({v['kind']}) | {hard} ({v['worst_hard']}) | {cal}"
                     f"{'; named: TF32' if v['named'] else ''} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--class", dest="classes", action="append", required=True, metavar="CLASS=RUNS[,RUNS...]")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = {}
    for spec in args.classes:
        name, _, folders = spec.partition("=")
        results[name] = analyse(name, [Path(f) for f in folders.split(",")])
    for name, result in results.items():
        print(table(name, result), end="\n\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
