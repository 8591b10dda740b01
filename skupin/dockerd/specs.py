"""The Docker adapter's value objects: images, sandboxed container specs, how a container ended; labels and limits."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from skupin.common.model import Frozen

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
# coreutils' `timeout`, by absolute path: a command under a deadline never looks it up through the image's PATH
# (Debian and Ubuntu install it there, usr-merged or not).
TIMEOUT = "/usr/bin/timeout"
DEFAULT_MAX_STDOUT_BYTES = 256 * 1024**2
DEFAULT_MAX_STDERR_BYTES = 1024**3
# A CPU list as the kernel's cpuset takes it: numbers and ranges, comma-separated ("1", "0-3", "2,5-7").
CPUSET_PATTERN = r"^\d{1,4}(-\d{1,4})?(,\d{1,4}(-\d{1,4})?)*$"


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
    cpuset: str | None = Field(None, pattern=CPUSET_PATTERN,
                               description="The CPUs the container may run on (Docker cpuset_cpus: '1', '0-3', '2,5')")
    deadline_s: float | None = Field(
        None, gt=0, description="The command runs as `timeout --kill-after=KILL_AFTER_S <deadline_s + DEADLINE_GRACE_S>s "
                                "ARGV` (the image's coreutils timeout as PID 1): the deadline holds even when the client "
                                "dies; `run` also uses it as the host's deadline")
    max_stdout_bytes: int = Field(DEFAULT_MAX_STDOUT_BYTES, ge=0,
                                  description="stdout beyond this kills the container (overflow); `run` keeps it whole")
    max_stderr_bytes: int = Field(
        DEFAULT_MAX_STDERR_BYTES,
        ge=0,
        description="stderr beyond this kills the container (overflow); only its head and tail are kept",
    )


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
    """A container `Docker.reap_orphans` removed, and why its owner counts as gone."""

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
