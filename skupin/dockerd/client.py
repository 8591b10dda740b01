"""The Docker adapter: images, sandboxed containers and BuildKit builds (the only code that imports `docker` or runs its CLI)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import docker
import docker.errors
from docker.types import LogConfig as _LogConfig
from docker.types import Mount as _DockerMount

from skupin.common.errors import BuildError, DockerError
from skupin.dockerd.capture import OutputCapture
from skupin.dockerd.daemon import engine_host, local_socket
from skupin.dockerd.owners import boot_id, owner_gone, owner_labels, pid_namespace
from skupin.dockerd.specs import (
    DEADLINE_GRACE_S,
    KILL_AFTER_S,
    OWNER_LABEL,
    SANDBOX_LABEL,
    SESSION_LABEL,
    TIMEOUT,
    ContainerSpec,
    ExecResult,
    ImageInfo,
    ReapedContainer,
    RunResult,
)

if TYPE_CHECKING:
    import requests
    from _typeshed import WriteableBuffer

# Debian's 20.10 CLI does BuildKit builds with --secret; a newer CLI without buildx cannot.
BUILDKIT_CLI_CANDIDATES = ("/usr/bin/docker", "docker")
OnEvent = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


class RunningContainer:
    """A started sandboxed container; made by `Docker.container()`, removed when it exits."""

    def __init__(self, container: docker.models.containers.Container, capture: OutputCapture) -> None:
        self._c = container
        self._capture = capture

    @property
    def id(self) -> str:
        return str(self._c.id)

    def image_id(self) -> str:
        """The sha256:... id of the image this container runs, as the daemon reports it now (not as the image says)."""
        try:
            self._c.reload()
        except docker.errors.APIError as exc:
            raise DockerError(f"inspecting container {self.id[:12]} failed: {exc.explanation or exc}") from exc
        return str(self._c.attrs.get("Image") or "")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Freeze every process of the container (cgroup freezer) for the block: it uses no CPU, whatever it runs."""
        try:
            self._c.pause()
        except docker.errors.APIError as exc:
            raise DockerError(f"pausing container {self.id[:12]} failed: {exc.explanation or exc}") from exc
        try:
            yield
        except BaseException:
            with contextlib.suppress(docker.errors.APIError):  # the block's error is the one to report
                self._c.unpause()
            raise
        try:
            self._c.unpause()
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            raise DockerError(f"unpausing container {self.id[:12]} failed: {exc.explanation or exc}") from exc

    def cpu_seconds(self) -> float:
        """CPU time every process of the container has used so far, user and system, from its cgroup's accounting
        (the daemon's stats: cpu_stats.cpu_usage.total_usage, nanoseconds). The host's other load does not add to it:
        what a CPU buyer pays for, where wall-clock tok/s moves with whoever else uses the cores."""
        try:
            stats = self._c.stats(stream=False, one_shot=True)
        except docker.errors.APIError as exc:
            raise DockerError(f"reading the CPU accounting of container {self.id[:12]} failed: "
                              f"{exc.explanation or exc}") from exc
        usage = stats.get("cpu_stats", {}).get("cpu_usage", {}).get("total_usage") if isinstance(stats, dict) else None
        if not isinstance(usage, int | float):
            raise DockerError(f"container {self.id[:12]}: the daemon reported no CPU usage")
        return float(usage) / 1e9

    @property
    def overflow(self) -> str:
        """Which output cap the container broke (it was then killed), or ''."""
        return self._capture.overflow

    def pid(self) -> int:
        """Host pid of the container's init (enter its network namespace with nsenter -t PID -n)."""
        try:
            self._c.reload()
        except docker.errors.NotFound as exc:
            raise DockerError(f"container {self.id[:12]} is gone ({self.overflow or 'it exited'})") from exc
        except docker.errors.APIError as exc:
            raise DockerError(f"inspecting container {self.id[:12]} failed: {exc.explanation or exc}") from exc
        return int(self._c.attrs["State"]["Pid"])

    def running(self) -> bool:
        try:
            self._c.reload()
        except docker.errors.NotFound:
            return False
        except docker.errors.APIError as exc:
            raise DockerError(f"inspecting container {self.id[:12]} failed: {exc.explanation or exc}") from exc
        return self._c.status == "running"

    def exec(
        self, command: list[str] | tuple[str, ...], *, user: str | None = None, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        """Run a command inside the container and wait for it (stdout and stderr merged)."""
        try:
            res = self._c.exec_run(list(command), user=user or "", environment=dict(env or {}), demux=False)
        except docker.errors.APIError as exc:
            raise DockerError(f"exec in container {self.id[:12]} failed: {exc.explanation or exc}") from exc
        return ExecResult(exit_code=int(res.exit_code), output=(res.output or b"").decode("utf-8", "replace"))

    def logs(self, *, stdout: bool = True, stderr: bool = True, tail: int | str = "all") -> str:
        """What the container printed (head and tail, bounded), from the capture: its log driver is `none`."""
        text = self._capture.text(stdout=stdout, stderr=stderr)
        return text if tail == "all" else "\n".join(text.splitlines()[-int(tail):])


class _ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of byte chunks (the engine's streamed responses)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._left = chunks, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer)
        while not self._left:
            try:
                self._left = memoryview(next(self._chunks))
            except StopIteration:
                return 0
        n = min(len(view), len(self._left))
        view[:n] = self._left[:n]
        self._left = self._left[n:]  # a view: no copy of the chunk's rest per read
        return n


def _not_found(exc: docker.errors.APIError) -> bool:
    """The engine answered 404 (ImageNotFound, NotFound, or a bare APIError carrying the status)."""
    return isinstance(exc, docker.errors.NotFound) or exc.status_code == 404


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timeout" in text or "timed out" in text


class Docker:
    """A connected Docker engine: images, sandboxed containers and BuildKit builds."""

    def __init__(self, client: docker.DockerClient, *, host: str, cli: str | None = None) -> None:
        self._client = client
        self.host = host  # unix:///var/run/docker.sock, tcp://..., ssh://...
        self.socket = local_socket(host)  # None: an engine elsewhere (the gate's bind mounts need this host's)
        self._cli = cli
        # Every container this Docker object creates carries SESSION_LABEL=<this id>, so a caller
        # can find (only) its own leftovers on an engine other people use at the same time.
        self.session = uuid.uuid4().hex[:16]

    # ------------------------------------------------------------ basics

    def ping(self) -> str:
        """The server version; DockerError when the engine does not answer."""
        try:
            self._client.ping()
            return str(self._client.version().get("Version", "unknown"))
        except Exception as exc:
            raise DockerError(f"the Docker engine at {self.host} does not answer: {exc}") from exc

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
            raise DockerError(f"inspecting image {ref} failed: {exc.explanation or exc}") from exc
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
            raise DockerError(f"no image {ref}")
        try:
            images = self._client.df().get("Images") or []
        except docker.errors.APIError as exc:
            raise DockerError(f"docker system df failed: {exc.explanation or exc}") from exc
        row = next((i for i in images if i.get("Id") == info.id), None)
        if row is None:
            raise DockerError(f"docker system df does not list {ref}")
        return int(row.get("Size") or 0) - max(int(row.get("SharedSize") or 0), 0)

    def image_config(self, ref: str) -> dict:
        """The image's config (Env, Entrypoint, Cmd, WorkingDir, User, ...) as the engine stores it."""
        try:
            return dict(self._client.api.inspect_image(ref).get("Config") or {})
        except docker.errors.APIError as exc:
            if _not_found(exc):
                raise DockerError(f"image {ref} is not on this engine: {exc.explanation or exc}") from exc
            raise DockerError(f"inspecting image {ref} failed: {exc.explanation or exc}") from exc

    def layer_dirs(self, ref: str) -> tuple[Path, ...] | None:
        """The folders holding each layer of `ref` on this machine, bottom first, when the engine stores them
        with overlay2 on a local disk this process can read; None otherwise (then use `save_image`)."""
        try:
            data = self._client.api.inspect_image(ref).get("GraphDriver") or {}
        except docker.errors.APIError as exc:
            raise DockerError(f"inspecting image {ref} failed: {exc.explanation or exc}") from exc
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
            raise DockerError(f"saving image {ref} failed: {exc.explanation or exc}") from exc
        return _ChunkReader(iter(chunks))

    def load_image(self, chunks: Iterable[bytes]) -> str:
        """`docker load` a docker-save tarball streamed as `chunks`; the id of the image it loaded.

        DockerError on an error message in the engine's answer or when it names no loaded image id."""
        loaded: list[str] = []
        try:
            for message in self._client.api.load_image(iter(chunks), quiet=True):  # an iterator: streamed, chunked
                if not isinstance(message, dict):
                    continue
                if message.get("error") or message.get("errorDetail") or ("message" in message and "stream" not in message):
                    detail = message.get("errorDetail") or {}
                    why = message.get("error") or detail.get("message") or message.get("message") or detail
                    raise DockerError(f"docker load failed: {why}")
                text = str(message.get("stream") or "")
                if text.startswith("Loaded image ID: "):
                    loaded.append(text.removeprefix("Loaded image ID: ").strip())
        except docker.errors.APIError as exc:
            raise DockerError(f"docker load failed: {exc.explanation or exc}") from exc
        if len(loaded) != 1:
            raise DockerError(f"docker load named {len(loaded)} loaded image ids, expected one")
        return loaded[0]

    def tag(self, image: str, tag: str) -> None:
        """Point `tag` (repo:tag) at `image`."""
        repo, _, name = tag.rpartition(":")
        if not repo or "/" in name:
            repo, name = tag, "latest"
        try:
            ok = self._client.api.tag(image, repo, name, force=True)
        except docker.errors.APIError as exc:
            raise DockerError(f"tagging {image} as {tag} failed: {exc.explanation or exc}") from exc
        if not ok:
            raise DockerError(f"tagging {image} as {tag} failed")

    def remove_image(self, ref: str, *, force: bool = False) -> bool:
        """Remove a tag or image; False when it did not exist."""
        try:
            self._client.api.remove_image(ref, force=force, noprune=False)
            return True
        except docker.errors.APIError as exc:
            if _not_found(exc):
                return False
            raise DockerError(f"removing image {ref} failed: {exc.explanation or exc}") from exc

    def pull(self, ref: str, *, hint: bool = True) -> str:
        """Pull `ref` (name@sha256:... or name:tag) and return its image id; DockerError when unreachable or absent
        (with `hint`, the error suggests loading the image or a bootstrap base, as for a base)."""
        try:
            image = self._client.images.pull(ref)
        except docker.errors.APIError as exc:
            fix = ("; no registry is reachable from here? fix: load the image (docker load) on this machine, or use a "
                   "bootstrap base") if hint else ""
            raise DockerError(f"cannot pull {ref}: {exc.explanation or exc}{fix}") from exc
        return str(image.id)

    def push(self, reference: str, *, on_event: OnEvent = _quiet) -> str:
        """Push `reference` (host/repo:tag); return the manifest digest the registry stored.

        Every chunk of the push stream is checked: docker-py reports a failed push as a chunk with
        `error`/`errorDetail` and raises nothing. DockerError on any error chunk, on a broken
        stream, or when the stream ends without a digest.
        """
        repo, _, tag = reference.rpartition(":")
        if not repo or "/" in tag:
            raise DockerError(f"push needs a reference with a tag (host/repo:tag), not {reference!r}")
        digest: str | None = None
        try:
            for chunk in self._client.api.push(repo, tag=tag, stream=True, decode=True):
                if not isinstance(chunk, dict):
                    raise DockerError(f"pushing {reference}: unexpected stream chunk {chunk!r:.200}")
                if chunk.get("error") or chunk.get("errorDetail"):
                    detail = chunk.get("errorDetail") or {}
                    raise DockerError(f"pushing {reference} failed: {chunk.get('error') or detail.get('message') or detail}")
                aux = chunk.get("aux") or {}
                if isinstance(aux, dict) and str(aux.get("Digest", "")).startswith("sha256:"):
                    digest = str(aux["Digest"])
                status = str(chunk.get("status") or "")
                if status and status not in ("Pushing", "Waiting", "Preparing"):
                    on_event(f"push {chunk.get('id', '')} {status}".replace("  ", " "))
        except DockerError:
            raise
        except docker.errors.APIError as exc:
            raise DockerError(f"pushing {reference} failed: {exc.explanation or exc}") from exc
        except Exception as exc:  # requests' connection/read errors mid-stream
            raise DockerError(f"pushing {reference} failed: the push stream broke: {exc}") from exc
        if digest is None:
            raise DockerError(f"pushing {reference}: the engine reported no digest; treating the push as failed")
        return digest

    def import_rootfs(self, *, rootfs: Path, reference: str, on_event: OnEvent = _quiet,
                      source_date_epoch: int | None = None) -> str:
        """`tar -C rootfs -c . | docker import - reference`; returns the new image id.

        With `source_date_epoch` the tar is the same bytes for the same tree (GNU tar: names sorted, no pax headers,
        numeric owners, mtimes clamped to the epoch), so the layer's diff id (the tar's sha256) names the content."""
        cli = self.cli()
        on_event(f"importing {rootfs} as {reference}")
        tar_cmd = ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."]
        if source_date_epoch is not None:
            tar_cmd[1:1] = ["--sort=name", "--format=gnu", f"--mtime=@{source_date_epoch}", "--clamp-mtime"]
        with subprocess.Popen(tar_cmd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as tar:  # both pipes closed and tar waited for
            try:
                imp = subprocess.run([cli, "import", "-", reference], stdin=tar.stdout, capture_output=True, text=True,
                                     env=self._cli_env(), check=False)
            finally:
                if tar.stdout is not None:
                    tar.stdout.close()
                tar_err = tar.stderr.read().decode("utf-8", "replace") if tar.stderr else ""
                tar.wait()
        if tar.returncode != 0 or imp.returncode != 0:
            raise DockerError(f"importing {rootfs} as {reference} failed: tar exit {tar.returncode} {tar_err.strip()}; "
                              f"import exit {imp.returncode} {imp.stderr.strip()}")
        return imp.stdout.strip()

    # ------------------------------------------------------------ containers

    def _argv(self, spec: ContainerSpec) -> tuple[list[str] | None, list[str] | None]:
        """(entrypoint, command) to create: the spec's, or under `timeout` when it has a deadline."""
        if spec.deadline_s is None:
            return (list(spec.entrypoint) if spec.entrypoint is not None else None), (list(spec.command) or None)
        entrypoint, command = spec.entrypoint, spec.command
        if entrypoint is None:  # the image's own, as `docker run` would combine them
            config = self.image_config(spec.image)
            entrypoint = tuple(config.get("Entrypoint") or ())
            command = command or tuple(config.get("Cmd") or ())
        argv = [*entrypoint, *command]
        if not argv:
            raise DockerError(f"image {spec.image} has no command to run under a deadline")
        limit = int(spec.deadline_s + DEADLINE_GRACE_S + 0.999)
        return [TIMEOUT, f"--kill-after={KILL_AFTER_S}", f"{limit}s", *argv], None

    def _create(self, spec: ContainerSpec) -> docker.models.containers.Container:
        if spec.mounts and self.socket is None:  # a bind mount names a path of the engine's host, not of this one
            raise DockerError(f"{spec.image}: bind-mounts this host's files ({', '.join(m.target for m in spec.mounts)}) "
                              f"but the engine at {self.host} runs elsewhere; fix: unset DOCKER_HOST or `docker context "
                              f"use default` for the gate")
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
        if spec.cpuset is not None:
            kwargs["cpuset_cpus"] = spec.cpuset
        optional = (("user", spec.user), ("working_dir", spec.workdir), ("shm_size", spec.shm_size), ("ipc_mode", spec.ipc),
                    ("name", spec.name))
        for key, value in optional:
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
            raise DockerError(f"image {spec.image} is not on this engine: {exc.explanation or exc}") from exc
        except docker.errors.APIError as exc:
            raise DockerError(f"creating a container of {spec.image} failed: {exc.explanation or exc}") from exc

    def _attach(self, container_id: str, spec: ContainerSpec, *, keep_stdout: bool) -> OutputCapture:
        """Attach to stdout and stderr BEFORE start (nothing is missed) and read them on a thread, bounded."""
        try:
            sock = self._client.api.attach_socket(container_id, params={"stdout": 1, "stderr": 1, "stream": 1, "logs": 0})
        except docker.errors.APIError as exc:
            raise DockerError(f"attaching to container {container_id[:12]} failed: {exc.explanation or exc}") from exc
        capture = OutputCapture(max_stdout=spec.max_stdout_bytes, max_stderr=spec.max_stderr_bytes,
                                keep_stdout=keep_stdout, on_overflow=lambda: self._kill(container_id))
        capture.start(sock)
        return capture

    def _start(self, container: docker.models.containers.Container, spec: ContainerSpec) -> None:
        try:
            container.start()
        except docker.errors.APIError as exc:
            raise DockerError(f"starting a container of {spec.image} failed: {exc.explanation or exc}") from exc

    def _wait_removed(self, container_id: str, *, timeout_s: float) -> requests.Response:
        """Register a wait for the container's removal BEFORE start (as `docker run --rm` does): dockerd
        answers the headers once the wait is registered, the body (the exit status) once it is removed."""
        api = self._client.api
        try:
            response = api._post(api._url("/containers/{0}/wait", container_id), params={"condition": "removed"},
                                 stream=True, timeout=timeout_s)
        except docker.errors.APIError as exc:
            raise DockerError(f"waiting for container {container_id[:12]} failed: {exc.explanation or exc}") from exc
        try:
            api._raise_for_status(response)
        except docker.errors.APIError as exc:
            response.close()
            raise DockerError(f"waiting for container {container_id[:12]} failed: {exc.explanation or exc}") from exc
        return response

    def _exit_status(self, response: requests.Response, container_id: str) -> int | None:
        """The exit status from a registered wait; None when its timeout (the host's deadline) passed."""
        try:
            body = response.json()
        except Exception as exc:  # requests' ConnectionError(ReadTimeout) at the deadline
            if _is_timeout(exc):
                return None
            raise DockerError(f"waiting for container {container_id[:12]} failed: {exc}") from exc
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
                    raise DockerError(f"removing container {container_id[:12]} failed: {exc.explanation or exc}") from exc
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
            raise DockerError("a one-shot container needs a deadline (deadline_s)")
        start = time.monotonic()
        c = self._create(spec)
        capture: OutputCapture | None = None
        waiter = None
        try:
            capture = self._attach(c.id, spec, keep_stdout=True)
            waiter = self._wait_removed(c.id, timeout_s=limit)
            self._start(c, spec)
            code = self._exit_status(waiter, c.id)  # closes the wait's response
            if code is None:
                self._kill(c.id)
            capture.join(timeout_s=30)
        finally:
            if waiter is not None:
                waiter.close()  # also when start failed (closing twice is harmless)
            if capture is not None:
                capture.close()
            self._remove(c.id)
        return RunResult(exit_code=code, stdout_bytes=capture.stdout_bytes(), stdout_excerpt=capture.text(stderr=False),
                         stderr=capture.text(stdout=False), timed_out=code is None,
                         seconds=round(time.monotonic() - start, 3), overflow=capture.overflow)

    def containers(self, *, label: str | None = None, all: bool = True) -> tuple[str, ...]:
        """Ids of containers (running or not), optionally only those with a label (key or key=value)."""
        filters = {"label": label} if label else None
        try:
            rows = self._client.api.containers(all=all, filters=filters)
        except docker.errors.APIError as exc:
            raise DockerError(f"listing containers failed: {exc.explanation or exc}") from exc
        return tuple(str(r["Id"]) for r in rows)

    def reap_orphans(self) -> tuple[ReapedContainer, ...]:
        """Force-remove the sandbox containers whose owner process is gone (see `owner_gone`); what was removed."""
        try:
            rows = self._client.api.containers(all=True, filters={"label": SANDBOX_LABEL})
        except docker.errors.APIError as exc:
            raise DockerError(f"listing containers failed: {exc.explanation or exc}") from exc
        boot, pidns = boot_id(), pid_namespace()
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
        raise DockerError("no `docker` CLI found; fix: apt-get install docker.io (Debian's CLI does BuildKit builds)")

    def _cli_env(self) -> dict[str, str]:
        # the engine is named here; TLS settings and the CLI's config (registry logins) are kept
        env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_BUILDKIT")}
        env.update(DOCKER_HOST=self.host, DOCKER_BUILDKIT="1", BUILDKIT_PROGRESS="plain")
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
        target: str | None = None,
        output_dir: Path | None = None,
        cache_from: str | None = None,
    ) -> str:
        """Build with BuildKit (`docker build --progress=plain --iidfile`); return the image id.

        With `target` only that stage is built; with `output_dir` its files are written there
        (`--output type=local`) instead of an image, and "" is returned. With `cache_from` (an image reference in a
        registry, pushed from an earlier build with BUILDKIT_INLINE_CACHE=1) BuildKit reuses the steps that reference's
        inline cache holds; a reference the registry does not have is a cold build, not a failure.

        No tag is given: the caller tags only after every check passed, so a failed build
        leaves no tag. Every output line goes to `on_line` (the caller keeps what it needs, e.g. to
        map a failed step to its layer). On failure raises BuildError with the exit code. On
        Ctrl-C the CLI is interrupted and waited for, which cancels the build in the engine
        (BuildKit's build containers end with the client's session).
        """
        with tempfile.TemporaryDirectory(prefix="skupin-build-") as tmp:
            iidfile = Path(tmp) / "iid"
            cmd = [self.cli(), "build", "--progress=plain", "-f", str(dockerfile)]
            if output_dir is None:  # a local export makes no image, and the CLI fails on an --iidfile it cannot write
                cmd[3:3] = ["--iidfile", str(iidfile)]
            for k, v in (build_args or {}).items():
                cmd += ["--build-arg", f"{k}={v}"]
            for k, path in (secrets or {}).items():
                cmd += ["--secret", f"id={k},src={path}"]
            if no_cache:
                cmd.append("--no-cache")
            if target:
                cmd += ["--target", target]
            if cache_from:
                cmd += ["--cache-from", cache_from]
            if output_dir is not None:
                cmd += ["--output", f"type=local,dest={output_dir}"]
            cmd.append(str(context))
            code = self._stream(cmd, on_line=on_line)
            if code != 0:
                raise BuildError(f"docker build exited with code {code}")
            if output_dir is not None:
                return ""
            try:
                return iidfile.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise BuildError("docker build succeeded but wrote no image id") from exc

    def _stream(self, cmd: list[str], *, on_line: OnEvent) -> int:
        with subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self._cli_env(), start_new_session=True, text=True, errors="replace", bufsize=1,
            preexec_fn=_interrupt_when_parent_dies,
        ) as proc:  # its pipe is closed and the process waited for, however this ends
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
        proc = subprocess.run([self.cli(), "builder", "prune", "--all", "--force"], env=self._cli_env(), capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise DockerError(f"docker builder prune failed: {proc.stderr.strip()}")


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


def connect(*, socket: Path | None = None, timeout_s: int = 120, cli: str | None = None) -> Docker:
    """Connect to the engine on `socket`, by default the one the docker CLI would use (`engine_host`: DOCKER_HOST, the
    Docker context, /var/run/docker.sock); DockerError (with the fix) when none answers."""
    host = f"unix://{socket}" if socket is not None else engine_host()
    try:
        if socket is None and os.environ.get("DOCKER_HOST"):  # docker-py reads DOCKER_TLS_VERIFY/DOCKER_CERT_PATH too
            client = docker.from_env(timeout=timeout_s, use_ssh_client=True)
        else:  # ssh:// through the ssh client (as the docker CLI does), not paramiko
            client = docker.DockerClient(base_url=host, timeout=timeout_s, use_ssh_client=host.startswith("ssh://"))
        client.ping()
    except Exception as exc:
        raise DockerError(f"no Docker daemon answers at {host}: {exc}; fix: run `skupin docker up`") from exc
    return Docker(client, host=host, cli=cli)
