"""Benchmark: the gate's readers of hostile bytes on adversarial inputs (targets: JSON depth of 1 MB < 1 s, a merge of
15,000 whiteouts over 200,000 paths < 2 s).

Run from the repository root:  python bench/hostile_bench.py [--out bench/results/hostile.json]
Times (best of 3) `common.untrusted.json_depth` on 1 MB inputs built to defeat a backtracking string scan (a quote
followed by escaped quotes: 0.9 s at 10 KB and 12.6 s at 40 KB before it became one pass) and on 16 MB of brackets,
and `skupin.imageview.layers.merge` of a layer with 15,000 whiteouts over one of 200,000 paths (one scan of the merged
map per whiteout took minutes before it filtered once per layer). The unit tests check the results on the same
inputs; the speed targets live here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skupin.common.untrusted import json_depth  # noqa: E402
from skupin.imageview.layers import Entry, LayerIndex, merge  # noqa: E402

DEPTH_TARGET_S = 1.0
MERGE_TARGET_S = 2.0


def best_of(fn: Callable[[], object], runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def json_inputs() -> dict[str, bytes]:
    return {
        "quote_then_escaped_quotes_1MB": b'"' + b'\\"' * 500_000,
        "escaped_quote_brackets_1MB": b'["' + b'\\"[' * 333_333,
        "closed_strings_of_escapes_1MB": b"[" + b'"\\"",' * 200_000 + b'"\\"',
        "brackets_16MB": b"[]" * 8 * 1024**2,
    }


def merge_layers() -> list[LayerIndex]:
    f = Entry("f", 0o644, 1, 0, "a" * 64, "b" * 32)
    low = LayerIndex("l0", {f"pkg{n}/mod{m}.py": f for n in range(20_000) for m in range(10)})
    high = LayerIndex("l1", {f"pkg{n}/mod0.py": Entry("w", 0, 0, 0) for n in range(0, 20_000, 2)}
                      | {f"pkg{n}": Entry("w", 0, 0, 0) for n in range(1, 20_000, 4)})
    return [low, high]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hostile.json")
    args = parser.parse_args()

    depth = {name: round(best_of(lambda data=data: json_depth(data)), 4) for name, data in json_inputs().items()}
    layers = merge_layers()
    merge_s = round(best_of(lambda: merge(layers)), 4)
    result = {
        "json_depth_seconds": depth,
        "json_depth_target_seconds_per_MB": DEPTH_TARGET_S,
        "merge_15000_whiteouts_over_200000_paths_seconds": merge_s,
        "merge_target_seconds": MERGE_TARGET_S,
        "python": sys.version.split()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    slow = [name for name, s in depth.items() if s > DEPTH_TARGET_S * max(1, len(json_inputs()[name]) // 1024**2)]
    slow += ["merge"] if merge_s > MERGE_TARGET_S else []
    print(("SLOW: " + ", ".join(slow)) if slow else "ok: every hostile input within its target")
    return 1 if slow else 0


if __name__ == "__main__":
    raise SystemExit(main())
