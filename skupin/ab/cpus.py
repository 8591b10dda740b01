"""Where the A/B's processes run (`skupin ab --server-cpus`): by default every CPU shared; on request the servers on
CPUs of their own and the measuring client on the rest.

Shared (the default, no plan): both server containers get the gate's CFS quota (the host's CPUs - 0.5) on every CPU,
beside the client that times them. Pinned (a plan): each server container runs on the server CPUs as a cpuset (no
quota: the CPUs are the limit; an engine's thread count is the SKU's, e.g. its OMP_NUM_THREADS) and every thread of
this process on the client CPUs, for the rounds only. After boot each server's process must show the plan's CPUs, or
the A/B stops (a daemon without the cpuset controller drops a cpuset with a mere warning). Only one server runs at a
time (the other is paused), so both sides get the same CPUs. "Their own" is not isolcpus: the daemon, its shims and
the kernel still run there, and on a host with SMT the upper half of the CPUs may be the lower half's siblings.

Measured on a 2-CPU host (docs/BENCHMARKS.md, "Where the noise comes from"), pinning left the noise as it was (or
worse) and the speed within it: that noise is the server's own work per token, which its CPU-seconds per token show
moving as much as its speed. So sharing stays the default, and pinning is
there for hosts where the client's load would otherwise land on the server's CPUs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic import Field

from skupin.common.errors import ManifestError
from skupin.common.model import Frozen

AUTO = "auto"
SHARED = "shared"


class CpuPlan(Frozen):
    """The servers' CPUs and the client's, disjoint."""

    server: tuple[int, ...] = Field(min_length=1, description="CPUs each server container runs on (its cpuset)")
    client: tuple[int, ...] = Field(min_length=1, description="CPUs this process's threads run on during the rounds")

    def cpuset(self) -> str:
        """The server CPUs as Docker's cpuset_cpus takes them ("1", "2,3")."""
        return ",".join(map(str, self.server))

    def describe(self) -> str:
        return (f"each server pinned to CPU{'s' if len(self.server) > 1 else ''} {self.cpuset()} (a cpuset, no CFS "
                f"quota), the measuring client to CPU{'s' if len(self.client) > 1 else ''} "
                f"{','.join(map(str, self.client))}")


def parse_cpu_list(text: str, *, flag: str = "--server-cpus") -> tuple[int, ...]:
    """'1', '0-3', '2,5-7' -> sorted CPU numbers; ManifestError naming `flag` for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not _number(low) or (dash and not _number(high)):
            raise ManifestError(f"{flag} {text!r}: {part!r} is not a CPU number or range (e.g. 1, 0-3, 2,5-7); "
                                f"or give {SHARED} or {AUTO}")
        first, last = int(low), int(high) if high else int(low)
        if last < first or last - first > 4096:
            raise ManifestError(f"{flag} {text!r}: the range {part!r} is empty or too long")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def cpus_of(pid: int) -> tuple[int, ...] | None:
    """The CPUs process `pid` may run on (its affinity, as allowed_cpus reads this process's); None where that cannot
    be read (a process of another host's daemon)."""
    try:
        return tuple(sorted(os.sched_getaffinity(int(pid))))
    except (OSError, ValueError):
        return None


def plan_cpus(spec: str, allowed: Sequence[int], *, flag: str = "--server-cpus") -> CpuPlan | None:
    """The plan `spec` asks for on a host whose usable CPUs are `allowed` (this process's affinity).

    `shared`: no plan (the gate's quota, every CPU shared). `auto`: the upper half of the allowed CPUs (at least one)
    for the servers, the rest for the client; `shared` on a host with a single CPU. A CPU list: those for the servers,
    every other allowed CPU for the client; each must be allowed and at least one must be left."""
    usable = tuple(sorted(allowed))
    if spec == SHARED:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ManifestError(f"{flag} {spec!r}: this platform cannot pin threads to CPUs; give {SHARED}")
    if spec == AUTO:
        if len(usable) < 2:
            return None
        half = max(1, len(usable) // 2)
        return CpuPlan(server=usable[-half:], client=usable[:-half])
    server = parse_cpu_list(spec, flag=flag)
    outside = [c for c in server if c not in usable]
    if outside:
        raise ManifestError(f"{flag} {spec!r}: CPUs {','.join(map(str, outside))} are not among those this process may use "
                            f"(allowed: {','.join(map(str, usable))})")
    client = tuple(c for c in usable if c not in server)
    if not client:
        raise ManifestError(f"{flag} {spec!r} leaves no CPU for the measuring client (allowed: "
                            f"{','.join(map(str, usable))}); name fewer, or give {SHARED}")
    return CpuPlan(server=server, client=client)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may use; every CPU where the platform has no affinity (then only `shared` can run)."""
    if not hasattr(os, "sched_getaffinity"):
        return tuple(range(os.cpu_count() or 1))
    return tuple(sorted(os.sched_getaffinity(0)))


@contextlib.contextmanager
def client_pinned(cpus: Sequence[int] | None) -> Iterator[None]:
    """Every thread of this process (and every thread they start) on `cpus` for the block; afterwards each thread's own
    mask back, and a thread started meanwhile gets the mask of the thread that entered. None: nothing changes."""
    if cpus is None:
        yield
        return
    entered = os.sched_getaffinity(0)
    before: dict[int, set[int]] = {}
    try:
        for tid in _threads():
            try:
                before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, set(cpus))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
        yield
    finally:
        for tid in _threads():
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.sched_setaffinity(tid, before.get(tid, entered))


def _threads() -> list[int]:
    """This process's thread ids (Linux: /proc/self/task); just this thread where that is not there."""
    try:
        return sorted(int(p.name) for p in Path("/proc/self/task").iterdir() if p.name.isdigit())
    except OSError:
        return [0]
