#!/usr/bin/env python3
"""Compile the bytecode of the Python files a build step just installed, reusing earlier builds' work.

Runs inside the image being built (a pip step of every rendered Dockerfile, after
`pip install --no-compile`), with the image's own Python, so it needs only the standard library
and nothing from skupin. It is bind-mounted from the build context and never lands in the image.

    python3 bytecode.py --since STAMP [--lazy REGEX] [--cache DIR] [--jobs N] ROOT...

compiles every `*.py` that the pip step just installed under each ROOT (the files named by the
RECORD of each distribution installed after the file STAMP; the ROOTs are walked when there is
none) and that was modified after STAMP, except paths matching REGEX (per-architecture model modules that a container imports only
for the model it serves; Python compiles those in memory on import), into the standard
`__pycache__/<name>.cpython-XY.pyc` files pip itself would write (timestamp-checked pycs).

DIR is a content-addressed cache, kept between builds by a BuildKit cache mount: the code
object of a file depends only on the interpreter (its magic number), the file's path (compiled
into the code) and the file's bytes, so it is stored under the sha256 of those three and reused
by any later build that installs the same file at the same path; only the 16-byte header (the
source's mtime and size) is written fresh. After a point release most of a package's files are
unchanged and only the changed ones are compiled. A file that does not compile (test data, code
for another Python) gets no pyc, as with pip. Prints one summary line; exit status 0 unless the
arguments are wrong.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import marshal
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MAGIC = importlib.util.MAGIC_NUMBER


def new_sources(roots: list[Path], *, since_ns: int, lazy: re.Pattern[str] | None) -> list[Path]:
    """Every *.py the step installed under the roots and not matched by `lazy`, sorted. The files
    come from the RECORD of each distribution installed after `since_ns` (a torch-sized venv is
    not walked); without any such RECORD the roots are walked for files modified after it."""
    found: set[str] = set()
    records = [r for root in roots for r in _new_records(root, since_ns)]
    walked = not records
    if records:
        for site, record in records:
            try:
                with open(record, newline="", encoding="utf-8") as handle:
                    rows = list(csv.reader(handle))
            except (OSError, UnicodeDecodeError, csv.Error):
                continue
            for row in rows:
                if row and row[0].endswith(".py"):
                    found.add(os.path.normpath(os.path.join(site, row[0])))
    else:
        found.update(_walk(roots))
    out = []
    for path in sorted(found):
        try:
            st = os.stat(path)
        except OSError:
            continue
        # A file named by a new RECORD is this step's even if an installer kept the wheel's mtimes.
        if (st.st_mtime_ns > since_ns or not walked) and not (lazy and lazy.search(path)):
            out.append(Path(path))
    return out


def _new_records(root: Path, since_ns: int) -> list[tuple[str, str]]:
    """(site dir, RECORD path) of every *.dist-info created after `since_ns` in root's site dirs."""
    out = []
    sites = dict.fromkeys(os.path.realpath(s) for s in [root, *sorted(root.glob("lib*/python*/site-packages"))])
    for site in sites:  # a venv's lib64 is a link to lib: each real folder once
        try:
            entries = list(os.scandir(site))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(".dist-info") and entry.is_dir() and entry.stat().st_mtime_ns > since_ns:
                record = os.path.join(entry.path, "RECORD")
                if os.path.isfile(record):
                    out.append((str(site), record))
    return out


def _walk(roots: list[Path]) -> list[str]:
    found: list[str] = []
    stack = [str(r) for r in roots]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    stack.append(entry.path)
            elif entry.name.endswith(".py") and entry.is_file(follow_symlinks=False):
                found.append(entry.path)
    return found


def cache_key(path: Path, source: bytes) -> str:
    digest = hashlib.sha256(MAGIC)
    digest.update(os.fsencode(str(path)) + b"\0")
    digest.update(source)
    return digest.hexdigest()


def _header(st: os.stat_result) -> bytes:
    return MAGIC + (0).to_bytes(4, "little") + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")


def _write(target: Path, data: bytes) -> None:
    """Write a pyc in place: it lands in a layer under construction that nothing reads yet
    (a failed step discards the layer), so the temp-file-and-rename of the cache is not needed."""
    try:
        handle = open(target, "wb")
    except FileNotFoundError:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = open(target, "wb")
    with handle:
        handle.write(data)


def _write_atomic(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compile_one(path: Path, cache: Path | None) -> str:
    """Write the pyc of one source: 'hit' (body from the cache), 'compiled', or 'failed'."""
    try:
        source = path.read_bytes()
        st = path.stat()
    except OSError:
        return "failed"
    pyc = Path(importlib.util.cache_from_source(str(path)))
    entry = None
    if cache is not None:
        key = cache_key(path, source)
        entry = cache / key[:2] / key
        try:
            body = entry.read_bytes()
            marshal.loads(body)  # a truncated or foreign entry is recompiled, never written out
            _write(pyc, _header(st) + body)
            return "hit"
        except (OSError, EOFError, ValueError, TypeError):
            pass
    try:
        code = compile(source, str(path), "exec", dont_inherit=True)
    except Exception:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), RecursionError...: no pyc, as with pip
        return "failed"
    body = marshal.dumps(code)
    _write(pyc, _header(st) + body)
    if entry is not None:
        try:
            _write_atomic(entry, body)
        except OSError:
            pass  # a full or read-only cache costs only the reuse
    return "compiled"


def _compile_batch(args: tuple[list[str], str | None]) -> list[str]:
    paths, cache = args
    return [compile_one(Path(p), Path(cache) if cache else None) for p in paths]


def compile_sources(paths: list[Path], *, cache: Path | None, jobs: int) -> dict[str, int]:
    """Compile `paths` (cache hits in this process, misses over `jobs` processes); counts by outcome."""
    counts = {"hit": 0, "compiled": 0, "failed": 0}
    if not paths:
        return counts
    if jobs <= 1 or len(paths) < 64:
        for p in paths:
            counts[compile_one(p, cache)] += 1
        return counts
    size = max(16, len(paths) // (jobs * 4))
    batches = [([str(p) for p in paths[i:i + size]], str(cache) if cache else None) for i in range(0, len(paths), size)]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for outcomes in pool.map(_compile_batch, batches):
            for outcome in outcomes:
                counts[outcome] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+", type=Path, help="folders to search (the image's venv)")
    ap.add_argument("--since", type=Path, required=True, help="compile only files modified after this file's mtime")
    ap.add_argument("--lazy", default=None, help="regex (Python syntax) of paths left to compile at import time")
    ap.add_argument("--cache", type=Path, default=None, help="content-addressed code cache kept between builds")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: all CPUs)")
    args = ap.parse_args(argv)
    try:
        since_ns = args.since.stat().st_mtime_ns
        lazy = re.compile(args.lazy) if args.lazy else None
    except (OSError, re.error) as exc:
        print(f"bytecode.py: {exc}", file=sys.stderr)
        return 2
    if args.cache is not None:
        try:
            args.cache.mkdir(parents=True, exist_ok=True)
        except OSError:
            args.cache = None
    paths = new_sources(args.roots, since_ns=since_ns, lazy=lazy)
    counts = compile_sources(paths, cache=args.cache, jobs=max(1, args.jobs))
    print(f"bytecode: {len(paths)} new files: {counts['hit']} from the cache, {counts['compiled']} compiled, "
          f"{counts['failed']} left without bytecode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
