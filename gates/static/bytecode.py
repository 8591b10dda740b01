"""Verify an image's bytecode on the host: imagetools/pyc_verify.py under an interpreter byte-identical to the image's.

`bytecode_verifier(cache=...)` returns the ``verify_bytecode`` callable gates/static/integrity.py needs.
It finds a host interpreter whose file has the md5 of the image's own interpreter (same build,
same compiler: Debian's python3.11 of the same version, say), skips bytecode already verified
(cached by interpreter, path, optimization and both files' sha256), and streams the rest to
worker processes that run as nobody with memory, CPU and file limits, since they unmarshal bytes
an image under test wrote. Without an identical interpreter the bytecode is "unverifiable" (the
gate cannot run) and the reason names the package to install.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import imagetools
from common.untrusted import UntrustedInputError
from gates.static.layers import FileView

TOOL = Path(imagetools.__file__).with_name("pyc_verify.py")
NOBODY = 65534
WORKER_MEMORY = 4 * 1024**3
WORKER_CPU_S = 3600


def file_md5(path: str) -> str | None:
    try:
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None


def _version_of(path: str) -> str | None:
    """'X.Y.Z' of a host interpreter (host binaries are trusted; they run isolated, without site)."""
    try:
        done = subprocess.run([path, "-I", "-S", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                              capture_output=True, text=True, timeout=20, check=False, env={})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def host_interpreter(view: FileView, interpreter: str, version: str | None) -> tuple[str | None, str]:
    """(host path, how it matches) of an interpreter that compiles like the image's, or (None, why there is none).

    Best: a file byte-identical to the image's interpreter. Else: the same upstream release
    (`version`, from the image's package records), whose compiler is the same; a compiler patch
    between two builds of one release would make genuine bytecode fail (never a false pass).
    """
    real = view.resolve(interpreter)
    entry = view.get(real) if real else None
    if entry is None or entry.kind != "f":
        return None, f"the image has no interpreter at /{interpreter}"
    name = Path(interpreter).name
    candidates = list(dict.fromkeys(p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}", shutil.which(name)) if p))
    for path in candidates:
        if file_md5(path) == entry.md5:
            return path, "byte-identical"
    for path in candidates:
        if version and _version_of(path) == version:
            return path, f"same release {version}"
    return None, (f"no interpreter on this host compiles like the image's /{real} ({name} {version or 'of unknown version'}: "
                  f"none is byte-identical or of the same release), so its bytecode cannot be recompiled and compared "
                  f"here; fix: install {name} {version or ''} on the gate host (Debian: apt-get install {name}-minimal)")


def _limit_worker() -> None:  # runs in the worker process before exec
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (WORKER_CPU_S, WORKER_CPU_S))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _frames(jobs: list[tuple[int, str, int, bytes, bytes]]) -> Iterator[bytes]:
    for number, dfile, opt, source, pyc in jobs:
        head = json.dumps({"id": number, "dfile": dfile, "opt": opt}).encode()
        yield len(head).to_bytes(4, "little") + head
        yield len(source).to_bytes(8, "little") + source
        yield len(pyc).to_bytes(8, "little") + pyc


def run_workers(interpreter: str, jobs: list[tuple[int, str, int, bytes, bytes]], *, workers: int) -> dict[int, str]:
    """id -> '' (verified) or why not, for every job, over `workers` sandboxed processes."""
    shards = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    with contextlib.ExitStack() as scope:  # every worker's pipes closed and process waited for, however it ends
        procs = [scope.enter_context(subprocess.Popen(
            [interpreter, "-I", "-S", "-B", "-c", TOOL.read_text(encoding="utf-8")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd="/", close_fds=True, preexec_fn=_limit_worker))
            for _ in shards]
        return _collect(procs, shards)


def _collect(procs: list[subprocess.Popen], shards: list[list]) -> dict[int, str]:
    """Feed each worker its shard on a thread and read its results; a worker that stops fails what it had left."""
    results: dict[int, str] = {}

    def feed(proc: subprocess.Popen, shard: list) -> None:
        assert proc.stdin is not None
        try:
            for frame in _frames(shard):
                proc.stdin.write(frame)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    feeders = [threading.Thread(target=feed, args=(p, s), daemon=True) for p, s in zip(procs, shards, strict=True)]
    for thread in feeders:
        thread.start()
    for proc, shard in zip(procs, shards, strict=True):
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            row = json.loads(line)
            results[int(row["id"])] = "" if row["ok"] else str(row["why"])
        err = proc.stderr.read().decode("utf-8", "replace")[-500:]
        proc.wait()
        for number, *_ in shard:
            results.setdefault(number, f"the verifier stopped ({err.strip() or f'exit {proc.returncode}'})")
    for thread in feeders:
        thread.join()
    return results


def bytecode_verifier(*, cache: Path | None, workers: int | None = None):
    """The ``verify_bytecode(pycs, view, interpreter, version)`` of gates/static/integrity.py."""
    def verify(pycs: list, view: FileView, interpreter: str, version: str | None) -> tuple[list[str], list[str], str | None]:
        host, how = host_interpreter(view, interpreter, version)
        if host is None:
            return [], [how], None
        md5 = file_md5(host) or ""
        done = _load_cache(cache, md5)
        keys, jobs, failures = {}, [], []
        for number, item in enumerate(pycs):
            p, s = view.get(item.pyc), view.get(item.real_source)
            assert p is not None and s is not None
            key = hashlib.sha256(f"{md5}\0/{item.source}\0{item.opt}\0{s.sha256}\0{p.sha256}".encode()).hexdigest()
            if key in done:
                continue
            keys[number] = key
            try:
                jobs.append((number, "/" + item.source, item.opt, view.read_file(item.real_source), view.read_file(item.pyc)))
            except UntrustedInputError as exc:
                failures.append(f"/{item.pyc}: cannot be read: {exc}")
        try:
            results = run_workers(host, jobs, workers=workers or max(1, min(4, os.cpu_count() or 1))) if jobs else {}
        except OSError as exc:
            return [], [f"the bytecode verifier could not start {host} as an unprivileged process: {exc}"], None
        _save_cache(cache, md5, [keys[n] for n, why in results.items() if not why])
        failures += [f"/{pycs[n].pyc}: {why}" for n, why in sorted(results.items()) if why]
        return failures, [], f"{host} ({how})"
    return verify


def _load_cache(cache: Path | None, md5: str) -> set[str]:
    if cache is None:
        return set()
    try:
        return set((cache / f"pyc-verified-{md5}.txt").read_text().split())
    except OSError:
        return set()


def _save_cache(cache: Path | None, md5: str, keys: list[str]) -> None:
    if cache is None or not keys:
        return
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"pyc-verified-{md5}.txt", "a", encoding="ascii") as handle:
        handle.write("\n".join(keys) + "\n")
