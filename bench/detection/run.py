"""Regenerate the detection-power results: CPU runs (unless present), then calibration, held-out decisions, JSON and plots.

    PYTHONPATH=$PWD python bench/detection/run.py            # CPU runs if missing + analysis
    PYTHONPATH=$PWD python bench/detection/run.py --analyse  # analysis of the committed records only

The H200 records (bench/results/detection/h200-records.jsonl) come from bench/detection/h200_job.py
run on the reference machine (see bench/detection/README.md). Writes bench/results/detection.json,
bench/results/detection/table.md and docs/detection-roc-<class>.png.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.detection import analysis as A  # noqa: E402
from bench.detection.swaps import DESCRIPTIONS, SWAPS  # noqa: E402
from skupin.gates.judge.compare import DECISION_STATS  # noqa: E402
from skupin.gates.judge.tolerance import ToleranceKey  # noqa: E402

RESULTS = ROOT / "bench/results"
RAW = RESULTS / "detection"
SIZES = (1, 8, 16, 64)
HEADLINE = 8
TARGETS = {"int4": 0.999, "int8": 0.99, "fp8-channel": 0.99, "int8-quarter": 0.95,
           "int4-nibble": 1.0, "silu": 1.0, "softmax": 1.0, "honest_rejects": 0.001}
ANCHOR = {"name": "Gonka PoC v2", "honest_rejects": 0.02, "int4_caught_per_sample": 0.77,
          "int4_caught_10plus_samples": "about 1.0"}


def run_cpu() -> None:
    subprocess.run([sys.executable, str(ROOT / "bench/detection/cpu_job.py"), "--out", str(RAW)], check=True,
                   env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                        "PATH": "/usr/bin:/bin"})


def analyse_key(records: list[dict], hw: str, model: str, dtype: str) -> tuple[dict, dict]:
    """(JSON section of one class/model/dtype key, raw outcome lists for the class totals)."""
    calib, held, swapped = A.split(records)
    key = ToleranceKey(hardware_class=hw, dtype=dtype, model=model)
    entry = A.calibrate(records=calib, key=key, date=_dt.date.today().isoformat())
    out: dict = {
        "calibration_runs": [A.label(r) for r in calib], "held_out_honest_runs": [A.label(r) for r in held],
        "thresholds": {"per_prompt": entry.model.per_prompt, "mean": entry.model.mean,
                       "honest_rate": entry.model.honest_rate, "alpha": entry.model.alpha,
                       "honest_max_calibration": entry.provenance.honest_max},
        "honest_held_out_max_over_threshold": A.honest_max_ratio(held, entry),
        "decisions": {}, "per_prompt": {"honest": A.per_prompt_exceed(held, entry)}, "margins": {},
    }
    raw: dict = {}
    for n in SIZES:
        honest = A.decisions(records=held, entry=entry, size=n)
        section = {"honest": A.count(honest, positive=False), "swaps": {}}
        raw.setdefault(n, {})["honest"] = honest
        for swap in SWAPS:
            runs = [r for r in swapped if r["swap"] == swap]
            if runs:
                outcomes = A.decisions(records=runs, entry=entry, size=n)
                raw[n][swap] = outcomes
                section["swaps"][swap] = A.count(outcomes, positive=True)
        out["decisions"][str(n)] = section
    for swap in SWAPS:
        runs = [r for r in swapped if r["swap"] == swap]
        if runs:
            out["per_prompt"][swap] = A.per_prompt_exceed(runs, entry)
            out["margins"][swap] = A.margins(runs, entry)
    out["kernel_worst_over_tolerance"] = {
        name: _kernel_worst(group, entry) for name, group in
        [("honest", held)] + [(sw, [r for r in swapped if r["swap"] == sw]) for sw in SWAPS] if group}
    # where the held-out honest noise comes from: max / threshold per variation
    out["honest_by_variation"] = {A.label(r): A.honest_max_ratio([r], entry) for r in held}
    out["_entry"] = entry
    return out, raw


def _kernel_worst(records: list[dict], entry) -> dict:
    """The kernel op with the largest error / tolerance over these runs (min over runs of each run's worst)."""
    worst = []
    for r in records:
        ratios = {op: v / entry.kernels[op] for op, v in r["kernels"].items() if v is not None and entry.kernels.get(op)}
        op = max(ratios, key=ratios.get)
        worst.append((ratios[op], op))
    lo, hi = min(worst), max(worst)
    return {"min_over_runs": A._sig(lo[0]), "op_at_min": lo[1], "max_over_runs": A._sig(hi[0]), "op_at_max": hi[1]}


def plot(hw: str, keys: dict, path: Path) -> None:
    """ROC-style: per statistic and dtype, the fraction of held-out honest and swapped prompts (or 8-prompt means)
    above t x the calibrated threshold; at t = 1 the honest curve is the false-reject rate, a swap's the catch rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("bfloat16", 1), ("bfloat16", 8), ("float32", 1)]
    fig, axes = plt.subplots(len(rows), len(DECISION_STATS), figsize=(4.2 * len(DECISION_STATS), 11), squeeze=False)
    grid = np.logspace(-3, 12, 600)
    colors = dict(zip(SWAPS, plt.cm.tab10(np.linspace(0, 1, 10)), strict=False))
    for col, stat in enumerate(DECISION_STATS):
        for row, (dtype, n) in enumerate(rows):
            kind = f"{dtype}, " + ("per prompt" if n == 1 else f"mean of {n} prompts")
            groups: dict[str, list[float]] = {}
            for name, (section, recs) in keys.items():
                entry = section["_entry"]
                if stat not in entry.model.per_prompt or not name.endswith(dtype):
                    continue
                thr = entry.model.per_prompt[stat] if n == 1 else entry.model.mean[stat]
                _, held, swapped = A.split(recs)
                for r in held + swapped:
                    if stat not in r["available"]:
                        continue
                    v = A.to_stats(r).per_prompt[stat]
                    if n > 1:
                        v = np.array([v[idx].mean() for idx in A.blocks(len(v), n, seed=0)])
                    groups.setdefault(r["swap"] or "honest", []).extend((v / thr).tolist())
            ax = axes[row][col]
            for g, vals in groups.items():
                vals = np.asarray(vals)
                frac = [(vals > t).mean() for t in grid]
                ax.plot(grid, frac, label=f"{g} ({len(vals)})", color="black" if g == "honest" else colors.get(g),
                        lw=2.2 if g == "honest" else 1.2, ls="--" if g == "honest" else "-")
            ax.axvline(1.0, color="red", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"{stat}, {kind}", fontsize=9)
            ax.set_xlabel("t (x calibrated threshold)", fontsize=8)
            if col == 0:
                ax.set_ylabel("fraction above t (honest = false reject, swap = caught)", fontsize=8)
            if col == 0:
                ax.legend(fontsize=6, loc="lower left")
    fig.suptitle(f"{hw}: held-out honest vs swaps ({', '.join(keys)}); red line = calibrated threshold", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fmt_rate(c: dict, positive: bool) -> str:
    k = c["caught" if positive else "rejected"]
    lo, hi = c["ci95"]
    return f"{k}/{c['total']} = {100 * c['rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def decision_totals(raws: dict, n: int) -> dict:
    """Honest rejects and per-swap catches over every key of a class, for decisions over `n` prompts."""
    honest = [o for raw in raws.values() for o in raw[n]["honest"]]
    tot: dict = {"honest": A.count(honest, positive=False), "swaps": {}}
    for swap in SWAPS:
        outs = [o for raw in raws.values() for o in raw[n].get(swap, [])]
        if outs:
            c = A.count(outs, positive=True)
            if swap in TARGETS:
                c["target"] = TARGETS[swap]
                c["meets_point"] = c["rate"] >= TARGETS[swap]
                c["meets_ci"] = c["ci95"][0] >= TARGETS[swap]
            tot["swaps"][swap] = c
    return tot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--analyse", action="store_true", help="only analyse the committed records")
    args = p.parse_args(argv)
    if not args.analyse and not (RAW / "cpu-records.jsonl").is_file():
        run_cpu()
    records = A.load_records(sorted(RAW.glob("*-records.jsonl")))
    by_key: dict = {}
    for r in records:
        by_key.setdefault(A.key_of(r), []).append(r)
    result: dict = {"format": "skupin-detection/1", "created": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
                    "method": A.__doc__.strip(), "headline_prompts_per_decision": HEADLINE, "targets": TARGETS,
                    "anchor": ANCHOR, "swaps": {s: DESCRIPTIONS[s] for s in SWAPS}, "classes": {}}
    lines = []
    for hw in sorted({k[0] for k in by_key}):
        keys, raws = {}, {}
        for (h, model, dtype), recs in sorted(by_key.items()):
            if h == hw:
                section, raw = analyse_key(recs, hw, model, dtype)
                keys[f"{model}/{dtype}"] = (section, recs)
                raws[f"{model}/{dtype}"] = raw
        cls: dict = {"keys": {}}
        for n in SIZES:
            cls[f"decisions_{n}"] = decision_totals(raws, n)
        cls["honest"] = cls[f"decisions_{HEADLINE}"]["honest"]
        cls["swaps"] = cls[f"decisions_{HEADLINE}"]["swaps"]
        for name, (section, _) in keys.items():
            cls["keys"][name] = {k: v for k, v in section.items() if k != "_entry"}
        result["classes"][hw] = cls
        plot(hw, keys, ROOT / f"docs/detection-roc-{hw}.png")
        lines.append(f"\n### {hw} ({', '.join(keys)})\n")
        lines.append("| decision over | honest rejected | " + " | ".join(SWAPS) + " |")
        lines.append("|---|---|" + "---|" * len(SWAPS))
        for n in SIZES:
            d = cls[f"decisions_{n}"]
            cells = [fmt_rate(d["swaps"][s], True) if s in d["swaps"] else "-" for s in SWAPS]
            lines.append(f"| {n} prompt{'s' if n > 1 else ''} | {fmt_rate(d['honest'], False)} | " + " | ".join(cells) + " |")
        lines.append("\nMargin min(swap)/threshold per key (per prompt; mean of 8 prompts), best statistic:\n")
        lines.append("| key | " + " | ".join(SWAPS) + " | honest held-out max/threshold (worst stat) |")
        lines.append("|---|" + "---|" * (len(SWAPS) + 1))
        for name, (section, _) in keys.items():
            cells = []
            for s in SWAPS:
                m = section["margins"].get(s)
                if not m:
                    cells.append("-")
                    continue
                best = max(m, key=lambda st: m[st]["per_prompt"])
                cells.append(f"{m[best]['per_prompt']:.3g}; {m[best]['mean_of_8']:.3g} ({best})")
            worst = section["honest_held_out_max_over_threshold"]
            w = max(worst, key=worst.get) if worst else None
            cells.append(f"{worst[w]:.3g} ({w})" if w else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "detection.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    (RAW / "table.md").write_text("\n".join(lines).lstrip() + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
