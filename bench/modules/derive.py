"""The module ops' calibrated bounds in the committed tolerance entries, from the honest runs of
bench/modules/faults.py (gates.judge.ops.derive_bounds, what `skupin calibrate` runs on a gate's honest runs).

    # pack run folders into the committed records (one class per argument) and write the entries
    PYTHONPATH=$PWD python3 bench/modules/derive.py --pack nvidia-hopper=RUNS/h200-boot1,RUNS/h200-boot2 \
        --where "nvidia-hopper=one NVIDIA H200, ..." cpu-x86_64=RUNS/cpu-boot1,RUNS/cpu-boot2 --where "cpu-x86_64=..."
    # add another engine's honest runs of a class to the committed records (bench/modules/vllm_honest.py's)
    PYTHONPATH=$PWD python3 bench/modules/derive.py --append --pack cpu-x86_64=RUNS/cpu-vllm
    # re-derive the entries from the committed records (bench/results/modules-records.jsonl.gz); --check only compares
    PYTHONPATH=$PWD python3 bench/modules/derive.py [--check]

For each class and model every honest variant of every run calibrates; an entry of that class and model whose op
battery is calibrated (its `ops` table is not empty) gets the module keys of its dtypes (a bfloat16 entry's SKU runs
its module ops at bfloat16 and float32, a float32 entry's at float32), replacing module keys it had. An entry without
calibrated battery bounds is left alone (its gate judges the battery and the modules by hard bounds).

The records also hold another engine's honest runs (vLLM's, from bench/modules/vllm_honest.py: variant honest-vllm,
"engine": "vllm"). They do not calibrate these entries, which are transformers' (key without an engine): vLLM's CPU
router returns its top-k weights rounded to bfloat16 where transformers' returns them in float32, and bounds wide
enough for that (2x vLLM's) would admit transformers' router softmax computed in bfloat16, which the entries catch now
(docs/BENCHMARKS.md "The module ops in vLLM"). A vLLM SKU whose honest modules exceed a transformers bound gets an entry
keyed to its engine from its own honest runs (skupin calibrate).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

from skupin.gates.judge.modules import hard_bounds, host_model
from skupin.gates.judge.ops import Battery, OpResult, derive_bounds, spec_sha256
from skupin.gates.judge.tolerance import DEFAULT_PATH, ToleranceEntry, Tolerances, dump_tolerances, load_tolerances
from skupin.imagetools.probe import skupin_probe_ops as spec

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "bench/results/modules-records.jsonl.gz"
NOTE = ("; module ops: bench/modules/faults.py in-process ({where}), honest variants {variants}, derived by "
        "bench/modules/derive.py with gates.judge.ops.derive_bounds")


def results(doc: dict[str, Any], bounds: dict[str, dict[str, float]] | None = None) -> list[OpResult]:
    """One run's module ops as the gate's OpResults (errors as recorded, bounds recomputed)."""
    model = host_model(doc["model"])
    assert model is not None
    kinds = dict(model.plan())
    out = []
    for key, row in doc["layers"].items():
        op, _, dtype = key.rpartition(".")
        kind = "router.logits" if op.endswith(".logits") else kinds[op]
        out.append(OpResult(op=op, dtype=dtype, errors=row["errors"], nmse=None, hard=hard_bounds(kind, dtype, model),
                            calibrated=(bounds or {}).get(key, {}), problem=row["problem"]))
    return out


def pack(classes: dict[str, list[Path]], where: dict[str, str], path: Path = RECORDS, *, append: bool = False) -> None:
    """Write every run of every class's folders as one JSON line each (class, run, where + the run's record); with
    `append`, after the records already there (a run of the same class and name replaces its old line)."""
    kept: list[dict[str, Any]] = []
    if append and path.exists():
        runs = {(hw, f"{folder.name}/{f.stem}") for hw, folders in classes.items() for folder in folders
                for f in folder.glob("*.json")}
        kept = [d for docs in load(path).values() for d in docs if (d["class"], d["run"]) not in runs]
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as fh:
        for doc in kept:
            fh.write(json.dumps(doc, sort_keys=True) + "\n")
        for hw, folders in classes.items():
            for folder in folders:
                for f in sorted(folder.glob("*.json")):
                    doc = {"class": hw, "where": where.get(hw, hw), "run": f"{folder.name}/{f.stem}",
                           **json.loads(f.read_text())}
                    fh.write(json.dumps(doc, sort_keys=True) + "\n")


def load(path: Path = RECORDS) -> dict[str, list[dict[str, Any]]]:
    """The committed records by class."""
    out: dict[str, list[dict[str, Any]]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            doc = json.loads(line)
            out.setdefault(doc["class"], []).append(doc)
    return out


def calibrates(doc: dict[str, Any]) -> bool:
    """Whether a record calibrates the committed (transformers) entries: an honest run of transformers (see above)."""
    return bool(doc["variant"].startswith("honest") and doc.get("engine", "transformers") == "transformers"
                and doc["layers"])


def bounds_by_model(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, dict[str, float]], list[str]]]:
    """model -> (its calibrated module bounds from every honest transformers run, the honest variants)."""
    out = {}
    for model in sorted({d["model"] for d in docs}):
        honest = [d for d in docs if d["model"] == model and calibrates(d)]
        out[model] = (derive_bounds([Battery(results=tuple(results(d))) for d in honest]),
                      sorted({d["variant"] for d in honest}))
    return out


def entry_with_module_bounds(entry: ToleranceEntry, docs: list[dict[str, Any]]) -> ToleranceEntry:
    """`entry` with the module bounds its class's records give its model (unchanged when they have none, or the entry
    has no calibrated battery bounds)."""
    found = bounds_by_model([d for d in docs if d["model"] == entry.key.model]).get(entry.key.model)
    if found is None or not entry.ops or entry.key.engine not in ("", "transformers"):
        return entry
    bounds, variants = found
    dtypes = {entry.key.dtype, "float32"}
    battery = {k: v for k, v in entry.ops.items() if k.rpartition(".")[0] in spec.OUTPUTS}
    modules = {k: v for k, v in bounds.items() if k.rpartition(".")[2] in dtypes}
    method = entry.provenance.method.split("; module ops:")[0]
    note = NOTE.format(where=docs[0]["where"], variants=", ".join(variants))
    # the battery's inputs are unchanged by a module spec change: its bounds keep, under the spec hash of both
    return entry.model_copy(update={"ops": {**battery, **modules}, "ops_spec": spec_sha256(),
                                    "provenance": entry.provenance.model_copy(update={"method": method + note})})


def updated(tolerances: Tolerances, records: dict[str, list[dict[str, Any]]]) -> Tolerances:
    return tolerances.model_copy(update={"entries": tuple(
        entry_with_module_bounds(e, records[e.key.hardware_class]) if e.key.hardware_class in records else e
        for e in tolerances.entries)})


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--pack", nargs="*", default=[], help="CLASS=FOLDER[,FOLDER...]: runs to pack into the records")
    p.add_argument("--where", action="append", default=[], help="CLASS=text: the host the runs were made on")
    p.add_argument("--append", action="store_true", help="with --pack: keep the committed records, add these runs")
    p.add_argument("--check", action="store_true", help="only compare the committed entries with the records")
    a = p.parse_args()
    if a.pack:
        pack({hw: [Path(f) for f in folders.split(",")] for hw, _, folders in (c.partition("=") for c in a.pack)},
             dict(w.split("=", 1) for w in a.where), append=a.append)
    text = dump_tolerances(updated(load_tolerances(DEFAULT_PATH), load()))
    if a.check:
        same = text == DEFAULT_PATH.read_text(encoding="utf-8")
        print("the committed entries hold the records' module bounds" if same else "the committed entries differ")
        return 0 if same else 1
    DEFAULT_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {DEFAULT_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
