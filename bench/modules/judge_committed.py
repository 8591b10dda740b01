"""Judge runs of bench/modules/faults.py against the committed tolerance entries (not against bounds derived from the
runs themselves): what the gate would decide for them today.

    PYTHONPATH=$PWD python3 bench/modules/judge_committed.py CLASS=FOLDER[,FOLDER...] [--engine transformers]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.modules.derive import results
from skupin.gates.judge.tolerance import load_tolerances


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("classes", nargs="+")
    p.add_argument("--engine", default="transformers")
    a = p.parse_args()
    entries = {e.key.label(): e for e in load_tolerances().entries}
    worst = 0.0
    for item in a.classes:
        hw, _, folders = item.partition("=")
        for folder in folders.split(","):
            for f in sorted(Path(folder).glob("*.json")):
                doc = json.loads(f.read_text())
                label = f"{hw}/bfloat16/{doc['model']}" + (f"/{a.engine}" if hw != "cpu-x86_64" else "")
                entry = entries.get(label)
                if entry is None or not doc["layers"]:
                    continue
                res = results(doc, {k: dict(v) for k, v in entry.ops.items()})
                top = max(res, key=lambda r: r.ratio)
                honest = doc["variant"].startswith("honest")
                worst = max(worst, top.ratio) if honest else worst
                print(f"{label:48s} {doc['variant']:22s} {'pass' if top.ratio <= 1 else 'FAIL'} {top.ratio:.3g} {top.key}")
    print(f"worst honest ratio against the committed entries: {worst:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
