"""Judge every run of the committed module-op records (bench/results/modules-records.jsonl.gz) with the hard and the
calibrated bounds (gates.judge.ops.derive_bounds on the class's honest runs, what `skupin calibrate` runs).

    PYTHONPATH=$PWD python3 bench/modules/analyse.py --json bench/results/modules.json

Each honest run is also judged against bounds calibrated on the class's *other* honest runs only (held out), so its
pass is not a pass by construction.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from bench.modules.derive import calibrates, load, results
from skupin.gates.judge.ops import Battery, OpResult, derive_bounds


def _ratio(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 3)


def judge(doc: dict[str, Any], honest: list[dict[str, Any]]) -> dict[str, Any]:
    others = [o for o in honest if o is not doc] if doc in honest else honest
    bounds = derive_bounds([Battery(results=tuple(results(o))) for o in others])
    res: list[OpResult] = results(doc, bounds)
    hard, cal = max(res, key=lambda r: r.hard_ratio), max(res, key=lambda r: r.ratio)
    return {"what": doc["what"], "hard": {"caught": hard.hard_ratio > 1, "op": hard.key, "ratio": _ratio(hard.hard_ratio)},
            "calibrated": {"caught": cal.ratio > 1, "op": cal.key, "ratio": _ratio(cal.ratio), "decided_by": cal.worst()},
            "worst_by_dtype": {dt: _ratio(max(r.ratio for r in res if r.dtype == dt)) for dt in sorted({r.dtype for r in res})}}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    table: dict[str, Any] = {}
    for hw, docs in load().items():
        for model in sorted({d["model"] for d in docs}):
            mine = [d for d in docs if d["model"] == model and d["layers"]]
            honest = [d for d in mine if calibrates(d)]  # vLLM's honest runs are judged, not calibrated on
            for d in mine:
                row = table[f"{hw}/{d['run']}"] = judge(d, honest)
                print(f"{hw:14s} {d['run']:36s} hard {'CAUGHT' if row['hard']['caught'] else 'pass  '} "
                      f"{row['hard']['ratio']!s:>10} | calibrated {'CAUGHT' if row['calibrated']['caught'] else 'pass  '} "
                      f"{row['calibrated']['ratio']!s:>10} {row['calibrated']['op']}")
    if a.json:
        a.json.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
