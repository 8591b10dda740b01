"""Who made a sandbox container (pid, its start time, boot id, pid namespace), so leftovers of dead runs can be removed."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

from skupin.dockerd.specs import OWNER_BOOT_LABEL, OWNER_PID_LABEL, OWNER_PIDNS_LABEL, OWNER_START_LABEL, SANDBOX_LABEL


def _proc_stat(pid: int | str, proc: Path = Path("/proc")) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first), or None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()


def _start_time(pid: int | str, proc: Path = Path("/proc")) -> str:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), or ''."""
    fields = _proc_stat(pid, proc)
    return fields[19] if fields and len(fields) > 19 else ""


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_labels() -> dict[str, str]:
    """The labels naming this process as a container's owner: pid, its start time, boot id, pid namespace."""
    pid = os.getpid()
    return {SANDBOX_LABEL: "1", OWNER_PID_LABEL: str(pid), OWNER_START_LABEL: _start_time(pid),
            OWNER_BOOT_LABEL: boot_id(), OWNER_PIDNS_LABEL: pid_namespace()}


def owner_gone(labels: Mapping[str, str], *, boot_id: str, pid_namespace: str, proc: Path = Path("/proc")) -> str:
    """Why the process that made a container with `labels` is gone ('' while it lives or cannot be judged).

    Gone: it ran in another boot of this machine, or its pid no longer exists, is a zombie or now
    belongs to a process started at another time (reused). A container made in another pid
    namespace (another skupin in a container sharing this dockerd) cannot be judged and is left alone.
    """
    pid, start, boot = labels.get(OWNER_PID_LABEL, ""), labels.get(OWNER_START_LABEL, ""), labels.get(OWNER_BOOT_LABEL, "")
    if not (pid.isascii() and pid.isdigit() and start and boot):
        return ""
    if boot != boot_id:
        return f"its owner (pid {pid}) ran in another boot of this machine"
    if labels.get(OWNER_PIDNS_LABEL, "") != pid_namespace:
        return ""
    fields = _proc_stat(pid, proc)
    if fields is None or fields[0] == "Z":
        return f"its owner (pid {pid}) has exited"
    if len(fields) > 19 and fields[19] != start:
        return f"its owner's pid {pid} now belongs to another process"
    return ""
