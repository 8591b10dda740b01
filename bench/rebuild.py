"""Benchmark: cold build of the CPU SKU vs. the rebuild after an engine point release, in one run.

    python -m bench.rebuild [--to 5.23.0,5.22.2,5.22.1,5.22.0,5.21.1] [--wheelhouse /opt/wheels] [--ca-bundle FILE]

1. cold: the CPU SKU from its lock with an empty build cache (`--cold prune`, the default) and an
   empty wheel store (every locked wheel is downloaded; torch comes from the wheelhouse);
2. point releases: for each `--to` version, the same manifest with only `stack.engine.version`
   changed and a lock made for it (`builder.lock.lock_sku`), built with the cache of step 1
   (and of the point releases before it) and the same wheel store. A version whose lock changes more than the engine is
   refused. `point_release_s` is the median over the versions (one build each), and every
   build is listed.
Before every timed build the bench flushes the page cache's dirty pages (`sync`) and waits until
the kernel's I/O pressure (/proc/pressure/io, `some avg10`) is below 2% or 30 s have passed, so a
build is not measured while the previous one's writes (2 GB after the cold build) still drain;
what it waited for is recorded with each build.
Writes bench/results/rebuild.json (cold_s, point_release_s, ratio, new_layer_bytes, ...) and
prints it. Target: ratio <= 0.05 and only the engine layer and above rebuilt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml
from packaging.utils import canonicalize_name

from skupin.builder.base import ensure_base
from skupin.builder.build import build
from skupin.builder.catalog.lockfile import Lock, lock_path, read_lock, write_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.check import resolve
from skupin.builder.render import render
from skupin.dockerd import connect, ensure_dockerd

REPO = Path(__file__).resolve().parents[1]
SKU = REPO / "skus" / "cpu-x86_64.yaml"
RESULT = REPO / "bench" / "results" / "rebuild.json"
TARGET_RATIO = 0.05
DEFAULT_TO = "5.23.0,5.22.2,5.22.1,5.22.0,5.21.1"
QUIET_IO_PCT = 2.0
SETTLE_MAX_S = 30.0


def io_pressure() -> float | None:
    """`some avg10` of /proc/pressure/io (percent of the last 10 s some task waited on I/O); None without PSI."""
    try:
        first = Path("/proc/pressure/io").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return float(dict(kv.split("=") for kv in first.split()[1:])["avg10"])


def settle(say) -> dict[str, float | None]:
    """sync, then wait (at most SETTLE_MAX_S) for the I/O pressure to fall below QUIET_IO_PCT."""
    start = time.monotonic()
    os.sync()
    pressure = io_pressure()
    while pressure is not None and pressure >= QUIET_IO_PCT and time.monotonic() - start < SETTLE_MAX_S:
        time.sleep(1.0)
        pressure = io_pressure()
    waited = round(time.monotonic() - start, 1)
    if waited >= 1:
        say(f"waited {waited} s for the disk to settle (I/O pressure {pressure}%)")
    return {"waited_s": waited, "io_pressure_avg10": pressure}


def _lock_for(manifest_path: Path, *, wheelhouse: Path | None, ca_bundle: Path | None) -> Lock:
    from skupin.builder.lock import lock_sku

    return lock_sku(manifest=load_manifest(manifest_path), manifest_path=manifest_path, wheelhouse=wheelhouse,
                    ca_bundle=ca_bundle)


def _lock_diff(a: Lock, b: Lock) -> dict[str, str]:
    pa, pb = a.packages(), b.packages()
    out = {n: f"{pa[n].version if n in pa else '-'} -> {pb[n].version if n in pb else '-'}"
           for n in sorted(set(pa) | set(pb)) if (pa.get(n) and pa[n].version) != (pb.get(n) and pb[n].version)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--to", default=DEFAULT_TO,
                    help=f"comma-separated engine versions, one point-release build each (default {DEFAULT_TO})")
    ap.add_argument("--wheelhouse", type=Path, default=Path(os.environ.get("SKUPIN_WHEELHOUSE", "/opt/wheels")))
    ap.add_argument("--ca-bundle", type=Path, default=Path(os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")))
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--cold", choices=("prune", "no-cache"), default="prune",
                    help="how the cold build starts: prune the whole build cache (default; drops every "
                         "project's cache on this engine) or build with --no-cache")
    args = ap.parse_args(argv)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    wheelhouse = args.wheelhouse if args.wheelhouse.is_dir() else None
    ca = args.ca_bundle if args.ca_bundle.is_file() else None
    versions = [v.strip() for v in args.to.split(",") if v.strip()]
    if not versions:
        ap.error("--to: give at least one engine version")

    ensure_dockerd(on_event=say)
    docker = connect()
    with tempfile.TemporaryDirectory(prefix="skupin-bench-") as tmp:
        cold_dir = Path(tmp, "cold")
        cold_dir.mkdir()
        cold_manifest = cold_dir / SKU.name
        shutil.copy(SKU, cold_manifest)
        if lock_path(SKU).is_file():
            shutil.copy(lock_path(SKU), lock_path(cold_manifest))
        else:
            write_lock(_lock_for(cold_manifest, wheelhouse=wheelhouse, ca_bundle=ca), lock_path(cold_manifest))
        cold_lock = read_lock(lock_path(cold_manifest))
        data = yaml.safe_load(SKU.read_text())
        old_version = data["stack"]["engine"]["version"]
        engine_name = canonicalize_name(data["stack"]["engine"]["name"])
        points: list[tuple[str, Path, Lock]] = []
        for version in versions:
            point_dir = Path(tmp, f"point-{version}")
            point_dir.mkdir()
            data["stack"]["engine"]["version"] = version
            point_manifest = point_dir / SKU.name
            point_manifest.write_text(yaml.safe_dump(data, sort_keys=False))
            say(f"locking the point release {old_version} -> {version}")
            point_lock = _lock_for(point_manifest, wheelhouse=wheelhouse, ca_bundle=ca)
            others = {n: d for n, d in _lock_diff(cold_lock, point_lock).items() if n != engine_name}  # lock keys are canonical
            if others:
                say(f"{version}: its lock changes more than the engine ({others}); not a point release of the engine alone")
                return 2
            write_lock(point_lock, lock_path(point_manifest))
            points.append((version, point_manifest, point_lock))

        ensure_base(manifest=load_manifest(cold_manifest), docker=docker, on_event=say)
        # A cold build starts from an empty build cache (pruned, then a normal build) rather than
        # --no-cache: a --no-cache build does not reliably leave a cache the next build can use.
        say(f"cold build ({args.cold})")
        if args.cold == "prune":
            docker.builder_prune()
        cold_settle = settle(say)
        # The cold build also starts with an empty wheel store: it downloads every locked wheel
        # (torch comes from the wheelhouse); the point releases then reuse that store.
        store = Path(tmp, "wheels")
        cold = build(render(resolve(cold_manifest, require_lock=True)), docker, wheelhouse=wheelhouse, ca_bundle=ca,
                     no_cache=args.cold == "no-cache", wheel_store=store)
        say(f"cold: {cold.total_s:.1f} s")
        builds = []
        for version, point_manifest, point_lock in points:
            # Each build starts with no dirty pages of the one before it being written back
            # under it (the cold build leaves ~2 GB): measurements do not bleed into each other.
            quiet = settle(say)
            say(f"point-release build {old_version} -> {version} (with the cache of the cold build)")
            built = build(render(resolve(point_manifest, require_lock=True)), docker, wheelhouse=wheelhouse, ca_bundle=ca,
                          wheel_store=store)
            say(f"point release {version}: {built.total_s:.1f} s")
            builds.append((version, point_lock, built, quiet))

    cold_info = docker.inspect_image(cold.image_id)
    assert cold_info is not None
    build_s = lambda b: round(sum(layer.seconds for layer in b.layers), 2)  # noqa: E731
    rows = []
    for version, point_lock, built, quiet in builds:
        info = docker.inspect_image(built.image_id)
        assert info is not None
        rows.append({
            "to": version,
            "lock_changes": _lock_diff(cold_lock, point_lock),
            "seconds": built.total_s,
            "ratio": round(built.total_s / cold.total_s, 4),
            "buildkit_s": build_s(built),
            "phases": built.phases,
            "layers": {layer.name: {"seconds": layer.seconds, "cached": layer.cached} for layer in built.layers},
            "rebuilt_layers": [layer.name for layer in built.layers if not layer.cached],
            "new_layers": len([d for d in info.layers if d not in set(cold_info.layers)]),
            "new_layer_bytes": docker.unique_bytes(built.image_id),
            "image_bytes": info.size,
            "settle": quiet,
        })
        docker.remove_image(built.image, force=False)  # the bench's point-release tags; the cold tag is the SKU's own
    point_s = statistics.median(r["seconds"] for r in rows)
    first = rows[0]
    result = {
        "sku": cold.sku,
        "engine": {"from": old_version, "to": versions},
        "cold_s": cold.total_s,
        "point_release_s": point_s,
        "ratio": round(point_s / cold.total_s, 4),
        "ratio_range": [min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)],
        "target_ratio": TARGET_RATIO,
        "meets_target": point_s / cold.total_s <= TARGET_RATIO,
        "only_engine_and_above_rebuilt": all(
            set(r["rebuilt_layers"]) <= {"base", "engine", "extras", "labels", "export"} for r in rows
        ),
        "cold_buildkit_s": build_s(cold),
        "cold_phases": cold.phases,
        "cold_settle": cold_settle,
        "cold_layers": {layer.name: layer.seconds for layer in cold.layers},
        "point_releases": rows,
        # kept flat for readers of the first version of this file: the first point release
        "lock_changes": first["lock_changes"],
        "point_release_buildkit_s": first["buildkit_s"],
        "point_release_layers": first["layers"],
        "rebuilt_layers": first["rebuilt_layers"],
        "new_layers": first["new_layers"],
        "new_layer_bytes": first["new_layer_bytes"],
        "image_bytes": first["image_bytes"],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "engine": docker.ping()},
        "measured": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cold_method": args.cold,
        "notes": "seconds are BuiltImage.total_s: base check + context + BuildKit build + the image-vs-lock check "
        "in a container + tag (see phases); point_release_s is the median over point_releases",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
