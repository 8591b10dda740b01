"""Benchmark: cold build of the CPU SKU vs. the rebuild after an engine point release, in one run.

    python -m bench.rebuild [--to 5.23.0] [--wheelhouse /opt/wheels] [--ca-bundle FILE]

1. cold: the CPU SKU from its lock with no build cache (`--no-cache`);
2. point release: the same manifest with only `stack.engine.version` changed and a lock made
   for it (`builder.lock.lock_sku`), built with the cache of step 1.
Writes bench/results/rebuild.json (cold_s, point_release_s, ratio, new_layer_bytes, ...) and
prints it. Target: ratio <= 0.05 and only the engine layer and above rebuilt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import yaml

from builder.base import ensure_base
from builder.build import build_image
from builder.engine import connect, ensure_engine
from builder.lockfile import Lock, lock_path, read_lock, write_lock
from builder.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
SKU = REPO / "skus" / "cpu-x86_64.yaml"
RESULT = REPO / "bench" / "results" / "rebuild.json"
TARGET_RATIO = 0.05


def _lock_for(manifest_path: Path, *, wheelhouse: Path | None, ca_bundle: Path | None) -> Lock:
    from builder.lock import lock_sku
    from builder.render import render

    manifest = load_manifest(manifest_path)
    return lock_sku(manifest=manifest, manifest_path=manifest_path, wheelhouse=wheelhouse,
                    dockerfile_sha256=render(manifest=manifest).sha256, ca_bundle=ca_bundle)


def _lock_diff(a: Lock, b: Lock) -> dict[str, str]:
    pa, pb = a.packages(), b.packages()
    out = {n: f"{pa[n].version if n in pa else '-'} -> {pb[n].version if n in pb else '-'}"
           for n in sorted(set(pa) | set(pb)) if (pa.get(n) and pa[n].version) != (pb.get(n) and pb[n].version)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--to", default="5.23.0", help="engine version of the point release (default 5.23.0)")
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

    ensure_engine(on_event=say)
    engine = connect()
    with tempfile.TemporaryDirectory(prefix="skupin-bench-") as tmp:
        cold_dir, point_dir = Path(tmp, "cold"), Path(tmp, "point")
        cold_dir.mkdir()
        point_dir.mkdir()
        cold_manifest = cold_dir / SKU.name
        shutil.copy(SKU, cold_manifest)
        if lock_path(SKU).is_file():
            shutil.copy(lock_path(SKU), lock_path(cold_manifest))
        else:
            write_lock(_lock_for(cold_manifest, wheelhouse=wheelhouse, ca_bundle=ca), lock_path(cold_manifest))
        data = yaml.safe_load(SKU.read_text())
        old_version = data["stack"]["engine"]["version"]
        data["stack"]["engine"]["version"] = args.to
        point_manifest = point_dir / SKU.name
        point_manifest.write_text(yaml.safe_dump(data, sort_keys=False))
        say(f"locking the point release {old_version} -> {args.to}")
        point_lock = _lock_for(point_manifest, wheelhouse=wheelhouse, ca_bundle=ca)
        write_lock(point_lock, lock_path(point_manifest))
        cold_lock = read_lock(lock_path(cold_manifest))

        ensure_base(manifest=load_manifest(cold_manifest), engine=engine, on_event=say)
        # A cold build starts from an empty build cache (pruned, then a normal build) rather than
        # --no-cache: a --no-cache build does not reliably leave a cache the next build can use.
        say(f"cold build ({args.cold})")
        if args.cold == "prune":
            engine.builder_prune()
        cold = build_image(manifest=load_manifest(cold_manifest), manifest_path=cold_manifest, lock=cold_lock,
                           engine=engine, wheelhouse=wheelhouse, ca_bundle=ca, no_cache=args.cold == "no-cache")
        say(f"cold: {cold.total_s:.1f} s")
        say("point-release build (with the cache of the cold build)")
        point = build_image(manifest=load_manifest(point_manifest), manifest_path=point_manifest, lock=point_lock,
                            engine=engine, wheelhouse=wheelhouse, ca_bundle=ca)
        say(f"point release: {point.total_s:.1f} s")

    cold_info, point_info = engine.inspect_image(cold.image_id), engine.inspect_image(point.image_id)
    assert cold_info is not None and point_info is not None
    new_layers = [d for d in point_info.layers if d not in set(cold_info.layers)]
    unique = engine.unique_bytes(point.image_id)
    engine.remove_image(point.image, force=False)  # the bench's point-release tag; the cold tag is the SKU's own
    build_s = lambda b: round(sum(layer.seconds for layer in b.layers), 2)  # noqa: E731
    result = {
        "sku": cold.sku,
        "engine": {"from": old_version, "to": args.to},
        "lock_changes": _lock_diff(cold_lock, point_lock),
        "cold_s": cold.total_s,
        "point_release_s": point.total_s,
        "ratio": round(point.total_s / cold.total_s, 4),
        "target_ratio": TARGET_RATIO,
        "meets_target": point.total_s / cold.total_s <= TARGET_RATIO,
        "cold_buildkit_s": build_s(cold),
        "point_release_buildkit_s": build_s(point),
        "cold_layers": {layer.name: layer.seconds for layer in cold.layers},
        "point_release_layers": {layer.name: {"seconds": layer.seconds, "cached": layer.cached} for layer in point.layers},
        "rebuilt_layers": [layer.name for layer in point.layers if not layer.cached],
        "new_layers": len(new_layers),
        "new_layer_bytes": unique,
        "image_bytes": point_info.size,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "engine": engine.ping()},
        "measured": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cold_method": args.cold,
        "notes": "total_s of build_image: base check + render + BuildKit build + image-vs-lock check in a container + tag",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
