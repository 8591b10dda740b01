"""The one room for Docker: the only package that imports `docker` or runs the `docker` CLI.

Everything else gets a `Docker` passed in (made by `connect()`), never a global client.
Its surface is small on purpose:

- readiness: `ensure_dockerd()` makes sure an engine answers (installs Debian's docker.io and
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

from skupin.dockerd.client import Docker, RunningContainer, connect
from skupin.dockerd.daemon import DEFAULT_SOCKET, DockerdStatus, engine_host, ensure_dockerd
from skupin.dockerd.specs import (
                           DEADLINE_GRACE_S,
                           KILL_AFTER_S,
                           OWNER_LABEL,
                           SANDBOX_LABEL,
                           SESSION_LABEL,
                           BindMount,
                           ContainerSpec,
                           ExecResult,
                           ImageInfo,
                           ReapedContainer,
                           RunResult,
)

__all__ = ["DEADLINE_GRACE_S", "DEFAULT_SOCKET", "KILL_AFTER_S", "OWNER_LABEL", "SANDBOX_LABEL", "SESSION_LABEL",
           "BindMount", "ContainerSpec", "Docker", "DockerdStatus", "ExecResult", "ImageInfo", "ReapedContainer",
           "RunResult", "RunningContainer", "connect", "engine_host", "ensure_dockerd"]
