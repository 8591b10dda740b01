"""Make sure a Docker daemon answers: start dockerd (installing Debian's docker.io only when asked) when none does."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import docker
from pydantic import Field

from skupin.common.apt import apt_install
from skupin.common.errors import DockerError
from skupin.common.model import Frozen
from skupin.common.untrusted import UntrustedInputError, load_json, read_regular_file

DEFAULT_SOCKET = Path("/var/run/docker.sock")
MAX_CONFIG_BYTES = 1024**2  # the docker CLI's config.json and a context's meta.json
DEFAULT_DOCKERD_LOG = Path("/var/log/skupin-dockerd.log")
# The dockerd this process started keeps running after it (a daemon, in its own session): its handle is kept
# for the life of this process, so it is never collected while running (that would be a ResourceWarning).
STARTED: list[subprocess.Popen] = []
OnEvent = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


class DockerdStatus(Frozen):
    """What `ensure_dockerd` found or did."""

    socket: str
    server_version: str
    action: str = Field(
        description="'already running', 'started dockerd (pid N, log PATH)' or 'installed docker.io and started dockerd (...)'"
    )
    pid: int | None = None
    log: str | None = None


def engine_host() -> str:
    """The engine the docker CLI would talk to: $DOCKER_HOST, else the Docker context in use ($DOCKER_CONTEXT, else
    the config's currentContext), else unix:///var/run/docker.sock. DockerError naming the file when a context is
    named but cannot be read."""
    if os.environ.get("DOCKER_HOST"):
        return os.environ["DOCKER_HOST"]
    config_dir = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    name = os.environ.get("DOCKER_CONTEXT")
    if not name:
        try:
            config = load_json(read_regular_file(config_dir / "config.json", max_bytes=MAX_CONFIG_BYTES),
                               source="docker config")
        except UntrustedInputError:  # missing, a FIFO, huge or not JSON: no context named
            config = {}
        name = config.get("currentContext") if isinstance(config, dict) else None
    if not name or name == "default":
        return f"unix://{DEFAULT_SOCKET}"
    meta = config_dir / "contexts" / "meta" / hashlib.sha256(str(name).encode()).hexdigest() / "meta.json"
    try:
        host = load_json(read_regular_file(meta, max_bytes=MAX_CONFIG_BYTES), source=str(meta))["Endpoints"]["docker"]["Host"]
    except (UntrustedInputError, KeyError, TypeError) as exc:
        raise DockerError(f"{meta}: cannot read the endpoint of Docker context {name!r}: {exc}; fix: "
                          f"`docker context use default`, or set DOCKER_HOST") from exc
    if not isinstance(host, str) or not host:
        raise DockerError(f"{meta}: Docker context {name!r} names no docker endpoint")
    return host


def local_socket(host: str) -> Path | None:
    """The socket file of a unix:// host, else None (an engine skupin can only talk to, never start)."""
    return Path(host.removeprefix("unix://")) if host.startswith("unix://") else None


def _server_version(socket: Path) -> str | None:
    """The engine's version when the socket answers a ping, else None."""
    if not socket.exists():
        return None
    try:
        client = docker.DockerClient(base_url=f"unix://{socket}", timeout=5)
        try:
            client.ping()
            return str(client.version().get("Version", "unknown"))
        finally:
            client.close()
    except Exception:  # any failure means "does not answer"
        return None


def _remote_version(host: str) -> str | None:
    try:
        client = docker.DockerClient(base_url=host, timeout=10, use_ssh_client=host.startswith("ssh://"))
        try:
            return str(client.version().get("Version", "unknown"))
        finally:
            client.close()
    except Exception:  # any failure means "does not answer"
        return None


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _install_docker_io(on_event: OnEvent) -> None:
    apt_install("docker.io", why="dockerd not found", error=DockerError, on_event=on_event)


def ensure_dockerd(
    *,
    deadline_s: float = 60,
    on_event: OnEvent = _quiet,
    socket: Path | None = None,
    log_path: Path = DEFAULT_DOCKERD_LOG,
) -> DockerdStatus:
    """Make sure a Docker engine answers on `socket` (default: `engine_host()`); start dockerd when none does, after
    installing Debian's docker.io when it is missing and installs are allowed (skupin/common/apt.py), else DockerError.

    An engine that already answers is never touched, and an engine elsewhere (DOCKER_HOST or a context naming
    tcp:// or ssh://) is only asked, never started. Raises DockerError with the tail of the dockerd log when the
    engine does not come up within `deadline_s`.
    """
    if socket is None:
        host = engine_host()
        socket = local_socket(host)
        if socket != DEFAULT_SOCKET:  # an engine someone else runs (remote, rootless, a context): asked, never started
            version = _server_version(socket) if socket is not None else _remote_version(host)
            if version is None:
                raise DockerError(f"no Docker engine answers at {host} (DOCKER_HOST or the Docker context); skupin "
                                  f"starts dockerd only on {DEFAULT_SOCKET}; fix: start that engine, or unset DOCKER_HOST")
            on_event(f"engine {version} answers at {host}")
            return DockerdStatus(socket=host, server_version=version, action="already running")
    version = _server_version(socket)
    if version is not None:
        on_event(f"engine {version} already running on {socket}")
        return DockerdStatus(socket=str(socket), server_version=version, action="already running")
    installed = False
    if shutil.which("dockerd") is None:
        _install_docker_io(on_event)
        installed = True
        if shutil.which("dockerd") is None:
            raise DockerError("installed docker.io but `dockerd` is still not on PATH")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    on_event(f"starting dockerd (log {log_path})")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            ["dockerd", "--host", f"unix://{socket}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    STARTED.append(proc)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        version = _server_version(socket)
        if version is not None:
            done = f"started dockerd (pid {proc.pid}, log {log_path})"
            action = f"installed docker.io and {done}" if installed else done
            on_event(f"engine {version} up: {action}")
            return DockerdStatus(socket=str(socket), server_version=version, action=action, pid=proc.pid, log=str(log_path))
        if proc.poll() is not None:
            raise DockerError(f"dockerd exited with code {proc.returncode}; last lines of {log_path}:\n{_log_tail(log_path)}")
        time.sleep(0.5)
    raise DockerError(
        f"dockerd (pid {proc.pid}) did not answer on {socket} within {deadline_s:.0f} s; "
        f"last lines of {log_path}:\n{_log_tail(log_path)}"
    )
