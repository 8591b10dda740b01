"""Derive the `nvidia-hopper` tolerance entries from the H200 records and judge the held-out runs with the gate's code.

    PYTHONPATH=$PWD .venv/bin/python bench/calibrate_h200_derive.py            # derive, merge, judge, write results
    PYTHONPATH=$PWD .venv/bin/python bench/calibrate_h200_derive.py --dry-run  # judge only; tolerances.yaml untouched

Input: bench/results/calibration/h200-calib-records.jsonl.gz and h200-calib-env.json, brought back by
bench/calibrate_h200.py from the H200. Per dtype (bfloat16, float32):

1. calibration: the "calibration" split (boots 1 and 2 x batch 1/2/4/8/16/64 x sdpa/eager) ->
   `skupin.calibration.calibrate.derive_entry_from_measurements` (the code `skupin calibrate` runs after its
   containers: margin 4, dtype floors, Clopper-Pearson honest rate), against the committed bundle's
   sha256, merged with `gates.judge.tolerance.merge_entry` (other classes' entries untouched) and written;
2. judgement: every "heldout" run (boots 3 and 4, batch 1/2/3/4/7/8/16/32/64 x sdpa/eager) and every
   "swap" run decided with the gate's own rules (`gates.judge.verdict.kernel_hard_failures`,
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
from bench.modules.derive import entry_with_module_bounds  # noqa: E402
from bench.modules.derive import load as load_module_records  # noqa: E402
from skupin.calibration.calibrate import Measurement, derive_entry_from_measurements  # noqa: E402
from skupin.gates.judge.compare import ModelStatistics  # noqa: E402
from skupin.gates.judge.ops import spec_sha256  # noqa: E402
from skupin.gates.judge.tolerance import (  # noqa: E402
    DEFAULT_PATH,
    ToleranceEntry,
    ToleranceKey,
    load_tolerances,
    merge_entry,
    write_tolerances,
)
from skupin.gates.judge.verdict import clopper_pearson_upper, hard_bound_failures, kernel_hard_failures  # noqa: E402
from skupin.gates.refdata.bundle import bundle_sha256  # noqa: E402

RESULTS = ROOT / "bench/results/calibration"
HW, MARGIN = "nvidia-hopper", 4.0
ENGINE = "transformers"  # the engine of the in-process runs: the entries hold for it alone (ToleranceKey.engine)
MODELS = ("tiny-llama", "tiny-moe", "deep-llama", "llama-1k", "peaked-moe")
# bundles in gates/references: their entries are merged into tolerances.yaml
COMMITTED = ("tiny-llama", "tiny-moe", "deep-llama", "peaked-moe")
DTYPES = ("bfloat16", "float32")
DATE = {"tiny-llama": "2026-12-01T03:23:23+00:00", "tiny-moe": "2026-12-01T06:57:22+00:00",
        "deep-llama": "2026-12-01T06:57:22+00:00", "llama-1k": "2026-12-01T06:24:29+00:00",
        "peaked-moe": "2026-12-02T05:50:06+00:00"}
# The provenance text of the committed entries (captured before the probe moved under skupin/): kept as recorded.
IMAGE = ("in-process on the H200 (no Docker there): imagetools/probe.py's transformers path via "
         "bench/calibrate_h200.py, transformers {transformers}, torch {torch}")
# Swap classes of the acceptance list (issue 18) -> the swaps of bench/detection/swaps.py in each, and the rate the
# class must reach.
CLASSES = {
    "INT4": (("int4", "int4-mlp", "int4-nibble"), 0.999),
    "INT8 and FP8": (("int8", "fp8-tensor", "fp8-channel"), 0.99),
    "partial INT8": (("int8-last", "int8-quarter"), 0.95),
    "kernel 1%": (("attn-scale", "accum-bf16", "silu", "softmax"), 1.0),
    "model change": (("rope-base",), 1.0),
    "MoE": (("moe-expert-scale", "moe-top1"), 1.0),
    "padding": (("pad-attended",), 1.0),  # runs at batch 1 left out: nothing pads, the fault changes nothing
}
# Fault classes of issue 29, judged by the bfloat16 check alone (no float32 pass): faults in the precision of the bf16
# code path (a float32 run is unchanged by them), routing faults, one badly quantized expert.
BF16_CLASSES = {
    "bf16 path": ("rope-table-bf16", "norm-no-upcast", "accum-bf16"),
    "routing": ("moe-no-renorm", "router-no-upcast", "moe-top1"),
    "one expert": ("expert-int4-one", "moe-expert-scale"),
}
HONEST_SETS = RESULTS / "h200-honest-sets.jsonl.gz"


def without_hidden(stats: ModelStatistics) -> ModelStatistics:
    """The statistics an engine without hidden states leaves: 1 - cos gone."""
    return ModelStatistics(per_prompt=stats.per_prompt, available=tuple(s for s in stats.available if s != "one_minus_cos"),
                           nonfinite=stats.nonfinite)


def uncalibrated(record: dict) -> str:
    """What a gate with no entry decides: 'hard' when a calibration-free bound breaks, else 'uncalibrated'."""
    hard = analysis.DEFAULT_HARD
    if kernel_hard_failures(results=analysis.to_kernels(record), hard=hard):
        return "hard"
    return "hard" if hard_bound_failures(analysis.to_stats(record), hard, dtype=record["dtype"]) else "uncalibrated"


def block_decisions(record: dict, entry: ToleranceEntry, *, size: int, seed: int, hidden: bool = True) -> list[str]:
    """One gate decision per disjoint block of `size` prompts of one run (size 64 = the whole run, as the gate)."""
    stats, kernels = analysis.to_stats(record), analysis.to_kernels(record)
    if not hidden:
        stats = without_hidden(stats)
    return [analysis.decide(stats=analysis.subset(stats, np.sort(idx)), kernels=kernels, entry=entry)
            for idx in analysis.blocks(stats.num_prompts, size, seed=seed)]


def decide_runs(records: list[dict], entry: ToleranceEntry, *, size: int, hidden: bool = True) -> list[str]:
    """Every run's block decisions, run i's blocks drawn with seed i."""
    return [d for i, r in enumerate(records) for d in block_decisions(r, entry, size=size, seed=i, hidden=hidden)]


def entry_for(model: str, dtype: str, calib: list[dict], env: dict) -> ToleranceEntry:
    """The project's calibration of (nvidia-hopper, dtype, model) from the calibration split."""
    engines = env.get("engines") or {}
    # every run used the H200's transformers: the entry's provenance.engines (it holds for that release alone)
    measured = [Measurement(label=analysis.label(r), stats=analysis.to_stats(r), kernels=analysis.to_kernels(r), env=env,
                            engine=ENGINE, engine_version=str(engines.get(ENGINE))) for r in calib]
    key = ToleranceKey(hardware_class=HW, dtype=dtype, model=model, engine=ENGINE)
    sha = bundle_sha256(ROOT / f"gates/references/{model}/h200-{dtype}") if model in COMMITTED else "0" * 64
    entry = derive_entry_from_measurements(
        key=key, measurements=measured, margin=MARGIN, date=DATE[model], reference_sha256=sha,
        image=IMAGE.format(transformers=engines.get("transformers"), torch=env.get("torch")))
    boots = sorted({r["boot"] for r in calib})
    note = (f"; runs made in-process on one NVIDIA H200 (driver {(env.get('driver') or {}).get('version')}, "
            f"CUDA {env.get('cuda')}) by bench/calibrate_h200.py with the probe's own code, one process per boot "
            f"(boots {', '.join(map(str, boots))}), batch sizes {sorted({r['batch'] for r in calib})}, attention "
            f"{sorted({r['attn'] for r in calib})}; derived by bench/calibrate_h200_derive.py with "
            "gates.calibrate.derive_entry_from_measurements")
    provenance = entry.provenance.model_copy(update={"method": entry.provenance.method + note + OPS_NOTE})
    entry = entry.model_copy(update={"ops": op_bounds(dtype), "ops_spec": spec_sha256(), "provenance": provenance})
    return entry_with_module_bounds(entry, load_module_records().get(HW, []))  # from their own H200 records


OPS = ROOT / "bench/results/ops.json"
OPS_NOTE = ("; engine op bounds: bench/ops/job.py on the same H200 (honest sdpa runs, two processes), derived by "
            "gates.judge.ops.derive_bounds from bench/results/ops.json")


def op_bounds(dtype: str) -> dict[str, dict[str, float]]:
    """The nvidia-hopper op bounds of bench/results/ops.json (the op battery bench's H200 calibration), re-derived
    from its honest errors with gates.judge.ops.derive_bounds: every op key for a bf16 entry (its SKU's battery runs
    at bf16 and float32), the float32 keys for a float32 entry."""
    from bench.ops.analyse import CALIBRATION, battery_from
    from skupin.gates.judge.ops import derive_bounds

    hopper = json.loads(OPS.read_text(encoding="utf-8"))[HW]
    honest = [battery_from(errors) for key, errors in sorted(hopper["honest_errors"].items())
              if key.split("/")[1].startswith(CALIBRATION)]
    bounds = derive_bounds(honest)
    return {k: v for k, v in bounds.items() if dtype != "float32" or k.endswith(".float32")}


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


def pair_key(record: dict) -> tuple:
    return record["model"], record["split"], record["swap"], record["boot"], record["batch"], record["attn"]


def numerics(record: dict) -> str:
    """A run's measured numbers (statistics and kernel errors), to tell runs that computed something else apart from
    repeats: on the H200 the same (batch, attention) gives the same bits in every boot."""
    return json.dumps([record["model"], record["swap"], record["stats"], record["kernels"]], sort_keys=True)


def gate_decisions(records: list[dict], entries: dict[tuple[str, str], ToleranceEntry], *, size: int,
                   hidden: bool = True, float32_calibrated: bool = True) -> dict[str, list[str]]:
    """The whole gate of a bf16 SKU on paired runs: the serving-dtype (bfloat16) check, then the float32 pass on the
    same variation, block by block; a block fails when either fails. Keyed by swap ('' = honest held-out).

    Only distinct pairs count: a held-out pair whose numbers (both dtypes) equal a calibration run's or an earlier
    pair's is a repeat, not another decision (bit-identical repeats would inflate the count without adding evidence)."""
    fp32 = {pair_key(r): r for r in records if r["dtype"] == "float32"}
    seen = {numerics(r) + numerics(fp32[pair_key(r)]) for r in records
            if r["split"] == "calibration" and r["dtype"] == "bfloat16" and pair_key(r) in fp32}
    out: dict[str, list[str]] = {}
    for i, r in enumerate(r for r in records if r["dtype"] == "bfloat16" and r["split"] != "calibration"):
        twin = fp32.get(pair_key(r))
        if twin is None or numerics(r) + numerics(twin) in seen or (r["swap"] == "pad-attended" and r["batch"] == 1):
            continue
        seen.add(numerics(r) + numerics(twin))
        bf = block_decisions(r, entries[(r["model"], "bfloat16")], size=size, seed=i, hidden=hidden)
        if float32_calibrated:
            f32 = block_decisions(twin, entries[(r["model"], "float32")], size=size, seed=i, hidden=hidden)
        else:
            f32 = ["pass" if uncalibrated(twin) == "uncalibrated" else "hard"] * len(bf)
        out.setdefault(r["swap"] or "", []).extend(b if b != "pass" else (f if f == "pass" else f"float32 {f}")
                                                   for b, f in zip(bf, f32, strict=True))
    return out


def class_table(records: list[dict], entries: dict[tuple[str, str], ToleranceEntry]) -> dict:
    """Per class of the acceptance list: the whole gate's catch rate (bf16 check + float32 pass), and the same gate with
    no float32 calibration (its hard bounds only), at 64 and 8 prompts, with and without hidden states; honest
    held-out rejects of the whole gate."""
    out: dict = {"honest": {}}
    for size in (64, 8):
        for hidden in (True, False):
            tag = f"n{size}" + ("" if hidden else "_no_hidden")
            full = gate_decisions(records, entries, size=size, hidden=hidden)
            free = gate_decisions(records, entries, size=size, hidden=hidden, float32_calibrated=False)
            out["honest"][tag] = analysis.count(full.get("", []), positive=False)
            out["honest"][tag + "_float32_uncalibrated"] = analysis.count(free.get("", []), positive=False)
            for name, (members, target) in CLASSES.items():
                row = out.setdefault(name, {"swaps": list(members), "target": target})
                row[tag] = analysis.count([d for m in members for d in full.get(m, [])], positive=True)
                row[tag + "_float32_uncalibrated"] = analysis.count([d for m in members for d in free.get(m, [])],
                                                                    positive=True)
    for name, (members, _) in CLASSES.items():
        fp32 = [r for r in records if r["dtype"] == "float32" and r["swap"] in members]
        out[name]["float32_runs_caught_by_hard_bounds"] = {"caught": sum(uncalibrated(r) == "hard" for r in fp32),
                                                           "runs": len(fp32)}
    return out


def bf16_alone(records: list[dict], entries: dict[tuple[str, str], ToleranceEntry], *, size: int) -> dict:
    """Per swap: what the bfloat16 check alone catches (no float32 pass), with and without hidden states."""
    out = {}
    bf = [r for r in records if r["dtype"] == "bfloat16" and r["role"] == "swap"]
    for name in dict.fromkeys(r["swap"] for r in bf):
        mine = [r for r in bf if r["swap"] == name]
        got = [d for i, r in enumerate(mine) for d in block_decisions(r, entries[(r["model"], "bfloat16")], size=size,
                                                                        seed=i)]
        nohid = [d for i, r in enumerate(mine) for d in block_decisions(r, entries[(r["model"], "bfloat16")],
                                                                          size=size, seed=i, hidden=False)]
        out[name] = {"with_hidden": analysis.count(got, positive=True),
                     "no_hidden": analysis.count(nohid, positive=True)}
    return out


def bf16_classes(records: list[dict], entries: dict[tuple[str, str], ToleranceEntry]) -> dict:
    """Per fixture and fault class of issue 29: what the bfloat16 model check alone catches at the gate's 64 prompts
    (and in 8-prompt blocks), with and without hidden states -- no float32 pass."""
    out: dict = {}
    for model in dict.fromkeys(r["model"] for r in records):
        if (model, "bfloat16") not in entries:
            continue
        for name, members in BF16_CLASSES.items():
            mine = [r for r in records if r["model"] == model and r["dtype"] == "bfloat16" and r["swap"] in members]
            if not mine:
                continue
            row = out.setdefault(model, {}).setdefault(name, {"swaps": sorted({r["swap"] for r in mine})})
            for size in (64, 8):
                for hidden in (True, False):
                    tag = f"n{size}" + ("" if hidden else "_no_hidden")
                    row[tag] = analysis.count(decide_runs(mine, entries[(model, "bfloat16")], size=size,
                                                          hidden=hidden), positive=True)
            row["per_swap_n64"] = {m: analysis.count(decide_runs([r for r in mine if r["swap"] == m],
                                                                 entries[(model, "bfloat16")], size=64), positive=True)
                                   for m in row["swaps"]}
    return out


def kernel_calibrated(records: list[dict], env: dict, honest_set_records: list[dict]) -> dict:
    """What the bfloat16 check alone decides when its entry is calibrated on one attention kernel (sdpa, what the
    transformers probe runs) instead of sdpa and eager (the stand-in for every engine's own kernels): held-out honest
    runs and fresh prompt sets of that kernel, the other kernel's honest runs, and every swap run at that kernel; at
    the gate's 64 prompts. Not committed as entries (docs/BENCHMARKS.md says why)."""
    out: dict = {}
    for model in ("tiny-llama", "tiny-moe", "peaked-moe"):
        mine = [r for r in records if r["model"] == model and r["dtype"] == "bfloat16"]
        calib = [r for r in mine if r["split"] == "calibration" and r["attn"] == "sdpa"]
        entry = entry_for(model, "bfloat16", calib, env)
        row: dict = {}
        for attn in ("sdpa", "eager"):
            held = [r for r in mine if r["split"] == "heldout" and r["attn"] == attn]
            row[f"heldout_{attn}"] = analysis.count(decide_runs(held, entry, size=64), positive=False)
        sets = distinct([r for r in honest_set_records if r["model"] == model and r["attn"] == "sdpa"])
        if sets:
            row["prompt_sets_sdpa"] = analysis.count(decide_runs(sets, entry, size=64), positive=False)
        swapped = [r for r in mine if r["split"] == "swap" and r["attn"] == "sdpa"]
        row["swaps_sdpa"] = {name: analysis.count(decide_runs([r for r in swapped if r["swap"] == name], entry,
                                                             size=64), positive=True)
                             for name in dict.fromkeys(r["swap"] for r in swapped)}
        out[model] = row
    return out


def distinct(records: list[dict]) -> list[dict]:
    """The records whose numbers no earlier record had (a repeat is no further evidence)."""
    seen: set[str] = set()
    out = []
    for r in records:
        key = numerics(r)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def honest_sets(path: Path, entries: dict[tuple[str, str], ToleranceEntry]) -> dict:
    """The gate's decisions on honest bf16 runs over fresh prompt sets (bench/h200/honest_sets.py), at its 64 prompts,
    each judged with the committed entry of its fixture: distinct decisions only (runs whose numbers repeat another
    run's are one decision), with the one-sided 95% upper bound on the honest-reject rate."""
    if not path.is_file():
        return {}
    out: dict = {}
    by_model: dict[str, list[dict]] = {}
    for r in analysis.load_records([path]):
        by_model.setdefault(r["model"], []).append(r)
    for model, mine in by_model.items():
        decided = decide_runs(distinct(mine), entries[(model, "bfloat16")], size=64)
        counted = analysis.count(decided, positive=False)
        upper = clopper_pearson_upper(0, len(decided)) if decided and counted["rejected"] == 0 else None
        out[model] = {"runs": len(mine), "prompt_sets": len({r["set"] for r in mine}), "distinct": len(decided),
                      **counted, "upper95_one_sided": upper,
                      "variations": sorted({f"batch {r['batch']} {r['attn']}" for r in mine})}
    return out


def report(result: dict) -> None:
    """The derivation's results, a line per key, swap and class, on stdout."""
    for key, r in result["keys"].items():
        h = r["heldout"]
        print(f"{key}: {r['runs']}; held-out honest rejected {h['n64']['rejected']}/{h['n64']['total']} at 64 prompts, "
              f"{h['n8']['rejected']}/{h['n8']['total']} at 8 (CI {h['n8']['ci95']}); max/threshold {h['max_over_threshold']}")
        for name, s in r["swaps"].items():
            print(f"  {name:16s} caught {s['n64']['caught']}/{s['n64']['total']} (64), {s['n8']['caught']}/"
                  f"{s['n8']['total']} (8), no hidden {s['n8_no_hidden']['caught']}/{s['n8_no_hidden']['total']} (8); "
                  f"uncalibrated: {s['uncalibrated']['hard_bound']}/{s['uncalibrated']['runs']} by hard bounds")
    for model, rows in result["bf16_classes"].items():
        for name, row in rows.items():
            print(f"bf16 check alone, {model}, {name}: " + "; ".join(
                f"{tag}: {row[tag]['caught']}/{row[tag]['total']}" for tag in ("n64", "n64_no_hidden", "n8", "n8_no_hidden")))
    for model, h in result["honest_prompt_sets"].items():
        print(f"honest prompt sets, {model}: {h['rejected']}/{h['total']} distinct 64-prompt decisions rejected "
              f"({h['prompt_sets']} sets); one-sided 95% upper bound {h['upper95_one_sided']}")
    for model, row in result["sdpa_calibrated"].items():
        caught = {n: f"{c['caught']}/{c['total']}" for n, c in row["swaps_sdpa"].items()}
        print(f"sdpa-calibrated bf16 check, {model}: held-out sdpa {row['heldout_sdpa']['rejected']}/"
              f"{row['heldout_sdpa']['total']}, eager {row['heldout_eager']['rejected']}/{row['heldout_eager']['total']} "
              f"rejected; swaps {caught}")
    print("whole gate (bf16 check + float32 pass):")
    for name, row in result["gate"]["classes"].items():
        print(f"  {name:14s} " + "; ".join(f"{tag}: {v.get('caught', v.get('rejected'))}/{v.get('total', v.get('runs'))}"
                                           for tag, v in row.items() if isinstance(v, dict) and "ci95" in v))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="judge only; leave gates/data/tolerances.yaml as it is")
    p.add_argument("--tolerances", type=Path, default=DEFAULT_PATH)
    args = p.parse_args(argv)
    env = json.loads((RESULTS / "h200-calib-env.json").read_text(encoding="utf-8"))
    records = analysis.load_records([RESULTS / "h200-calib-records.jsonl.gz"])
    tolerances = load_tolerances(args.tolerances)
    # this class's entries carry their engine (ToleranceKey.engine); one written before that, without it, is replaced
    tolerances = tolerances.model_copy(update={"entries": tuple(
        e for e in tolerances.entries if e.key.hardware_class != HW or e.key.engine or e.key.model not in COMMITTED)})
    result: dict = {"source": "bench/results/calibration/h200-calib-records.jsonl.gz", "margin": MARGIN, "keys": {}}
    entries: dict[tuple[str, str], ToleranceEntry] = {}
    for model in MODELS:
        for dtype in DTYPES:
            mine = [r for r in records if r["dtype"] == dtype and r["model"] == model]
            calib = [r for r in mine if r["split"] == "calibration"]
            held = [r for r in mine if r["split"] == "heldout"]
            swapped = [r for r in mine if r["split"] == "swap"]
            entry = entries[(model, dtype)] = entry_for(model, dtype, calib, env)
            if model in COMMITTED:
                tolerances = merge_entry(tolerances, entry)
            swaps = {}
            for name in dict.fromkeys(r["swap"] for r in swapped):
                runs = [r for r in swapped if r["swap"] == name]
                swaps[name] = {**summary(runs, entry), "margin": analysis.margins(runs, entry)}
            result["keys"][entry.key.label()] = {
                "committed_entry": model in COMMITTED,
                "runs": {"calibration": len(calib), "heldout": len(held), "swap": len(swapped)},
                "thresholds": {"per_prompt": entry.model.per_prompt, "mean": entry.model.mean,
                               "honest_rate": entry.model.honest_rate},
                "honest_max": {k: v for k, v in entry.provenance.honest_max.items() if not k.startswith("kernels.")},
                "heldout": {**summary(held, entry), "per_prompt_exceed": analysis.per_prompt_exceed(held, entry),
                            "max_over_threshold": analysis.honest_max_ratio(held, entry)},
                "swaps": swaps,
            }
    result["gate"] = {"what": "a bf16 SKU's whole gate: the bfloat16 model check, then the float32 pass on the same "
                              "variation (boot, batch, attention); a decision fails when either fails",
                      "classes": class_table(records, entries),
                      "bf16_alone_n64": bf16_alone(records, entries, size=64)}
    result["bf16_classes"] = bf16_classes(records, entries)
    result["honest_prompt_sets"] = honest_sets(HONEST_SETS, entries)
    result["sdpa_calibrated"] = kernel_calibrated(records, env, analysis.load_records([HONEST_SETS])
                                                  if HONEST_SETS.is_file() else [])
    if not args.dry_run:
        write_tolerances(tolerances, args.tolerances)
    (RESULTS / "h200-calibration.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
