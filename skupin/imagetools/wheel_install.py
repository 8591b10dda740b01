#!/usr/bin/env python3
"""Install a locked build step's wheels, hash-checked, without a resolver or a network, then compile them.

Runs inside the image being built (every locked pip step of a rendered Dockerfile), with the
image's own Python. It is bind-mounted from the build context together with bytecode.py and the
pure-Python package of pypa `installer` (the reference implementation of the wheel format), and
never lands in the image.

    python3 wheel_install.py --wheels DIR [--keep FILE] [--lazy REGEX] [--cache DIR] [--jobs N] [--prefix P] REQUIREMENTS

REQUIREMENTS holds one `name==version --hash=sha256:HEX` line per distribution (what
`pip install --require-hashes --no-deps -r` accepts too). DIR must hold exactly those wheels: the
host fetched them into its wheel store, checked each against the lock, and linked them into the
build context. Here every wheel is hashed again and must match its line; a missing, extra or
different file stops the step before anything is installed. A distribution already present
(the venv's own setuptools) is removed first, by its RECORD, as pip would. Each wheel is then
unpacked into the interpreter's scheme (or the one of --prefix) with INSTALLER `skupin`; each
Python file is handed to bytecode.py (cache, lazy paths: see there) as soon as it is written, in
--jobs - 1 worker processes, so compiling overlaps unpacking. With --keep, the requirements file
is copied to FILE (the image's record of what the step installed) once everything is installed.

Compared with `pip install`, this saves pip's start-up (~0.6 s per step on a 2-CPU builder),
its index handling and its network: a point release of the engine re-runs one such step.
Exit status: 0 installed, 2 bad arguments or requirements, 3 wheels do not match, 4 install error.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bytecode.py and installer/ sit next to this file

import bytecode  # noqa: E402 - after the path it is found on
from installer.utils import canonicalize_name, parse_wheel_filename  # noqa: E402

REQ_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)\s+--hash=sha256:([0-9a-f]{64})$")
INSTALLER_NAME = b"skupin\n"
BATCH = 32  # files per compile task


class StepError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def parse_requirements(path: Path) -> list[tuple[str, str, str]]:
    """(name, version, sha256) per line; blank lines and # comments are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise StepError(f"{path}: {exc}", 2) from exc
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = REQ_LINE.match(line)
        if not m:
            raise StepError(f"{path}:{number}: not `name==version --hash=sha256:HEX`: {raw.strip()!r}", 2)
        out.append((m.group(1), m.group(2), m.group(3)))
    if not out:
        raise StepError(f"{path}: no requirements", 2)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def match_wheels(requirements: list[tuple[str, str, str]], folder: Path) -> list[tuple[str, str, Path]]:
    """(name, version, wheel) per requirement, in order; every file in `folder` must be used once."""
    try:
        files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    except OSError as exc:
        raise StepError(f"--wheels {folder}: {exc}", 2) from exc
    by_hash = {_sha256(p): p for p in files}
    out, problems = [], []
    for name, version, sha in requirements:
        wheel = by_hash.pop(sha, None)
        if wheel is None:
            problems.append(f"{name}=={version}: no wheel in {folder} has sha256 {sha}")
            continue
        try:
            parsed = parse_wheel_filename(wheel.name)
        except ValueError:
            parsed = None
        if parsed is None or canonicalize_name(parsed.distribution) != canonicalize_name(name) or parsed.version != version.replace("-", "_"):
            problems.append(f"{name}=={version}: its hash names {wheel.name}, which is not a wheel of {name} {version}")
            continue
        out.append((name, version, wheel))
    problems += [f"{p.name}: in {folder} but not in the requirements" for p in by_hash.values()]
    if problems:
        raise StepError("wheels do not match the locked requirements:\n  " + "\n  ".join(problems), 3)
    return out


def scheme(prefix: str | None) -> dict[str, str]:
    """Install paths of this interpreter (its venv), or of another prefix laid out the same way."""
    vars_ = {"base": prefix, "platbase": prefix} if prefix else None
    paths = sysconfig.get_paths(vars=vars_)
    paths["headers"] = os.path.join(paths["include"], "site")
    return paths


def uninstall(name: str, site: Path) -> str | None:
    """Remove an installed distribution by its RECORD (files under `site`'s prefix only); its version."""
    prefix = site.parents[2] if len(site.parents) > 2 else site
    for info in sorted(site.glob("*.dist-info")):
        dist, _, version = info.name[: -len(".dist-info")].partition("-")
        if canonicalize_name(dist) != canonicalize_name(name):
            continue
        folders: set[Path] = set()
        record = info / "RECORD"
        rows = []
        if record.is_file():
            with open(record, newline="", encoding="utf-8") as handle:
                rows = [row for row in csv.reader(handle) if row]
        for row in rows:
            target = Path(os.path.normpath(site / row[0]))
            if not target.is_relative_to(prefix) or target.is_relative_to(info):
                continue
            pyc = Path(importlib.util.cache_from_source(str(target))) if target.suffix == ".py" else None
            for path in (target, pyc):
                if path is not None and (path.is_file() or path.is_symlink()):
                    path.unlink()
                    folders.add(path.parent)
        shutil.rmtree(info, ignore_errors=True)
        for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
            while folder.is_relative_to(site) and folder != site:
                try:
                    folder.rmdir()  # only when empty
                except OSError:
                    break
                folder = folder.parent
        return version
    return None


class Compiler:
    """Compiles each Python file as soon as it is written, over `jobs` worker processes, so that
    bytecode (mostly cache hits after a point release) overlaps the unpacking of the rest."""

    def __init__(self, *, cache: Path | None, jobs: int, lazy: re.Pattern[str] | None) -> None:
        self.cache = str(cache) if cache else None
        self.lazy = lazy
        self.pending: list = []
        self.batch: list[str] = []
        self.pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 0 else None

    def add(self, path: str) -> None:
        if path.endswith(".py") and not (self.lazy and self.lazy.search(path)):
            self.batch.append(path)
            if len(self.batch) >= BATCH:
                self._flush()

    def _flush(self) -> None:
        if not self.batch:
            return
        if self.pool is None:
            self.pending.append(bytecode._compile_batch((self.batch, self.cache)))
        else:
            self.pending.append(self.pool.submit(bytecode._compile_batch, (self.batch, self.cache)))
        self.batch = []

    def finish(self) -> dict[str, int]:
        """Wait for every file; outcome counts (hit, compiled, failed)."""
        self._flush()
        counts = {"hit": 0, "compiled": 0, "failed": 0}
        try:
            for item in self.pending:
                for outcome in item if isinstance(item, list) else item.result():
                    counts[outcome] += 1
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)
        return counts


def clamp_mtimes(roots: list[Path], epoch: int) -> int:
    """Set every file, folder and link under `roots` (and each root) newer than `epoch` to `epoch`; how many."""
    count = 0
    for root in roots:
        if not os.path.lexists(root):
            continue
        entries = [str(root)]
        for folder, dirs, files in os.walk(root):
            entries += [os.path.join(folder, name) for name in dirs + files]
        for entry in entries:
            if os.lstat(entry).st_mtime > epoch:
                os.utime(entry, (epoch, epoch), follow_symlinks=False)
                count += 1
    return count


def install(wheels: list[tuple[str, str, Path]], *, prefix: str | None, compiler: Compiler | None = None,
            mtime: int | None = None) -> None:
    """Install each wheel with pypa installer, handing each written file to `compiler` (its mtime set to `mtime`
    first when given, so the pyc's header, which records the source's mtime, is the same in every build)."""
    from installer import install as install_wheel
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    class Destination(SchemeDictionaryDestination):
        def write_to_fs(self, scheme, path, stream, is_executable):
            entry = super().write_to_fs(scheme, path, stream, is_executable)
            if mtime is not None:
                os.utime(self._path_with_destdir(scheme, path), (mtime, mtime))
            if compiler is not None:
                compiler.add(self._path_with_destdir(scheme, path))
            return entry

    paths = scheme(prefix)
    site = Path(paths["purelib"])
    interpreter = os.path.join(paths["scripts"], "python") if prefix else sys.executable
    for name, version, wheel in wheels:
        replaced = uninstall(name, site)
        if replaced is not None:
            print(f"replaced {name} {replaced}")
        destination = Destination(scheme_dict=paths, interpreter=interpreter, script_kind="posix", bytecode_optimization_levels=())
        try:
            with WheelFile.open(wheel) as source:
                install_wheel(source, destination, {"INSTALLER": INSTALLER_NAME})
        except Exception as exc:  # noqa: BLE001 - installer raises several types: name the wheel
            raise StepError(f"{wheel.name}: cannot install: {type(exc).__name__}: {exc}", 4) from exc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requirements", type=Path, help="the step's locked requirements (name==version --hash=sha256:HEX)")
    ap.add_argument("--wheels", type=Path, required=True, help="folder holding exactly the step's wheels")
    ap.add_argument("--keep", type=Path, default=None, help="after installing, copy REQUIREMENTS to this file")
    ap.add_argument("--lazy", default=None, help="regex (Python syntax) of paths left to compile at import time")
    ap.add_argument("--cache", type=Path, default=None, help="bytecode cache kept between builds (see bytecode.py)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: all CPUs)")
    ap.add_argument("--prefix", default=None, help="install into this prefix instead of the running interpreter's")
    ap.add_argument("--mtime", type=int, default=None, metavar="EPOCH",
                    help="SOURCE_DATE_EPOCH: installed files get this mtime, and everything newer under the prefix and "
                         "--keep is clamped to it after compiling (the same wheels, the same layer bytes)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    try:
        lazy = re.compile(args.lazy) if args.lazy else None
    except re.error as exc:
        print(f"wheel_install.py: --lazy: {exc}", file=sys.stderr)
        return 2
    cache = args.cache
    if cache is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError:
            cache = None
    # One CPU unpacks; the others compile what it wrote (on one CPU, compile in this process).
    jobs = max(1, args.jobs)
    compiler = Compiler(cache=cache, jobs=jobs - 1 if jobs > 1 else 0, lazy=lazy)
    try:
        wheels = match_wheels(parse_requirements(args.requirements), args.wheels)
        install(wheels, prefix=args.prefix, compiler=compiler, mtime=args.mtime)
        installed_s = time.monotonic() - start
        counts = compiler.finish()
        if args.keep is not None:
            args.keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.requirements, args.keep)
        if args.mtime is not None:
            roots = [Path(args.prefix or sys.prefix)] + ([args.keep.parent] if args.keep is not None else [])
            clamp_mtimes(roots, args.mtime)
    except StepError as exc:
        compiler.finish()
        print(f"wheel_install.py: {exc}", file=sys.stderr)
        return exc.code
    names = ", ".join(f"{n}=={v}" for n, v, _ in wheels[:6]) + (f" and {len(wheels) - 6} more" if len(wheels) > 6 else "")
    print(f"installed {len(wheels)} wheel(s) in {installed_s:.1f} s: {names}")
    print(f"bytecode: {sum(counts.values())} new files: {counts['hit']} from the cache, {counts['compiled']} compiled, "
          f"{counts['failed']} left without bytecode ({time.monotonic() - start:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
