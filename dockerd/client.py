"""The Docker engine adapter: the only module that imports `docker` or runs the `docker` CLI.

Everything else gets an `Engine` passed in (made by `connect()`), never a global client.
Its surface is small on purpose:

- readiness: `ensure_engine()` makes sure an engine answers (installs Debian's docker.io and
  starts dockerd when nothing listens; never touches an engine that already answers);
- images: `inspect_image`, `image_exists`, `tag`, `remove_image`, `pull`, `import_rootfs`,
  `unique_bytes`;
- sandboxed containers: `run(spec, deadline_s=...)` for one-shot commands and
  `container(spec)` (a context manager) for long-running ones (exec, logs, network-namespace
  pid); both ALWAYS remove the container, also on exceptions and Ctrl-C. Their output is read
  from the attach stream (attached before start, log driver `none`: nothing on dockerd's disk)
  with bounds (`OutputCapture`): a container that prints more than its caps is killed. With
  `spec.deadline_s` the command runs under the image's coreutils `timeout` as PID 1, and every
  container is auto-removed, so the deadline holds and nothing stays behind even when this
  process is killed; owner labels (pid, its start time, boot id) let `reap_orphans()` remove the
  containers of dead owners;
- builds: `build(...)` runs the BuildKit-capable `docker` CLI (`DOCKER_BUILDKIT=1`, secrets,
  `--iidfile`) as a subprocess and streams its plain progress lines to a callback.
"""

from __future__ import annotations

import contextlib
import io
import functools
import os
import shutil
import signal
import socket as _socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import docker
import docker.errors
from docker.types import LogConfig as _LogConfig
from docker.types import Mount as _DockerMount
from docker.utils.socket import frames_iter as _frames_iter
from pydantic import Field

from common.apt import apt_install
from common.errors import BuildError, EngineError
from common.model import Frozen

DEFAULT_SOCKET = Path("/var/run/docker.sock")
DEFAULT_DOCKERD_LOG = Path("/var/log/skupin-dockerd.log")
# Debian's 20.10 CLI does BuildKit builds with --secret; a newer CLI without buildx cannot.
BUILDKIT_CLI_CANDIDATES = ("/usr/bin/docker", "docker")
# Every container and build this tool makes carries this label, so cleanup can find leftovers.
OWNER_LABEL = "io.skupin.owner"
SESSION_LABEL = "io.skupin.session"
# Every container `run`/`container` make is a sandbox; these name the process that made it, so a
# later run can tell a leftover of a dead process (kill -9, lost Docker API) from a live one.
SANDBOX_LABEL = "io.skupin.sandbox"
OWNER_PID_LABEL = "io.skupin.owner-pid"
OWNER_START_LABEL = "io.skupin.owner-start"
OWNER_BOOT_LABEL = "io.skupin.owner-boot"
OWNER_PIDNS_LABEL = "io.skupin.owner-pidns"
# In-container deadline = the host's deadline + DEADLINE_GRACE_S (the host kills first while it lives);
# `timeout` sends SIGTERM then, and SIGKILL KILL_AFTER_S later.
DEADLINE_GRACE_S = 15
KILL_AFTER_S = 10
DEFAULT_MAX_STDOUT_BYTES = 256 * 1024**2
DEFAULT_MAX_STDERR_BYTES = 1024**3
EXCERPT_HEAD_BYTES = 64 * 1024
EXCERPT_TAIL_BYTES = 256 * 1024

OnEvent = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


# ---------------------------------------------------------------- readiness


class EngineStatus(Frozen):
    """What `ensure_engine` found or did."""

    socket: str
    server_version: str
    action: str = Field(description="'already running', 'started dockerd (pid N, log PATH)' or 'installed docker.io and started dockerd (...)'")
    pid: int | None = None
    log: str | None = None


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
    except Exception:  # noqa: BLE001 - any failure means "does not answer"
        return None


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _install_docker_io(on_event: OnEvent) -> None:
    apt_install("docker.io", why="dockerd not found", error=EngineError, on_event=on_event)


def ensure_engine(
    *,
    deadline_s: float = 60,
    on_event: OnEvent = _quiet,
    socket: Path = DEFAULT_SOCKET,
    log_path: Path = DEFAULT_DOCKERD_LOG,
) -> EngineStatus:
    """Make sure a Docker engine answers on `socket`; start (and if needed install) dockerd.

    An engine that already answers is never touched. Raises EngineError with the tail of the
    dockerd log when the engine does not come up within `deadline_s`.
    """
    version = _server_version(socket)
    if version is not None:
        on_event(f"engine {version} already running on {socket}")
        return EngineStatus(socket=str(socket), server_version=version, action="already running")
    installed = False
    if shutil.which("dockerd") is None:
        _install_docker_io(on_event)
        installed = True
        if shutil.which("dockerd") is None:
            raise EngineError("installed docker.io but `dockerd` is still not on PATH")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    on_event(f"starting dockerd (log {log_path})")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            ["dockerd", "--host", f"unix://{socket}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        version = _server_version(socket)
        if version is not None:
            done = f"started dockerd (pid {proc.pid}, log {log_path})"
            action = f"installed docker.io and {done}" if installed else done
            on_event(f"engine {version} up: {action}")
            return EngineStatus(socket=str(socket), server_version=version, action=action, pid=proc.pid, log=str(log_path))
        if proc.poll() is not None:
            raise EngineError(f"dockerd exited with code {proc.returncode}; last lines of {log_path}:\n{_log_tail(log_path)}")
        time.sleep(0.5)
    raise EngineError(
        f"dockerd (pid {proc.pid}) did not answer on {socket} within {deadline_s:.0f} s; "
        f"last lines of {log_path}:\n{_log_tail(log_path)}"
    )


# ---------------------------------------------------------------- value objects


class ImageInfo(Frozen):
    """What the engine knows about one local image."""

    id: str = Field(description="sha256:... image (config) id")
    tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    labels: dict[str, str]
    size: int
    layers: tuple[str, ...] = Field(description="RootFS layer diff ids, bottom first")
    created: str


class BindMount(Frozen):
    """A host path mounted into a container; read-only unless said otherwise."""

    source: Path
    target: str = Field(pattern=r"^/[^\x00-\x1f]*$")
    read_only: bool = True


class ContainerSpec(Frozen):
    """A sandboxed container: by default no network, no capabilities, read-only root, limits.

    The defaults are the sandbox the gate needs for images under test; loosen a field only
    when a check needs it (e.g. `network="bridge"` never for an image under test).
    """

    image: str
    command: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    user: str | None = Field(None, description="uid[:gid] or name; None keeps the image's user")
    workdir: str | None = None
    network: str = "none"
    read_only: bool = True
    tmpfs: dict[str, str] = Field(default_factory=lambda: {"/tmp": "rw,size=256m"})
    mem_limit: str = "2g"
    pids_limit: int = 512
    shm_size: str | None = None
    ipc: str | None = None
    cap_drop: tuple[str, ...] = ("ALL",)
    security_opt: tuple[str, ...] = ("no-new-privileges",)
    mounts: tuple[BindMount, ...] = ()
    devices: tuple[str, ...] = ()
    group_add: tuple[str, ...] = ()
    gpus: bool = Field(False, description="Request all GPUs (NVIDIA device request)")
    labels: dict[str, str] = Field(default_factory=dict)
    name: str | None = None
    cpus: float | None = Field(None, gt=0, le=4096, description="CPU limit (Docker nano_cpus); None: no limit")
    deadline_s: float | None = Field(
        None, gt=0, description="The command runs as `timeout --kill-after=KILL_AFTER_S <deadline_s + DEADLINE_GRACE_S>s "
                                "ARGV` (the image's coreutils timeout as PID 1): the deadline holds even when the client "
                                "dies; `run` also uses it as the host's deadline")
    max_stdout_bytes: int = Field(DEFAULT_MAX_STDOUT_BYTES, ge=0,
                                  description="stdout beyond this kills the container (overflow); `run` keeps it whole")
    max_stderr_bytes: int = Field(DEFAULT_MAX_STDERR_BYTES, ge=0,
                                  description="stderr beyond this kills the container (overflow); only its head and tail are kept")


class RunResult(Frozen):
    """How a one-shot container ended; its output as far as the caps kept it."""

    exit_code: int | None = Field(description="None when it was killed at the deadline")
    stdout_bytes: bytes = Field(b"", repr=False, description="All of stdout (empty after an overflow)")
    stdout_excerpt: str = Field("", description="stdout's head and tail as text")
    stderr: str = Field(description="stderr's head and tail as text")
    timed_out: bool
    seconds: float
    overflow: str = Field("", description="Which cap the container broke (it was then killed); empty when none")

    @property
    def stdout(self) -> str:
        """stdout as text (all of it when it was kept, else its head and tail)."""
        return self.stdout_bytes.decode("utf-8", "replace") if self.stdout_bytes else self.stdout_excerpt


class ReapedContainer(Frozen):
    """A container `Engine.reap_orphans` removed, and why its owner counts as gone."""

    id: str
    name: str
    image: str
    reason: str

    def describe(self) -> str:
        return f"{self.name} ({self.id[:12]}, image {self.image[:40]}): {self.reason}"


class ExecResult(Frozen):
    """How a command run inside a running container ended."""

    exit_code: int
    output: str


# ---------------------------------------------------------------- output capture (bounded)


class _Excerpt:
    """The first and the last bytes of a stream and its length: bounded memory whatever the stream does."""

    def __init__(self, *, head: int = EXCERPT_HEAD_BYTES, tail: int = EXCERPT_TAIL_BYTES) -> None:
        self._head_max, self._tail_max = head, tail
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_max - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self._tail_max:
                del self.tail[: -self._tail_max]

    def text(self) -> str:
        tail = bytes(self.tail[-self._tail_max:]) if self._tail_max else b""
        skipped = self.total - len(self.head) - len(tail)
        middle = f"\n[... {skipped} bytes not kept ...]\n" if skipped > 0 else ""
        return self.head.decode("utf-8", "replace") + middle + tail.decode("utf-8", "replace")


class OutputCapture:
    """A container's stdout and stderr, read from its attach stream on a thread, with hard bounds.

    stdout is kept whole (`keep_stdout`) up to `max_stdout` bytes; of stderr (and of stdout when
    not kept) only the head and tail are kept. A stream past its cap sets `overflow`, detaches
    and calls `on_overflow` (the adapter kills the container): memory never grows with what the
    container prints.
    """

    def __init__(self, *, max_stdout: int, max_stderr: int, keep_stdout: bool,
                 on_overflow: Callable[[], None] = lambda: None) -> None:
        self._limits = {1: max_stdout, 2: max_stderr}
        self._names = {1: "stdout", 2: "stderr"}
        self._streams = {1: _Excerpt(), 2: _Excerpt()}
        self._both = _Excerpt(head=0)
        self._kept: bytearray | None = bytearray() if keep_stdout else None
        self._on_overflow = on_overflow
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sock = None
        self.overflow = ""
        self.error = ""

    def feed(self, stream: int, data: bytes) -> bool:
        """Take one chunk of `stream` (1 stdout, 2 stderr); False once a cap is broken (stop reading)."""
        if stream not in self._limits:
            return True
        with self._lock:
            excerpt = self._streams[stream]
            if excerpt.total + len(data) > self._limits[stream]:
                self.overflow = (f"{self._names[stream]} passed its cap of {self._limits[stream]} bytes "
                                 f"(the container was killed)")
                self._kept = None
                overflowed = True
            else:
                excerpt.add(data)
                self._both.add(data)
                if stream == 1 and self._kept is not None:
                    self._kept += data
                overflowed = False
        return not overflowed

    def start(self, sock) -> None:
        """Read the attach socket `sock` (Docker's multiplexed frames) on a daemon thread until it ends."""
        self._sock = sock
        self._thread = threading.Thread(target=self._pump, name="skupin-capture", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for stream, data in _frames_iter(self._sock, tty=False):
                if data and not self.feed(stream, bytes(data)):
                    # Detach first: a daemon blocked writing to a socket nobody reads would stall the kill.
                    self.close()
                    self._on_overflow()
                    break
        except Exception as exc:  # noqa: BLE001 - a broken stream ends the capture; the exit status says the rest
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.close()

    def join(self, timeout_s: float) -> bool:
        """Wait for the stream to end; True when it did."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Stop reading: shut the attach socket down (wakes a blocked reader) and release its connection."""
        raw = getattr(self._sock, "_sock", self._sock)
        with contextlib.suppress(OSError, AttributeError):
            raw.shutdown(_socket.SHUT_RDWR)
        for closable in (self._sock, getattr(self._sock, "_response", None)):
            with contextlib.suppress(Exception):
                closable.close()

    def stdout_bytes(self) -> bytes:
        with self._lock:
            return bytes(self._kept) if self._kept is not None else b""

    def text(self, *, stdout: bool = True, stderr: bool = True) -> str:
        """Head and tail of the chosen streams as text (both: the last bytes in arrival order)."""
        with self._lock:
            if stdout and stderr:
                return self._both.text()
            return self._streams[1 if stdout else 2].text() if (stdout or stderr) else ""


# ---------------------------------------------------------------- owners (for the reaper)


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
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_labels() -> dict[str, str]:
    """The labels naming this process as a container's owner: pid, its start time, boot id, pid namespace."""
    pid = os.getpid()
    return {SANDBOX_LABEL: "1", OWNER_PID_LABEL: str(pid), OWNER_START_LABEL: _start_time(pid),
            OWNER_BOOT_LABEL: _boot_id(), OWNER_PIDNS_LABEL: _pid_namespace()}


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


# ---------------------------------------------------------------- the adapter


class RunningContainer:
    """A started sandboxed container; made by `Engine.container()`, removed when it exits."""

    def __init__(self, container: "docker.models.containers.Container", capture: OutputCapture) -> None:
        self._c = container
        self._capture = capture

    @property
    def id(self) -> str:
        return str(self._c.id)

    @property
    def overflow(self) -> str:
        """Which output cap the container broke (it was then killed), or ''."""
        return self._capture.overflow

    def pid(self) -> int:
        """Host pid of the container's init (enter its network namespace with nsenter -t PID -n)."""
        try:
            self._c.reload()
        except docker.errors.NotFound as exc:
            raise EngineError(f"container {self.id[:12]} is gone ({self.overflow or 'it exited'})") from exc
        return int(self._c.attrs["State"]["Pid"])

    def running(self) -> bool:
        try:
            self._c.reload()
        except docker.errors.NotFound:
            return False
        return self._c.status == "running"

    def exec(self, command: list[str] | tuple[str, ...], *, user: str | None = None, env: Mapping[str, str] | None = None) -> ExecResult:
        """Run a command inside the container and wait for it (stdout and stderr merged)."""
        try:
            res = self._c.exec_run(list(command), user=user or "", environment=dict(env or {}), demux=False)
        except docker.errors.APIError as exc:
            raise EngineError(f"exec in container {self.id[:12]} failed: {exc.explanation or exc}") from exc
        return ExecResult(exit_code=int(res.exit_code), output=(res.output or b"").decode("utf-8", "replace"))

    def logs(self, *, stdout: bool = True, stderr: bool = True, tail: int | str = "all") -> str:
        """What the container printed (head and tail, bounded), from the capture: its log driver is `none`."""
        text = self._capture.text(stdout=stdout, stderr=stderr)
        return text if tail == "all" else "\n".join(text.splitlines()[-int(tail):])


class _ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of byte chunks (the engine's streamed responses)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._left = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while not self._left:
            try:
                self._left = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


def _not_found(exc: "docker.errors.APIError") -> bool:
    """The engine answered 404 (ImageNotFound, NotFound, or a bare APIError carrying the status)."""
    return isinstance(exc, docker.errors.NotFound) or exc.status_code == 404


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timeout" in text or "timed out" in text


class Engine:
    """A connected Docker engine: images, sandboxed containers and BuildKit builds."""

    def __init__(self, client: "docker.DockerClient", *, socket: Path, cli: str | None = None) -> None:
        self._client = client
        self.socket = socket
        self._cli = cli
        # Every container this Engine object creates carries SESSION_LABEL=<this id>, so a caller
        # can find (only) its own leftovers on an engine other people use at the same time.
        self.session = uuid.uuid4().hex[:16]

    # ------------------------------------------------------------ basics

    def ping(self) -> str:
        """The server version; EngineError when the engine does not answer."""
        try:
            self._client.ping()
            return str(self._client.version().get("Version", "unknown"))
        except Exception as exc:  # noqa: BLE001
            raise EngineError(f"the Docker engine at {self.socket} does not answer: {exc}") from exc

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------ images

    def inspect_image(self, ref: str) -> ImageInfo | None:
        """The local image `ref` (tag, id or name@digest), or None when absent."""
        try:
            a = self._client.api.inspect_image(ref)
        except docker.errors.APIError as exc:
            if _not_found(exc):
                return None
            raise EngineError(f"inspecting image {ref} failed: {exc.explanation or exc}") from exc
        cfg = a.get("Config") or {}
        return ImageInfo(
            id=a["Id"],
            tags=tuple(a.get("RepoTags") or ()),
            repo_digests=tuple(a.get("RepoDigests") or ()),
            labels=dict(cfg.get("Labels") or {}),
            size=int(a.get("Size") or 0),
            layers=tuple((a.get("RootFS") or {}).get("Layers") or ()),
            created=str(a.get("Created", "")),
        )

    def image_exists(self, ref: str) -> bool:
        return self.inspect_image(ref) is not None

    def unique_bytes(self, ref: str) -> int:
        """Bytes of the image's layers that no other local image shares (`docker system df -v`)."""
        info = self.inspect_image(ref)
        if info is None:
            raise EngineError(f"no image {ref}")
        try:
            images = self._client.df().get("Images") or []
        except docker.errors.APIError as exc:
            raise EngineError(f"docker system df failed: {exc.explanation or exc}") from exc
        row = next((i for i in images if i.get("Id") == info.id), None)
        if row is None:
            raise EngineError(f"docker system df does not list {ref}")
        return int(row.get("Size") or 0) - max(int(row.get("SharedSize") or 0), 0)

    def image_config(self, ref: str) -> dict:
        """The image's config (Env, Entrypoint, Cmd, WorkingDir, User, ...) as the engine stores it."""
        try:
            return dict(self._client.api.inspect_image(ref).get("Config") or {})
        except docker.errors.APIError as exc:
            raise EngineError(f"inspecting image {ref} failed: {exc.explanation or exc}") from exc

    def layer_dirs(self, ref: str) -> tuple[Path, ...] | None:
        """The folders holding each layer of `ref` on this machine, bottom first, when the engine stores them
        with overlay2 on a local disk this process can read; None otherwise (then use `save_image`)."""
        try:
            data = self._client.api.inspect_image(ref).get("GraphDriver") or {}
        except docker.errors.APIError as exc:
            raise EngineError(f"inspecting image {ref} failed: {exc.explanation or exc}") from exc
        paths = data.get("Data") or {}
        if data.get("Name") != "overlay2" or not paths.get("UpperDir"):
            return None
        lower = [p for p in str(paths.get("LowerDir") or "").split(":") if p]
        dirs = tuple(Path(p) for p in [*reversed(lower), str(paths["UpperDir"])])
        return dirs if all(d.is_dir() and not d.is_symlink() for d in dirs) else None

    def save_image(self, ref: str) -> io.RawIOBase:
        """`docker save ref` as a stream (the image's layers as tar files, for engines not on this disk)."""
        try:
            chunks = self._client.api.get_image(ref, chunk_size=1 << 20)
        except docker.errors.APIError as exc:
            raise EngineError(f"saving image {ref} failed: {exc.explanation or exc}") from exc
        return _ChunkReader(iter(chunks))

    def tag(self, image: str, tag: str) -> None:
        """Point `tag` (repo:tag) at `image`."""
        repo, _, name = tag.rpartition(":")
        if not repo or "/" in name:
            repo, name = tag, "latest"
        try:
            ok = self._client.api.tag(image, repo, name, force=True)
        except docker.errors.APIError as exc:
            raise EngineError(f"tagging {image} as {tag} failed: {exc.explanation or exc}") from exc
        if not ok:
            raise EngineError(f"tagging {image} as {tag} failed")

    def remove_image(self, ref: str, *, force: bool = False) -> bool:
        """Remove a tag or image; False when it did not exist."""
        try:
            self._client.api.remove_image(ref, force=force, noprune=False)
            return True
        except docker.errors.APIError as exc:
            if _not_found(exc):
                return False
            raise EngineError(f"removing image {ref} failed: {exc.explanation or exc}") from exc

    def pull(self, ref: str) -> str:
        """Pull `ref` (name@sha256:...) and return its image id; EngineError when unreachable."""
        try:
            image = self._client.images.pull(ref)
        except docker.errors.APIError as exc:
            raise EngineError(
                f"cannot pull {ref}: {exc.explanation or exc}; no registry is reachable from here? "
                "fix: load the image (docker load) on this machine, or use a bootstrap base"
            ) from exc
        return str(image.id)

    def push(self, reference: str, *, on_event: OnEvent = _quiet) -> str:
        """Push `reference` (host/repo:tag); return the manifest digest the registry stored.

        Every chunk of the push stream is checked: docker-py reports a failed push as a chunk with
        `error`/`errorDetail` and raises nothing. EngineError on any error chunk, on a broken
        stream, or when the stream ends without a digest.
        """
        repo, _, tag = reference.rpartition(":")
        if not repo or "/" in tag:
            raise EngineError(f"push needs a reference with a tag (host/repo:tag), not {reference!r}")
        digest: str | None = None
        try:
            for chunk in self._client.api.push(repo, tag=tag, stream=True, decode=True):
                if not isinstance(chunk, dict):
                    raise EngineError(f"pushing {reference}: unexpected stream chunk {chunk!r:.200}")
                if chunk.get("error") or chunk.get("errorDetail"):
                    detail = chunk.get("errorDetail") or {}
                    raise EngineError(f"pushing {reference} failed: {chunk.get('error') or detail.get('message') or detail}")
                aux = chunk.get("aux") or {}
                if isinstance(aux, dict) and str(aux.get("Digest", "")).startswith("sha256:"):
                    digest = str(aux["Digest"])
                status = str(chunk.get("status") or "")
                if status and status not in ("Pushing", "Waiting", "Preparing"):
                    on_event(f"push {chunk.get('id', '')} {status}".replace("  ", " "))
        except EngineError:
            raise
        except docker.errors.APIError as exc:
            raise EngineError(f"pushing {reference} failed: {exc.explanation or exc}") from exc
        except Exception as exc:  # noqa: BLE001 - requests' connection/read errors mid-stream
            raise EngineError(f"pushing {reference} failed: the push stream broke: {exc}") from exc
        if digest is None:
            raise EngineError(f"pushing {reference}: the engine reported no digest; treating the push as failed")
        return digest

    def import_rootfs(self, *, rootfs: Path, reference: str, on_event: OnEvent = _quiet) -> str:
        """`tar -C rootfs -c . | docker import - reference`; returns the new image id."""
        cli = self.cli()
        on_event(f"importing {rootfs} as {reference}")
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            imp = subprocess.run(
                [cli, "import", "-", reference], stdin=tar.stdout, capture_output=True, text=True, env=self._cli_env(), check=False
            )
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            tar_err = tar.stderr.read().decode("utf-8", "replace") if tar.stderr else ""
            tar.wait()
        if tar.returncode != 0 or imp.returncode != 0:
            raise EngineError(f"importing {rootfs} as {reference} failed: tar exit {tar.returncode} {tar_err.strip()}; import exit {imp.returncode} {imp.stderr.strip()}")
        return imp.stdout.strip()

    # ------------------------------------------------------------ containers

    def _argv(self, spec: ContainerSpec) -> tuple[list[str] | None, list[str] | None]:
        """(entrypoint, command) to create: the spec's, or under `timeout` when it has a deadline."""
        if spec.deadline_s is None:
            return (list(spec.entrypoint) if spec.entrypoint is not None else None), (list(spec.command) or None)
        entrypoint, command = spec.entrypoint, spec.command
        if entrypoint is None:  # the image's own, as `docker run` would combine them
            config = self._image_config(spec.image)
            entrypoint = tuple(config.get("Entrypoint") or ())
            command = command or tuple(config.get("Cmd") or ())
        argv = [*entrypoint, *command]
        if not argv:
            raise EngineError(f"image {spec.image} has no command to run under a deadline")
        limit = int(spec.deadline_s + DEADLINE_GRACE_S + 0.999)
        return ["timeout", f"--kill-after={KILL_AFTER_S}", f"{limit}s", *argv], None

    def _image_config(self, ref: str) -> dict:
        try:
            return dict(self._client.api.inspect_image(ref).get("Config") or {})
        except docker.errors.APIError as exc:
            if _not_found(exc):
                raise EngineError(f"image {ref} is not on this engine: {exc.explanation or exc}") from exc
            raise EngineError(f"inspecting image {ref} failed: {exc.explanation or exc}") from exc

    def _create(self, spec: ContainerSpec) -> "docker.models.containers.Container":
        entrypoint, command = self._argv(spec)
        kwargs: dict = dict(
            image=spec.image,
            command=command,
            environment=dict(spec.env),
            network_mode=spec.network,
            read_only=spec.read_only,
            tmpfs=dict(spec.tmpfs),
            mem_limit=spec.mem_limit,
            memswap_limit=spec.mem_limit,
            pids_limit=spec.pids_limit,
            cap_drop=list(spec.cap_drop),
            security_opt=list(spec.security_opt),
            mounts=[_DockerMount(target=m.target, source=str(m.source), type="bind", read_only=m.read_only) for m in spec.mounts],
            labels={**spec.labels, OWNER_LABEL: "skupin", SESSION_LABEL: self.session, **owner_labels()},
            auto_remove=True,
            log_config=_LogConfig(type=_LogConfig.types.NONE),
            detach=True,
        )
        if entrypoint is not None:
            kwargs["entrypoint"] = entrypoint
        if spec.cpus is not None:
            kwargs["nano_cpus"] = int(spec.cpus * 1e9)
        for key, value in (("user", spec.user), ("working_dir", spec.workdir), ("shm_size", spec.shm_size), ("ipc_mode", spec.ipc), ("name", spec.name)):
            if value is not None:
                kwargs[key] = value
        if spec.devices:
            kwargs["devices"] = [f"{d}:{d}:rwm" for d in spec.devices]
        if spec.group_add:
            kwargs["group_add"] = list(spec.group_add)
        if spec.gpus:
            kwargs["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        try:
            return self._client.containers.create(**kwargs)
        except docker.errors.ImageNotFound as exc:
            raise EngineError(f"image {spec.image} is not on this engine: {exc.explanation or exc}") from exc
        except docker.errors.APIError as exc:
            raise EngineError(f"creating a container of {spec.image} failed: {exc.explanation or exc}") from exc

    def _attach(self, container_id: str, spec: ContainerSpec, *, keep_stdout: bool) -> OutputCapture:
        """Attach to stdout and stderr BEFORE start (nothing is missed) and read them on a thread, bounded."""
        try:
            sock = self._client.api.attach_socket(container_id, params={"stdout": 1, "stderr": 1, "stream": 1, "logs": 0})
        except docker.errors.APIError as exc:
            raise EngineError(f"attaching to container {container_id[:12]} failed: {exc.explanation or exc}") from exc
        capture = OutputCapture(max_stdout=spec.max_stdout_bytes, max_stderr=spec.max_stderr_bytes,
                                keep_stdout=keep_stdout, on_overflow=lambda: self._kill(container_id))
        capture.start(sock)
        return capture

    def _start(self, container: "docker.models.containers.Container", spec: ContainerSpec) -> None:
        try:
            container.start()
        except docker.errors.APIError as exc:
            raise EngineError(f"starting a container of {spec.image} failed: {exc.explanation or exc}") from exc

    def _wait_removed(self, container_id: str, *, timeout_s: float):
        """Register a wait for the container's removal BEFORE start (as `docker run --rm` does): dockerd
        answers the headers once the wait is registered, the body (the exit status) once it is removed."""
        api = self._client.api
        try:
            response = api._post(api._url("/containers/{0}/wait", container_id), params={"condition": "removed"},
                                 stream=True, timeout=timeout_s)
            api._raise_for_status(response)
        except docker.errors.APIError as exc:
            raise EngineError(f"waiting for container {container_id[:12]} failed: {exc.explanation or exc}") from exc
        return response

    def _exit_status(self, response, container_id: str) -> int | None:
        """The exit status from a registered wait; None when its timeout (the host's deadline) passed."""
        try:
            body = response.json()
        except Exception as exc:  # requests' ConnectionError(ReadTimeout) at the deadline
            if _is_timeout(exc):
                return None
            raise EngineError(f"waiting for container {container_id[:12]} failed: {exc}") from exc
        finally:
            response.close()
        return int(body.get("StatusCode", -1)) if isinstance(body, dict) else -1

    def _kill(self, container_id: str) -> None:
        with contextlib.suppress(docker.errors.APIError):
            self._client.api.kill(container_id)

    def _remove(self, container_id: str) -> None:
        """Force-remove; an auto-removal already under way is waited for (up to 10 s)."""
        for _ in range(100):
            try:
                self._client.api.remove_container(container_id, force=True)
                return
            except docker.errors.APIError as exc:
                if _not_found(exc):
                    return
                if exc.status_code != 409:  # 409: its removal is already in progress
                    raise EngineError(f"removing container {container_id[:12]} failed: {exc.explanation or exc}") from exc
            time.sleep(0.1)

    @contextlib.contextmanager
    def container(self, spec: ContainerSpec) -> Iterator[RunningContainer]:
        """Start a sandboxed container; it is force-removed when the block ends, however it ends.

        Its output is captured from the start (head and tail, `logs()`); past a cap it is killed.
        """
        c = self._create(spec)
        capture: OutputCapture | None = None
        try:
            capture = self._attach(c.id, spec, keep_stdout=False)
            self._start(c, spec)
            yield RunningContainer(c, capture)
        finally:
            if capture is not None:
                capture.close()
            self._remove(c.id)

    def run(self, spec: ContainerSpec, *, deadline_s: float | None = None) -> RunResult:
        """Run a one-shot sandboxed container to completion; always removed.

        The host kills it at `deadline_s` (default `spec.deadline_s`); it is killed as soon as its
        output passes a cap (`RunResult.overflow`). stdout is kept whole (up to its cap), stderr as head + tail.
        """
        limit = deadline_s if deadline_s is not None else spec.deadline_s
        if limit is None:
            raise EngineError("a one-shot container needs a deadline (deadline_s)")
        start = time.monotonic()
        c = self._create(spec)
        capture: OutputCapture | None = None
        try:
            capture = self._attach(c.id, spec, keep_stdout=True)
            waiter = self._wait_removed(c.id, timeout_s=limit)
            self._start(c, spec)
            code = self._exit_status(waiter, c.id)
            if code is None:
                self._kill(c.id)
            capture.join(timeout_s=30)
        finally:
            if capture is not None:
                capture.close()
            self._remove(c.id)
        return RunResult(exit_code=code, stdout_bytes=capture.stdout_bytes(), stdout_excerpt=capture.text(stderr=False),
                         stderr=capture.text(stdout=False), timed_out=code is None,
                         seconds=round(time.monotonic() - start, 3), overflow=capture.overflow)

    def containers(self, *, label: str | None = None, all: bool = True) -> tuple[str, ...]:  # noqa: A002
        """Ids of containers (running or not), optionally only those with a label (key or key=value)."""
        filters = {"label": label} if label else None
        try:
            rows = self._client.api.containers(all=all, filters=filters)
        except docker.errors.APIError as exc:
            raise EngineError(f"listing containers failed: {exc.explanation or exc}") from exc
        return tuple(str(r["Id"]) for r in rows)

    def reap_orphans(self) -> tuple[ReapedContainer, ...]:
        """Force-remove the sandbox containers whose owner process is gone (see `owner_gone`); what was removed."""
        try:
            rows = self._client.api.containers(all=True, filters={"label": SANDBOX_LABEL})
        except docker.errors.APIError as exc:
            raise EngineError(f"listing containers failed: {exc.explanation or exc}") from exc
        boot, pidns = _boot_id(), _pid_namespace()
        reaped = []
        for row in rows:
            why = owner_gone(row.get("Labels") or {}, boot_id=boot, pid_namespace=pidns)
            if why:
                self._remove(str(row["Id"]))
                name = ((row.get("Names") or ["?"])[0]).lstrip("/")
                reaped.append(ReapedContainer(id=str(row["Id"]), name=name, image=str(row.get("Image", "")), reason=why))
        return tuple(reaped)

    # ------------------------------------------------------------ builds (BuildKit via the CLI)

    def cli(self) -> str:
        """Path of a `docker` CLI that can do BuildKit builds with secrets (Debian's 20.10 first)."""
        if self._cli:
            return self._cli
        for cand in BUILDKIT_CLI_CANDIDATES:
            path = cand if os.path.isabs(cand) and os.access(cand, os.X_OK) else shutil.which(cand)
            if path:
                self._cli = path
                return path
        raise EngineError("no `docker` CLI found; fix: apt-get install docker.io (Debian's CLI does BuildKit builds)")

    def _cli_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env.update(DOCKER_HOST=f"unix://{self.socket}", DOCKER_BUILDKIT="1", BUILDKIT_PROGRESS="plain")
        return env

    def build(
        self,
        *,
        context: Path,
        dockerfile: Path,
        build_args: Mapping[str, str] | None = None,
        secrets: Mapping[str, Path] | None = None,
        no_cache: bool = False,
        on_line: OnEvent = _quiet,
    ) -> str:
        """Build with BuildKit (`docker build --progress=plain --iidfile`); return the image id.

        No tag is given: the caller tags only after every check passed, so a failed build
        leaves no tag. Every output line goes to `on_line` (the caller keeps what it needs, e.g. to
        map a failed step to its layer). On failure raises BuildError with the exit code. On
        Ctrl-C the CLI is interrupted and waited for, which cancels the build in the engine
        (BuildKit's build containers end with the client's session).
        """
        with tempfile.TemporaryDirectory(prefix="skupin-build-") as tmp:
            iidfile = Path(tmp) / "iid"
            cmd = [self.cli(), "build", "--progress=plain", "--iidfile", str(iidfile), "-f", str(dockerfile)]
            for k, v in (build_args or {}).items():
                cmd += ["--build-arg", f"{k}={v}"]
            for k, path in (secrets or {}).items():
                cmd += ["--secret", f"id={k},src={path}"]
            if no_cache:
                cmd.append("--no-cache")
            cmd.append(str(context))
            code = self._stream(cmd, on_line=on_line)
            if code != 0:
                raise BuildError(f"docker build exited with code {code}")
            try:
                return iidfile.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise BuildError("docker build succeeded but wrote no image id") from exc

    def _stream(self, cmd: list[str], *, on_line: OnEvent) -> int:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self._cli_env(), start_new_session=True, text=True, errors="replace", bufsize=1,
            preexec_fn=_interrupt_when_parent_dies,
        )
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                on_line(raw.rstrip("\n"))
            return proc.wait()
        except BaseException:
            _interrupt(proc)
            raise

    def builder_prune(self) -> None:
        """Drop BuildKit's build cache (for cold-build measurements)."""
        proc = subprocess.run([self.cli(), "builder", "prune", "--all", "--force"], env=self._cli_env(), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise EngineError(f"docker builder prune failed: {proc.stderr.strip()}")


def _interrupt_when_parent_dies() -> None:
    """In the build CLI's child process: get SIGINT (cancel the build) if this tool dies first."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _interrupt(proc: subprocess.Popen) -> None:
    """Stop a build CLI the way Ctrl-C does (SIGINT, then harder), and wait for it to exit."""
    for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def connect(*, socket: Path = DEFAULT_SOCKET, timeout_s: int = 120, cli: str | None = None) -> Engine:
    """Connect to the engine on `socket`; EngineError (with the fix) when none answers."""
    try:
        client = docker.DockerClient(base_url=f"unix://{socket}", timeout=timeout_s)
        client.ping()
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"no Docker engine answers on {socket}: {exc}; fix: run `skupin engine up`") from exc
    return Engine(client, socket=socket, cli=cli)
