"""Run the default local OCI registry (Debian's docker-registry, distribution 2.8): up, down, status.

`skupin registry up` makes sure a registry answers on 127.0.0.1:5000 (by default): it installs
Debian's `docker-registry` package when the binary is absent, writes our own config file (loopback
only, filesystem storage in a known folder, deletes enabled), starts `docker-registry serve` in its
own session with a pid file and a log, and waits for `/v2/` to answer. A registry that already
answers there is never touched, ours or not; `down` stops only the process whose pid file we wrote
(checked against /proc/PID/cmdline), never one we did not start.

Layout of the folder (default `.skupin/registry`, or $SKUPIN_STATE/registry):

    config.yml      written by us on every `up`
    registry.pid    the pid of the registry we started
    registry.log    its stdout/stderr
    data/           the registry's storage (blobs, repositories, tags)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from skupin.clients.oci import RegistryClient
from skupin.common.apt import apt_install
from skupin.common.errors import NetworkError, PublishError
from skupin.common.model import Frozen
from skupin.common.paths import REGISTRY_ADDR, state_dir

DEFAULT_ADDR = REGISTRY_ADDR
BINARY = "docker-registry"
STARTED: list[subprocess.Popen] = []
APT_PACKAGE = "docker-registry"
OnEvent = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


class LocalRegistry(Frozen):
    """Where the local registry listens and keeps its files."""

    addr: str = Field(DEFAULT_ADDR, pattern=r"^(127\.[0-9.]+|localhost|\[::1\]):[0-9]{1,5}$",
                      description="host:port; loopback only")
    folder: Path

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    @property
    def config_path(self) -> Path:
        return self.folder / "config.yml"

    @property
    def pid_path(self) -> Path:
        return self.folder / "registry.pid"

    @property
    def log_path(self) -> Path:
        return self.folder / "registry.log"

    @property
    def data_path(self) -> Path:
        return self.folder / "data"


def default_registry(*, state: Path | None = None, addr: str = DEFAULT_ADDR) -> LocalRegistry:
    """The default local registry: 127.0.0.1:5000, files under <state>/registry (state: .skupin/)."""

    return LocalRegistry(addr=addr, folder=(state or state_dir()) / "registry")


class RegistryStatus(Frozen):
    """What `registry_status`/`up`/`down` found or did."""

    url: str
    answering: bool
    ours: bool = Field(description="A process we started (pid file, cmdline checked) is running")
    pid: int | None = None
    folder: str
    action: str


def render_config(registry: LocalRegistry) -> str:
    """The registry's config.yml: loopback listener, filesystem storage under data/, deletes on."""
    return (
        "# written by skupin (skupin/publishing/local_registry.py); rewritten on every `skupin registry up`\n"
        "version: 0.1\n"
        "log:\n"
        "  level: info\n"
        "  accesslog:\n"
        "    disabled: true\n"
        "storage:\n"
        "  filesystem:\n"
        f"    rootdirectory: {registry.data_path.resolve()}\n"
        "  delete:\n"
        "    enabled: true\n"
        "  cache:\n"
        "    blobdescriptor: inmemory\n"
        "http:\n"
        f"  addr: {registry.addr}\n"
        "  headers:\n"
        "    X-Content-Type-Options: [nosniff]\n"
    )


# ---------------------------------------------------------------- probing


def answers(url: str, *, timeout: float = 2.0) -> bool:
    """True when an OCI registry answers GET /v2/ at `url` (one try, short timeout)."""
    try:
        with RegistryClient(url, retries=0, timeout=timeout) as client:
            client.ping()
        return True
    except NetworkError:
        return False


def _port_taken(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    with socket.socket(socket.AF_INET6 if host.startswith("[") else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host.strip("[]"), int(port))) == 0


def _our_pid(registry: LocalRegistry) -> int | None:
    """The pid in our pid file when that process is alive and is our docker-registry with our config."""
    try:
        pid = int(registry.pid_path.read_text(encoding="utf-8").strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    args = [a.decode("utf-8", "replace") for a in cmdline if a]
    if any(a.endswith(BINARY) for a in args[:1]) and str(registry.config_path.resolve()) in args:
        return pid
    return None


def registry_status(*, registry: LocalRegistry) -> RegistryStatus:
    """Whether the registry answers and whether it is one we started."""
    pid = _our_pid(registry)
    up = answers(registry.url)
    what = ("running (started by skupin)" if pid else "running (not started by skupin)") if up else (
        "not answering (our process is alive)" if pid else "not running")
    return RegistryStatus(url=registry.url, answering=up, ours=pid is not None, pid=pid,
                          folder=str(registry.folder), action=what)


# ---------------------------------------------------------------- up / down


def _install(on_event: OnEvent) -> str:
    apt_install(APT_PACKAGE, why=f"{BINARY} not found", error=PublishError, on_event=on_event)
    path = shutil.which(BINARY)
    if path is None:
        raise PublishError(f"installed {APT_PACKAGE} but `{BINARY}` is still not on PATH")
    return path


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def registry_up(*, registry: LocalRegistry, deadline_s: float = 20, on_event: OnEvent = _quiet) -> RegistryStatus:
    """Make sure the registry answers; start (and if needed install) ours. Never touches a running one."""
    status = registry_status(registry=registry)
    if status.answering:
        who = f"ours, pid {status.pid}" if status.ours else "not started by skupin; left alone"
        return status.model_copy(update={"action": f"already running ({who})"})
    if status.ours:
        raise PublishError(f"our registry (pid {status.pid}) runs but does not answer on {registry.url}; "
                           f"fix: `skupin registry down` then `up`; last lines of {registry.log_path}:\n"
                           f"{_log_tail(registry.log_path)}")
    if _port_taken(registry.addr):
        raise PublishError(f"something that is not an OCI registry listens on {registry.addr}; "
                           "fix: stop it or choose another address (--addr)")
    binary = shutil.which(BINARY) or _install(on_event)
    registry.data_path.mkdir(parents=True, exist_ok=True)
    registry.config_path.write_text(render_config(registry), encoding="utf-8")
    on_event(f"starting {binary} on {registry.addr} (data {registry.data_path}, log {registry.log_path})")
    with open(registry.log_path, "ab") as log:
        proc = subprocess.Popen([binary, "serve", str(registry.config_path.resolve())], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    STARTED.append(proc)  # a daemon that outlives this process: keep its handle (see dockerd.daemon.STARTED)
    registry.pid_path.write_text(f"{proc.pid}\n", encoding="utf-8")
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if answers(registry.url, timeout=1.0):
            return RegistryStatus(url=registry.url, answering=True, ours=True, pid=proc.pid, folder=str(registry.folder),
                                  action=f"started {BINARY} (pid {proc.pid}, log {registry.log_path})")
        if proc.poll() is not None:
            registry.pid_path.unlink(missing_ok=True)
            raise PublishError(f"{BINARY} exited with code {proc.returncode}; last lines of {registry.log_path}:\n"
                               f"{_log_tail(registry.log_path)}")
        time.sleep(0.2)
    raise PublishError(f"{BINARY} (pid {proc.pid}) did not answer on {registry.url} within {deadline_s:.0f} s; "
                       f"last lines of {registry.log_path}:\n{_log_tail(registry.log_path)}")


def registry_down(*, registry: LocalRegistry, deadline_s: float = 10) -> RegistryStatus:
    """Stop the registry we started (SIGTERM, then SIGKILL); leave any other one alone. Data is kept."""
    pid = _our_pid(registry)
    if pid is None:
        registry.pid_path.unlink(missing_ok=True)
        up = answers(registry.url)
        what = "not started by skupin; left alone" if up else "was not running"
        return RegistryStatus(url=registry.url, answering=up, ours=False, folder=str(registry.folder), action=what)
    for sig, wait_s in ((signal.SIGTERM, deadline_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        end = time.monotonic() + wait_s
        while time.monotonic() < end and _alive(pid):
            time.sleep(0.1)
        if not _alive(pid):
            break
    if _alive(pid):
        raise PublishError(f"{BINARY} (pid {pid}) did not stop")
    registry.pid_path.unlink(missing_ok=True)
    return RegistryStatus(url=registry.url, answering=False, ours=False, folder=str(registry.folder),
                          action=f"stopped {BINARY} (pid {pid}); data kept in {registry.data_path}")


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a child we started is reaped here)."""
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---------------------------------------------------------------- tag removal distribution 2.x lacks


def untag_on_disk(*, registry: LocalRegistry, repository: str, tag: str) -> bool:
    """Remove a tag from OUR local registry's storage (distribution 2.8 has no HTTP tag delete).

    Only the tag's link folder goes (what distribution 3's tag DELETE does); the manifest and its
    other tags stay. False when the tag was not there.
    """
    if "/" in tag or tag in ("", ".", ".."):
        raise PublishError(f"not a tag: {tag!r}")
    folder = registry.data_path / "docker" / "registry" / "v2" / "repositories" / repository / "_manifests" / "tags" / tag
    if not folder.is_dir():
        return False
    shutil.rmtree(folder)
    return True
