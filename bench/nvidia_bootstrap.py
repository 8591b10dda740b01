"""Benchmark: the bootstrapped NVIDIA SKU built end to end on a host with no GPU, and what it costs.

    python -m bench.nvidia_bootstrap [--sku nvidia-h200-vllm-debian] [--patch NAME=VERSION ...] [--swap-engine VERSION]
                                     [--no-gate] [--no-push] [--out bench/results/nvidia-bootstrap.json]

The SKU (skus/nvidia-h200-vllm-debian.yaml: the pins of nvidia-h200-vllm on the debootstrap Debian 12 base, the CUDA
user space from the locked nvidia-* wheels) is built from its committed lock, then:

1. cold: an empty wheel store (a temporary one: every locked wheel is downloaded from its lock URL and checked against
   its sha256; the build's `wheels` phase) and `--no-cache` (BuildKit builds every step again; the `buildkit` phase is
   the install: apt, then each locked step). The other projects' build cache on the engine is left alone (no prune).
2. point releases, each built with the cache of step 1 and the same wheel store (only the new wheels are downloaded):
   - `--patch NAME=VERSION`: the lock with one engine-layer package moved to another real release of the same
     major.minor (a patch release in the closure), resolved again by `skupin lock`'s resolver with the manifest plus
     that pin; refused when the resolver moves anything else;
   - `--swap-engine VERSION`: vLLM has no 0.32.x patch on PyPI (0.32.0 is the only 0.32 release), so the rebuild a
     patch of the engine alone would cost is measured by the engine wheel of another real vLLM release in the engine
     step with every other locked package held (a lock written by this script, never committed: that stack is not
     coherent, and the image is removed after it is timed).
   `ratio` is each rebuild's BuiltImage.total_s over the cold build's. A point release this engine has built before
   is a cache hit (its steps are in BuildKit's cache from that run: `rebuilt_layers` then lists no pip step): measure
   versions not built before, e.g. with `--rebuilds-only` (the point releases alone, against the cold build of the
   result file, whose point_releases they replace).
3. the gate's static `pins` check on the full image (`skupin gate SKU --image ...`: on a host with no GPU the gate
   goes on after `pins` and ends "could not run"; `pins_s` is read from verdict.json's timings);
4. the SBOM publish would sign (skupin/publishing/sbom.py: image_inventory + build_bom), timed with an empty layer-index
   cache and again with the one the gate filled (what publish reads after a gate);
5. a push to a loopback registry (Debian's docker-registry on a free 127.0.0.1 port, its storage in a temporary
   folder), timed, with the registry's bytes on disk.
The images and the registry it made are removed at the end (the cold build's tag stays with --keep); BuildKit's cache
records of the builds stay (about 10 GB per cold build; docs/BENCHMARKS.md says how they were removed here).
Writes bench/results/nvidia-bootstrap.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from skupin.builder.base import ensure_base
from skupin.builder.build import BuiltImage, build
from skupin.builder.catalog.lockfile import Lock, lock_path, read_lock, write_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.check import resolve
from skupin.builder.lock import manifest_digest
from skupin.builder.render import render
from skupin.dockerd import Docker, connect, ensure_dockerd
from skupin.publishing.local_registry import LocalRegistry, registry_down, registry_up
from skupin.publishing.sbom import build_bom, image_inventory

REPO = Path(__file__).resolve().parents[1]
SKU = "nvidia-h200-vllm-debian"
RESULT = REPO / "bench" / "results" / "nvidia-bootstrap.json"
TARGET_RATIO = 0.05
TARGET_PINS_S = 120.0
Say = Callable[[str], None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _lock_diff(a: Lock, b: Lock) -> dict[str, str]:
    pa, pb = a.packages(), b.packages()
    return {n: f"{pa[n].version if n in pa else '-'} -> {pb[n].version if n in pb else '-'}"
            for n in sorted(set(pa) | set(pb)) if (pa.get(n) and pa[n].version) != (pb.get(n) and pb[n].version)}


def _build_row(built: BuiltImage, cold_s: float, docker: Docker) -> dict[str, Any]:
    return {
        "seconds": built.total_s,
        "ratio": round(built.total_s / cold_s, 4),
        "phases": built.phases,
        "rebuilt_layers": [layer.name for layer in built.layers if not layer.cached],
        "rebuilt_steps": [{"name": s.name[:120], "seconds": s.seconds} for s in built.steps if not s.cached],
        "new_layer_bytes": docker.unique_bytes(built.image_id),
        "image_bytes": built.size_bytes,
    }


def _resolved(*, folder: Path, data: dict[str, Any], name: str) -> Lock:
    """A lock resolved (uv, no Docker: apt versions as the manifest names them) for manifest `data`, written to
    `folder`; only its Python packages are used."""
    import yaml

    from skupin.builder.lock import lock_sku

    folder.mkdir(parents=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return lock_sku(manifest=load_manifest(path), manifest_path=path, wheelhouse=None, ca_bundle=None)


def _replaced_lock(*, folder: Path, manifest_path: Path, cold_lock: Lock, kind: str, name: str, version: str,
                   say: Say) -> Path:
    """A point release of the cold lock: package `name` replaced by release `version` (its wheel, URL and sha256 taken
    from a lock the resolver made with that pin), every other package held, in the same layer and step.

    kind "patch": a package of the closure pinned in a copy of the manifest (extras.python); the resolver must move
    nothing else, so the new set is one the resolver accepts, and the manifest (its digest) is unchanged.
    kind "engine": the manifest's engine pin moved to `version` (its digest recomputed); the rest of the set is the
    cold lock's whatever that release requires (a timing stand-in, never a lock to keep).
    Returns the point release's manifest path (its lock beside it)."""
    import yaml

    data = yaml.safe_load(manifest_path.read_text())
    changed = yaml.safe_load(manifest_path.read_text())
    if kind == "patch":
        changed.setdefault("extras", {}).setdefault("python", []).append({"name": name, "version": version})
    else:
        changed["stack"]["engine"]["version"] = version
        data = changed
    say(f"resolving {name}=={version} ({kind})")
    resolved = _resolved(folder=folder / "resolved", data=changed, name=manifest_path.name)
    key = canonicalize_name(name)
    if kind == "patch":
        moved = _lock_diff(cold_lock, resolved)
        if set(moved) != {key}:
            raise SystemExit(f"{name}=={version}: the resolver moves more than {name} ({moved}); not a patch alone")
    wheel = resolved.packages()[key]
    path = folder / manifest_path.name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    layers = {layer: tuple(wheel if p.name == key else p for p in pkgs) for layer, pkgs in cold_lock.layers.items()}
    lock = cold_lock.model_copy(update={"layers": layers, "manifest_sha256": manifest_digest(load_manifest(path))})
    write_lock(lock, lock_path(path))
    return path


def _gate_pins(*, image: str, out: Path, say: Say) -> dict[str, Any]:
    """`skupin gate` on the image: its wall time, exit code, and the pins check's status and pins_s from verdict.json."""
    say(f"skupin gate {SKU} --image {image}")
    start = time.monotonic()
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "skupin"), "gate", SKU, "--image", image, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    wall = round(time.monotonic() - start, 2)
    verdict_path = out / "verdict.json"
    verdict = json.loads(verdict_path.read_text()) if verdict_path.is_file() else {}
    checks = {c.get("name"): c for c in verdict.get("checks", [])}
    pins = checks.get("pins", {})
    return {
        "exit_code": proc.returncode,
        "wall_s": wall,
        "decision": verdict.get("decision") or verdict.get("status"),
        "pins_status": pins.get("status"),
        "pins_reason": (pins.get("reason") or "")[:400],
        "pins_s": (verdict.get("timings") or {}).get("pins_s"),
        "timings": verdict.get("timings"),
        "checks": {name: c.get("status") for name, c in checks.items()},
        "stderr_tail": proc.stderr[-1500:],
    }


def _sbom(*, docker: Docker, image_id: str, cache: Path, lock: Lock, say: Say) -> dict[str, Any]:
    start = time.monotonic()
    inventory = image_inventory(docker=docker, image_id=image_id, cache=cache, on_event=say)
    read_s = time.monotonic() - start
    bom = build_bom(inventory, registry="127.0.0.1:5000", repository=f"skupin/{SKU}", digest="sha256:" + "0" * 64,
                    image_id=image_id, timestamp=lock.created, lock=lock, sku=SKU)
    return {"read_layers_s": round(read_s, 2), "total_s": round(time.monotonic() - start, 2),
            "components": len(bom.get("components", [])), "bytes": len(json.dumps(bom))}


def _push(*, docker: Docker, image: str, folder: Path, say: Say) -> dict[str, Any]:
    registry = LocalRegistry(addr=f"127.0.0.1:{_free_port()}", folder=folder)
    registry_up(registry=registry, on_event=say)
    target = f"{registry.addr}/skupin/{SKU}:bench"
    try:
        docker.tag(image, target)
        say(f"pushing {target}")
        start = time.monotonic()
        digest = docker.push(target)
        seconds = round(time.monotonic() - start, 2)
        stored = _du(registry.data_path)
    finally:
        docker.remove_image(target)
        registry_down(registry=registry)
    return {"seconds": seconds, "digest": digest, "registry_bytes": stored}


def _save(result: dict[str, Any], out: Path) -> None:
    """Write what is measured so far (the file is rewritten after every stage, so a later failure keeps it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sku", default=SKU)
    ap.add_argument("--patch", action="append", default=[], metavar="NAME=VERSION",
                    help="a point release in the closure: one engine-layer package at another real release")
    ap.add_argument("--swap-engine", metavar="VERSION", help="the engine wheel of another release, all else held")
    ap.add_argument("--no-gate", action="store_true")
    ap.add_argument("--no-sbom", action="store_true")
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the cold build's image (default: remove it)")
    ap.add_argument("--rebuilds-only", action="store_true",
                    help="only the point releases, against the cold build recorded in --out: the lock is built with "
                         "the cache and the host's wheel store (to have the image), then each point release; their "
                         "rows replace the file's point_releases (gate, SBOM, push skipped)")
    ap.add_argument("--out", type=Path, default=RESULT)
    return ap


def _points(args: argparse.Namespace, *, tmp: str, manifest_path: Path, cold_lock: Lock, engine: str,
            say: Say) -> list[tuple[str, Path]]:
    """The point releases asked for: (label, its manifest with its lock beside it)."""
    points: list[tuple[str, Path]] = []
    for spec in args.patch:
        name, _, version = spec.partition("=")
        points.append((f"patch {name} -> {version}", _replaced_lock(
            folder=Path(tmp, f"patch-{name}"), manifest_path=manifest_path, cold_lock=cold_lock, kind="patch",
            name=name, version=version, say=say)))
    if args.swap_engine:
        points.append((f"engine wheel swapped for {args.swap_engine}", _replaced_lock(
            folder=Path(tmp, "swap"), manifest_path=manifest_path, cold_lock=cold_lock, kind="engine",
            name=engine, version=args.swap_engine, say=say)))
    return points


def _cold_row(cold: BuiltImage, store: Path) -> dict[str, Any]:
    return {
        "image": cold.image,
        "image_id": cold.image_id,
        "cold_s": cold.total_s,
        "cold_phases": cold.phases,
        "cold_download_s": cold.phases.get("wheels"),
        "cold_install_s": cold.phases.get("buildkit"),
        "cold_layers": {layer.name: layer.seconds for layer in cold.layers},
        "cold_steps": [{"name": s.name[:120], "layer": s.layer, "seconds": s.seconds} for s in cold.steps
                       if s.seconds >= 1],
        "image_bytes": cold.size_bytes,
        "wheel_store_bytes": _du(store),
        "wheels": len(list(store.rglob("*.whl"))),
        "installed": len(cold.installed),
    }


def _rebuilds(points: list[tuple[str, Path]], *, docker: Docker, cold: BuiltImage, cold_s: float, cold_lock: Lock,
              store: Path, result: dict[str, Any], out: Path, say: Say) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    result["point_releases"] = rows
    for label, point_manifest in points:
        os.sync()
        say(f"point release: {label}")
        built = build(render(resolve(point_manifest, require_lock=True)), docker, wheel_store=store)
        row = {"change": label, **_build_row(built, cold_s, docker)}
        row["lock_changes"] = _lock_diff(cold_lock, read_lock(lock_path(point_manifest)))
        say(f"{label}: {built.total_s:.1f} s (ratio {row['ratio']})")
        rows.append(row)
        _save(result, out)
        if built.image_id != cold.image_id:
            for tag in built.tags:
                docker.remove_image(tag)
    return rows


def _after_build(args: argparse.Namespace, *, docker: Docker, cold: BuiltImage, cold_lock: Lock, tmp: str,
                 result: dict[str, Any], say: Say) -> None:
    """The gate's pins check, the SBOM and the push of the cold build's image."""
    if not args.no_gate:
        result["gate"] = _gate_pins(image=cold.image, out=Path(tmp, "gate"), say=say)
        _save(result, args.out)
    if not args.no_sbom:
        result["sbom_cold_cache"] = _sbom(docker=docker, image_id=cold.image_id, cache=Path(tmp, "sbom-cache"),
                                          lock=cold_lock, say=say)
        if not args.no_gate:
            result["sbom_after_gate"] = _sbom(docker=docker, image_id=cold.image_id,
                                              cache=REPO / ".skupin" / "cache", lock=cold_lock, say=say)
        _save(result, args.out)
    if not args.no_push:
        result["push"] = _push(docker=docker, image=cold.image, folder=Path(tmp, "registry"), say=say)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    say: Say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    ensure_dockerd(on_event=say)
    docker = connect()
    manifest_path = REPO / "skus" / f"{args.sku}.yaml"
    result: dict[str, Any] = {"sku": args.sku}
    if args.rebuilds_only:
        result = json.loads(args.out.read_text())
        args.no_gate = args.no_sbom = args.no_push = args.keep = True
    with tempfile.TemporaryDirectory(prefix="skupin-bench-nvb-", dir=REPO / ".skupin") as tmp:
        store = Path(tmp, "wheels")
        stack = resolve(manifest_path, require_lock=True)
        cold_lock = read_lock(lock_path(manifest_path))
        ensure_base(manifest=load_manifest(manifest_path), docker=docker, on_event=say)
        engine = stack.manifest.stack.engine
        points = _points(args, tmp=tmp, manifest_path=manifest_path, cold_lock=cold_lock,
                         engine=engine.package or engine.name, say=say)
        if args.rebuilds_only:
            store = REPO / ".skupin" / "wheels"
            cold = build(render(stack), docker, wheel_store=store)
            say(f"the lock's image, with the cache: {cold.total_s:.1f} s")
            cold_s = float(result["cold_s"])
            result["rebuilds_measured"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        else:
            say(f"cold build of {args.sku}: empty wheel store, --no-cache")
            os.sync()
            cold = build(render(stack), docker, wheel_store=store, no_cache=True, records=REPO / ".skupin" / "builds")
            say(f"cold: {cold.total_s:.1f} s, {cold.size_bytes / 1e9:.2f} GB")
            cold_s = cold.total_s
            result.update(_cold_row(cold, store))
            result["measured"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        _save(result, args.out)
        rows = _rebuilds(points, docker=docker, cold=cold, cold_s=cold_s, cold_lock=cold_lock, store=store,
                         result=result, out=args.out, say=say)
        _after_build(args, docker=docker, cold=cold, cold_lock=cold_lock, tmp=tmp, result=result, say=say)
        if not args.keep:
            for tag in cold.tags:
                docker.remove_image(tag)

    pins_s = (result.get("gate") or {}).get("pins_s")
    result.update({
        "target_ratio": TARGET_RATIO,
        "meets_ratio_target": all(r["ratio"] <= TARGET_RATIO for r in rows) if rows else None,
        "target_pins_s": TARGET_PINS_S,
        "meets_pins_target": pins_s <= TARGET_PINS_S if pins_s is not None else None,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "engine": docker.ping()},
        "notes": "seconds are BuiltImage.total_s (base check + wheels + context + BuildKit + the image-vs-lock check "
                 "+ tag; see phases: wheels is the download into the empty store, buildkit the install)",
    })
    _save(result, args.out)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
