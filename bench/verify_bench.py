"""Benchmark: `skupin verify` end to end against a real local registry, as an operator runs it (target <= 1 s warm).

Run from the repository root:  python bench/verify_bench.py [--runs 7] [--python .venv/bin/python] [--out FILE]

Starts Debian's `docker-registry` on a free loopback port (no Docker engine needed), stores a tiny image and, as
`publish` stores them, a signed verification attestation and a signed CycloneDX SBOM of a CPU-image-sized inventory
(150 Python distributions, 150 Debian packages) next to it; then times `python -m skupin verify
HOST/cpu-x86_64:verified --key PUB --sbom-out FILE` as a subprocess from an empty folder (no catalog: the operator
path), `--runs` times after one warm-up run, and `python -X importtime`'s view of what the verify path imports. The
predicate is the unit tests' honest one (tests/unit/test_attest.py), published now. Writes JSON to --out when given.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.unit.test_attest: the honest predicate
HEAVY = ("rfc3987_syntax", "lark", "jsonschema", "cyclonedx", "numpy", "docker", "matplotlib")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _registry(folder: Path) -> tuple[subprocess.Popen, str]:
    addr = f"127.0.0.1:{_free_port()}"
    config = folder / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n"
                      f"    rootdirectory: {folder / 'data'}\nhttp:\n  addr: {addr}\n", encoding="utf-8")
    binary = shutil.which("docker-registry")
    if binary is None:
        sys.exit("docker-registry is not installed (apt-get install docker-registry)")
    proc = subprocess.Popen([binary, "serve", str(config)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(tuple(addr.split(":")), timeout=0.2).close()  # type: ignore[arg-type]
            return proc, addr
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    sys.exit("the registry did not start")


def _store(addr: str, pub: Path) -> None:
    """A tiny image under cpu-x86_64:verified and its attestation artifact, as publish stores them."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from skupin.clients.oci import RegistryClient, sha256_digest
    from skupin.common.model import canonical_json
    from skupin.publishing.attest import BOM_PREDICATE_TYPE, Signer, bom_statement, statement
    from skupin.publishing.publish import attestation_artifact, attestation_tag
    from skupin.publishing.sbom import DebianPackage, ImageInventory, PythonDistribution, build_bom
    from tests.unit.test_attest import predicate

    signer = Signer(ec.generate_private_key(ec.SECP256R1()))
    pub.write_bytes(signer.key.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    repo, oci_manifest = "cpu-x86_64", "application/vnd.oci.image.manifest.v1+json"
    with RegistryClient(f"http://{addr}") as client:
        layer = b"not really a layer"
        config = canonical_json({"architecture": "amd64", "os": "linux",
                                 "rootfs": {"type": "layers", "diff_ids": [sha256_digest(layer)]}})
        for blob in (config, layer):
            client.push_blob(repo, blob)
        body = canonical_json({"schemaVersion": 2, "mediaType": oci_manifest,
                               "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                          "digest": sha256_digest(config), "size": len(config)},
                               "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                           "digest": sha256_digest(layer), "size": len(layer)}]})
        digest = client.put_manifest(repo, "verified", body, oci_manifest)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        verdict = signer.sign_statement(statement(repository=repo, digest=digest,
                                                  predicate=predicate(image_id=sha256_digest(config), published=now,
                                                                      gate_created=now)))
        site = "opt/skupin/venv/lib/python3.11/site-packages"
        inventory = ImageInventory(
            python=tuple(PythonDistribution(name=f"dist{n}", version=f"1.{n}.0", path=f"{site}/dist{n}-1.{n}.0.dist-info",
                                            vendored=False)
                         for n in range(150)),
            debian=tuple(DebianPackage(name=f"pkg{n}", version=f"2.{n}-1", arch="amd64") for n in range(150)),
            os_id="debian", os_version="12")
        from skupin.builder.catalog.lockfile import Lock, LockedBase
        lock = Lock(sku="cpu-x86_64", manifest_sha256="a" * 64, python="3.11", platform="linux/amd64",
                    base=LockedBase(kind="bootstrap", reference="skupin-base/x:1", recipe_sha256="b" * 64),
                    layers={"framework": (), "compiler": (), "engine": (), "extras": ()}, resolver="none",
                    tool_version="0.1.0", created=now)
        bom = build_bom(inventory, registry=addr, repository=repo, digest=digest, image_id=sha256_digest(config),
                        lock=lock, timestamp=now, sku=repo)
        sbom = signer.sign_statement(bom_statement(repository=repo, digest=digest, bom=bom))
        subject = client.get_manifest(repo, digest)
        art = attestation_artifact(envelope=verdict, subject=subject, more=((sbom, BOM_PREDICATE_TYPE),))
        for blob in (art.config, *art.layers):
            client.push_blob(repo, blob)
        client.put_manifest(repo, attestation_tag(digest), art.manifest, oci_manifest)


def _time(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run; CPU time is what a busy host changes least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-1500:]}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs skupin (its tree: PYTHONPATH)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "empty").mkdir()
        proc, addr = _registry(work)
        try:
            _store(addr, work / "signer.pub")
            env = {**os.environ, "HOME": str(work), "SKUPIN_STATE": str(work / "state")}
            env.pop("SKUPIN_ROOT", None)
            env.pop("PYTHONDONTWRITEBYTECODE", None)  # warm means compiled: the warm-up run writes the bytecode
            verify = [args.python, "-m", "skupin", "verify", f"{addr}/cpu-x86_64:verified", "--key",
                      str(work / "signer.pub"), "--sbom-out", str(work / "bom.json")]
            _time(verify, cwd=work / "empty", env=env)  # warm: bytecode compiled, page cache filled
            runs = [_time(verify, cwd=work / "empty", env=env) for _ in range(args.runs)]
            helps = [_time([args.python, "-m", "skupin", "verify", "--help"], cwd=work / "empty", env=env)
                     for _ in range(args.runs)]
            probe = subprocess.run([args.python, "-c", "import sys, skupin.cli.publish, skupin.publishing.verify; "
                                    f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"],
                                   cwd=work / "empty", env=env, capture_output=True, text=True, check=True)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    result = {"runs": len(runs), "verify_wall_s": _stats([w for w, _ in runs]), "verify_cpu_s": _stats([c for _, c in runs]),
              "verify_help_wall_s": _stats([w for w, _ in helps]), "verify_help_cpu_s": _stats([c for _, c in helps]),
              "heavy_modules_imported": probe.stdout.split(), "cpus": os.cpu_count(),
              "load_average_1m": round(os.getloadavg()[0], 2), "python": sys.version.split()[0]}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
