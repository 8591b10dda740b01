"""Benchmark: one lock, one digest. Builds of a SKU from fresh clones, each in a Docker engine of its own with an empty
data root, pushed to one registry; and the registry cache of runners without local state.

    python -m bench.reproducible [--sku cpu-x86_64 ...] [--runs cold,cold,cached,sibling,sibling-cold]
                                 [--sibling cpu-x86_64-bf16] [--base bootstrap|load] [--out bench/results/reproducible.json]

For each SKU, each run (by default three) gets:
- a fresh clone of this repository at HEAD (`git clone`), its own SKUPIN_STATE (empty: no base record, no build record,
  no contexts; the locked wheels come from the wheelhouse and the main checkout's wheel store, each checked against the
  lock's sha256 as in any build);
- its own dockerd (`--data-root` an empty folder, its own bridge and socket): no image, no BuildKit cache, no cache
  mounts, no layers shared with any other run or with the host's engine;
- the SKU's base: `bootstrap` (default: `skupin base`, debootstrap in that engine; the lock's base diff id must come out)
  or `load` (the host engine's base, `docker save | docker load`, when the archive moved since the lock);
- `skupin build SKU` (`cold`: no --cache, nothing shared, but run a fills the registry cache REF with `--cache REF`;
  `cached`: `--cache REF`, the same inputs, so the build pulls run a's image and builds nothing; no separate base step,
  the build makes the base only if it needs one; `sibling`: `--cache REF` for the sibling SKU, whose lock differs
  (time, dtype, labels) but whose every RUN step is the SKU's, so BuildKit takes every step from REF's inline cache of
  rewritten layers (what a point release does below its changed pin); `sibling-cold`: the sibling with no cache, to
  show the cached sibling is the image a cold build makes), then the publish's own push (publishing/imagepush.py) of
  the built image to one loopback registry under `<sku>-<run>`.
The result: per run the image id, the manifest digest, base, build and push seconds; `same_digest` over the SKU's runs
and `sibling_same_digest` over the sibling's. The engines and clones are removed after each run (the registry at the
end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from skupin.clients.oci import RegistryClient  # noqa: E402
from skupin.dockerd import connect  # noqa: E402
from skupin.publishing.imagepush import push_image  # noqa: E402
from skupin.publishing.local_registry import LocalRegistry, registry_down, registry_up  # noqa: E402

PYTHON = REPO / ".venv" / "bin" / "python"
BRIDGE, BRIDGE_ADDR = "skupinrepro0", "172.31.251.1/24"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, **kw)


class Engine:
    """A dockerd with an empty data root, its own socket and bridge; removed (data root too) on stop."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
            _sh(["ip", "link", "add", "name", BRIDGE, "type", "bridge"])
            _sh(["ip", "addr", "add", BRIDGE_ADDR, "dev", BRIDGE])
        _sh(["ip", "link", "set", BRIDGE, "up"])
        self.root.mkdir(parents=True)
        log = open(self.root.parent / f"{self.root.name}-dockerd.log", "w")
        self.proc = subprocess.Popen(["dockerd", "--data-root", str(self.root / "data"), "--exec-root",
                                      str(self.root / "exec"), "-H", self.host, "--pidfile", str(self.root / "pid"),
                                      "--bridge", BRIDGE], stdout=log, stderr=subprocess.STDOUT)
        for _ in range(120):
            if subprocess.run(["/usr/bin/docker", "-H", self.host, "version"], capture_output=True).returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"dockerd on {self.host} did not answer")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def _base_reference(clone: Path, sku: str) -> str:
    out = _sh([str(PYTHON), "-c", f"from skupin.builder.catalog.manifest import load_manifest; "
               f"print(load_manifest(__import__('pathlib').Path('skus/{sku}.yaml')).base.reference)"],
              cwd=clone, capture_output=True, env={**os.environ, "PYTHONPATH": str(clone)}).stdout.strip()
    return out


def run_once(*, sku: str, name: str, kind: str, work: Path, registry: LocalRegistry, base: str, cache_ref: str,
             wheel_store: Path, sibling: str) -> dict:
    if kind.startswith("sibling"):
        sku = sibling
    clone, state, engine = work / f"clone-{name}", work / f"state-{name}", Engine(work / f"engine-{name}")
    _sh(["git", "clone", "--quiet", str(REPO), str(clone)])
    commit = _sh(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True).stdout.strip()
    state.mkdir()
    (state / "wheels").symlink_to(wheel_store)  # content-addressed, every wheel checked against the lock
    env = {**os.environ, "PYTHONPATH": str(clone), "SKUPIN_STATE": str(state), "DOCKER_HOST": engine.host,
           "SKUPIN_WHEELHOUSE": os.environ.get("SKUPIN_WHEELHOUSE", "/opt/wheels"), "SKUPIN_INSTALL_MISSING": "1"}
    engine.start()
    try:
        started = time.monotonic()
        if kind == "cached":
            pass  # a runner whose build finds its image in the registry cache needs no base
        elif base == "load":
            reference = _base_reference(clone, sku)
            save = subprocess.Popen(["/usr/bin/docker", "save", reference], stdout=subprocess.PIPE)
            _sh(["/usr/bin/docker", "-H", engine.host, "load"], stdin=save.stdout, capture_output=True)
            save.wait()
        else:
            _sh([str(PYTHON), "-m", "skupin", "base", sku], cwd=clone, env=env, capture_output=True)
        base_s = time.monotonic() - started
        cmd = [str(PYTHON), "-m", "skupin", "build", sku, "--json", "--progress", "plain"]
        if kind in ("cached", "sibling") or name == "a":
            cmd += ["--cache", cache_ref]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"build {name} failed:\n{proc.stderr[-3000:]}")
        build_s = time.monotonic() - started
        built = json.loads(proc.stdout)
        docker = connect(socket=engine.socket)
        started = time.monotonic()
        with RegistryClient(f"http://{registry.addr}") as client:
            digest = push_image(docker=docker, client=client, repository=f"{sku}-{name}", image_id=built["image_id"],
                                tag="latest")
        push_s = time.monotonic() - started
        docker.close()
        return {"run": name, "kind": kind, "sku": sku, "fetched": built.get("fetched"),
                "unchanged_layers": (built.get("reproducible") or {}).get("unchanged_layers"), "commit": commit,
                "image_id": built["image_id"], "digest": digest,
                "lock_sha256": built["lock_sha256"], "base_s": round(base_s, 1), "build_s": round(build_s, 1),
                "buildkit_s": built["phases"].get("buildkit"), "normalise_s": built["phases"].get("normalise"),
                "phases": built["phases"],
                "cache_hits": built["cache_hits"], "push_s": round(push_s, 1), "size_bytes": built["size_bytes"],
                "cache": built.get("cache"), "builder": built.get("builder")}
    finally:
        engine.stop()
        shutil.rmtree(clone, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def _ratio(runs: list[dict], warm: str, cold: str, *, with_base: bool = False) -> float | None:
    """The fastest `warm` run's seconds over the fastest `cold` run's (build, plus the base step with `with_base`)."""
    def cost(r: dict) -> float:
        return r["build_s"] + (r["base_s"] if with_base else 0)

    warm_s = [cost(r) for r in runs if r["kind"] == warm]
    cold_s = [cost(r) for r in runs if r["kind"] == cold]
    return round(min(warm_s) / min(cold_s), 3) if warm_s and cold_s else None


def summarise(runs: list[dict]) -> dict:
    """One SKU's result: its runs, whether the SKU's and the sibling's runs each gave one digest, and the ratios."""
    own = [r for r in runs if not r["kind"].startswith("sibling")]
    siblings = [r for r in runs if r["kind"].startswith("sibling")]
    return {"runs": runs, "same_digest": len({r["digest"] for r in own}) == 1,
            "same_image_id": len({r["image_id"] for r in own}) == 1,
            "sibling_same_digest": len({r["digest"] for r in siblings}) == 1 if siblings else None,
            "cached_over_cold": _ratio(own, "cached", "cold"),
            "cached_over_cold_with_base": _ratio(own, "cached", "cold", with_base=True),
            "sibling_over_cold": _ratio(siblings, "sibling", "sibling-cold"),
            "sibling_over_cold_with_base": _ratio(siblings, "sibling", "sibling-cold", with_base=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sku", action="append", help="SKU(s) to build (default: cpu-x86_64)")
    parser.add_argument("--runs", default="cold,cold,cached,sibling,sibling-cold",
                        help="kinds of the runs a, b, c... (cold, cached, sibling, sibling-cold; a fills the cache)")
    parser.add_argument("--sibling", default="cpu-x86_64-bf16", help="the sibling SKU of the sibling runs")
    parser.add_argument("--base", choices=("bootstrap", "load"), default="bootstrap")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "reproducible.json")
    args = parser.parse_args()
    kinds = args.runs.split(",")
    results: dict = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
                     "runs": kinds, "base": args.base, "skus": {}}
    if args.out.exists():
        results["skus"] = json.loads(args.out.read_text()).get("skus", {})
    with tempfile.TemporaryDirectory(prefix="skupin-repro-") as tmp:
        work = Path(tmp)
        registry = LocalRegistry(addr=f"127.0.0.1:{_free_port()}", folder=work / "registry")
        registry_up(registry=registry)
        try:
            for sku in args.sku or ["cpu-x86_64"]:
                cache_ref = f"{registry.addr}/cache/{sku}:buildcache"
                runs = []
                for i, kind in enumerate(kinds):
                    name = "abcdefgh"[i]
                    print(f"{sku}: run {name} ({kind})", file=sys.stderr, flush=True)
                    runs.append(run_once(sku=sku, name=name, kind=kind, work=work, registry=registry, base=args.base,
                                         cache_ref=cache_ref, wheel_store=REPO / ".skupin" / "wheels",
                                         sibling=args.sibling))
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
                results["skus"][sku] = summarise(runs)
        finally:
            registry_down(registry=registry)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(results, indent=2, sort_keys=True))
    return 0 if all(s["same_digest"] and s.get("sibling_same_digest") is not False
                    for s in results["skus"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
