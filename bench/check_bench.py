"""Benchmark: load and compat-check 100 manifests, in-process and through `skupin check DIR` (target < 1 s).

Run from the repository root:  python bench/check_bench.py [--count 100] [--out bench/results/check.json]
Copies the shipped skus/*.yaml under distinct names into a temp dir (name == file stem), then
times (a) a fresh interpreter importing builder and checking them all, (b) the same work in this
process after imports are warm, and (c) `python -m skupin.cli check DIR` as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0

# The same work as `skupin check` minus the CLI: parse every manifest, compat-check the valid ones.
IN_PROCESS = """
import sys, time
t0 = time.perf_counter()
from pathlib import Path
from skupin.builder.catalog.manifest import parse_manifest
from skupin.builder.catalog.compat import check_compat, load_compat
load_compat()
t1 = time.perf_counter()
bad = 0
for path in sorted(Path(sys.argv[1]).glob("*.yaml")):
    manifest, problems = parse_manifest(path)
    if manifest is not None:
        problems = check_compat(manifest=manifest, file=str(path))
    bad += bool(problems)
t2 = time.perf_counter()
print(f"{t1 - t0:.6f} {t2 - t1:.6f} {bad}")
"""


def make_manifests(*, count: int, into: Path) -> list[Path]:
    """`count` copies of the shipped manifests, each renamed so that name equals its file stem."""
    shipped = sorted((ROOT / "skus").glob("*.yaml"))
    made = []
    for i in range(count):
        src = shipped[i % len(shipped)]
        name = f"{src.stem}-{i:03d}"
        text = re.sub(r"(?m)^name: .*$", f"name: {name}", src.read_text(encoding="utf-8"), count=1)
        path = into / f"{name}.yaml"
        path.write_text(text, encoding="utf-8")
        made.append(path)
    return made


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def time_fresh_process(folder: Path) -> dict[str, float]:
    """A new interpreter: import cost + checking, as a user running the check would pay it."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(folder)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    imports, check, bad = out.stdout.split()
    if int(bad):
        raise SystemExit(f"{bad} generated manifests have problems; the benchmark needs valid ones")
    return {"wall_s": wall, "import_s": float(imports), "check_s": float(check)}


def time_warm(folder: Path) -> float:
    """Checking only, imports and the compat data already loaded (best of 3)."""
    sys.path.insert(0, str(ROOT))
    from skupin.builder.catalog.compat import check_compat, load_compat
    from skupin.builder.catalog.manifest import parse_manifest

    load_compat()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for path in sorted(folder.glob("*.yaml")):
            manifest, problems = parse_manifest(path)
            if manifest is not None:
                check_compat(manifest=manifest, file=str(path))
        best = min(best, time.perf_counter() - start)
    return best


def time_cli(folder: Path, *extra: str) -> dict[str, float | int | str]:
    """`python -m skupin.cli check DIR` as a subprocess (the whole user-visible cost)."""
    cmd = [sys.executable, "-m", "skupin.cli", "check", *extra, str(folder)]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or [""]
    return {"seconds": round(wall, 4), "exit": out.returncode, "last_line": tail[0][:200]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "check.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="skupin-bench-") as tmp:
        folder = Path(tmp)
        make_manifests(count=args.count, into=folder)
        fresh = time_fresh_process(folder)
        warm = time_warm(folder)
        cli_available = (ROOT / "skupin" / "cli" / "__init__.py").exists()
        cli = time_cli(folder) if cli_available else None
        cli_no_lock = time_cli(folder, "--no-lock") if cli_available else None

    result = {
        "manifests": args.count,
        "seconds": round(fresh["wall_s"], 4),
        "target_seconds": TARGET_S,
        "fresh_process": {k: round(v, 4) for k, v in fresh.items()},
        "warm_check_seconds": round(warm, 4),
        "cli_check": cli,
        "cli_check_no_lock": cli_no_lock,
        "python": sys.version.split()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    worst = max([result["seconds"]] + [c["seconds"] for c in (cli, cli_no_lock) if c])
    verdict = "ok" if worst < TARGET_S else "SLOW"
    print(f"{verdict}: {args.count} manifests, worst {worst:.3f} s (target < {TARGET_S} s)")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
