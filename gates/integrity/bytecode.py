"""Verify an image's bytecode on the host: skupin/imagetools/pyc_verify.py under an interpreter byte-identical to the image's.

`bytecode_verifier(cache=...)` returns the ``verify_bytecode`` callable gates/integrity/static.py needs.
It finds a host interpreter whose file has the md5 of the image's own interpreter (same build,
same compiler: Debian's python3.11 of the same version, say), skips bytecode already verified
(cached by interpreter, path, optimization and both files' sha256), and streams the rest to
worker processes that run as nobody with memory, CPU and file limits, since they unmarshal bytes
an image under test wrote. All of them are killed at a deadline (the bytecode is then unverifiable);
their stderr is drained as they run and their stdout is parsed as hostile. Without an identical
interpreter the bytecode is "unverifiable" (the gate cannot run) and the reason names the package
to install.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import resource
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from skupin import imagetools
from skupin.common.untrusted import UntrustedInputError
from skupin.imageview.layers import FileView

if TYPE_CHECKING:
    from collections.abc import Callable

TOOL = Path(imagetools.__file__).with_name("pyc_verify.py")
NOBODY = 65534
WORKER_MEMORY = 4 * 1024**3
WORKER_CPU_S = 3600
DEADLINE_S = 1800  # all workers together; the CPU image's 9,888 files take 22 s on 2 cores
STDERR_KEEP = 4096  # the last bytes of a worker's stderr kept for the reason
MAX_LINE = 64 * 1024  # a worker's result line
MAX_WHY = 2000


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


def worker_command(interpreter: str) -> list[str]:
    """The worker's command line: isolated, no site, no bytecode written, and no warnings (Python 3.12's compile()
    prints a SyntaxWarning per invalid escape sequence; they say nothing about the bytecode)."""
    return [interpreter, "-I", "-S", "-B", "-W", "ignore", "-c", TOOL.read_text(encoding="utf-8")]


class VerifierTimedOut(Exception):
    """The workers did not finish within the deadline (they were killed): the bytecode is unverifiable, not failed."""


def run_workers(interpreter: str, jobs: list[tuple[int, str, int, bytes, bytes]], *, workers: int,
                deadline_s: float | None = None) -> dict[int, str]:
    """id -> '' (verified) or why not, for every job, over `workers` sandboxed processes.

    Every worker is killed at `deadline_s` (default `DEADLINE_S`), which raises `VerifierTimedOut`.
    """
    deadline_s = DEADLINE_S if deadline_s is None else deadline_s
    shards = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    with contextlib.ExitStack() as scope:  # every worker's pipes closed and process waited for, however it ends
        procs = [scope.enter_context(subprocess.Popen(
            worker_command(interpreter), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={}, cwd="/", close_fds=True, preexec_fn=_limit_worker))
            for _ in shards]
        expired = threading.Event()

        def kill_all() -> None:
            expired.set()
            for proc in procs:
                with contextlib.suppress(OSError):
                    proc.kill()

        watchdog = threading.Timer(deadline_s, kill_all)
        watchdog.daemon = True
        scope.callback(watchdog.cancel)
        scope.callback(_kill_alive, procs)  # an exception on the way out leaves no worker behind
        watchdog.start()
        results = _collect(procs, shards)
        if expired.is_set():
            raise VerifierTimedOut(f"the bytecode verifier did not finish within {deadline_s:g} s "
                                   f"({len(jobs)} files over {len(shards)} workers); its workers were killed")
        return results


def _kill_alive(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()


def _drain(stream: IO[bytes], keep: int) -> tuple[bytearray, threading.Thread]:
    """Read `stream` to its end on a thread, keeping only its last `keep` bytes (a worker's stderr never fills its pipe)."""
    assert isinstance(stream, io.BufferedIOBase)  # a Popen pipe (buffered): read1 returns what one read gives
    tail = bytearray()

    def run() -> None:
        with contextlib.suppress(OSError, ValueError):
            for chunk in iter(lambda: stream.read1(1 << 16), b""):
                tail.extend(chunk)
                del tail[:-keep]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return tail, thread


def _result(line: bytes, pending: set[int]) -> tuple[int, str] | None:
    """(id, '' or why) of one result line for a file still pending in this worker's shard, or None for anything else."""
    if not line.endswith(b"\n"):
        return None  # over the line limit, or cut short
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("ok"), bool) or type(row.get("id")) is not int:
        return None
    if row["id"] not in pending or not isinstance(row.get("why", ""), str):
        return None
    return row["id"], "" if row["ok"] else str(row.get("why") or "rejected")[:MAX_WHY]


def _collect(procs: list[subprocess.Popen], shards: list[list]) -> dict[int, str]:
    """Feed each worker its shard on a thread and read its results; a worker that stops, or prints anything but a
    result for a file of its own shard, fails what it had left (its output is as hostile as the bytes it unmarshals)."""
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
    stderrs = []
    for proc in procs:
        assert proc.stderr is not None
        stderrs.append(_drain(proc.stderr, STDERR_KEEP))
    for proc, shard, (err, drainer) in zip(procs, shards, stderrs, strict=True):
        assert proc.stdout is not None
        pending = {number for number, *_ in shard}
        why_stopped = None
        while pending:
            line = proc.stdout.readline(MAX_LINE)
            if not line:
                break
            got = _result(line, pending)
            if got is None:
                why_stopped = f"the verifier printed something that is not a result ({line[:80]!r})"
                proc.kill()
                break
            pending.discard(got[0])
            results[got[0]] = got[1]
        proc.wait()
        drainer.join(timeout=5)
        text = bytes(err).decode("utf-8", "replace").strip()[-500:]
        why_stopped = why_stopped or f"the verifier stopped ({text or f'exit {proc.returncode}'})"
        for number in pending:
            results[number] = why_stopped
    for thread in feeders:
        thread.join()
    return results


def bytecode_verifier(
    *, cache: Path | None, workers: int | None = None
) -> Callable[[list[Any], FileView, str, str | None], tuple[list[str], list[str], str | None]]:
    """The ``verify_bytecode(pycs, view, interpreter, version)`` of gates/integrity/static.py."""
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
        except VerifierTimedOut as exc:
            return [], [str(exc)], None
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
