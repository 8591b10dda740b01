"""The engine adapter's sandbox logic without Docker: bounded output capture, the deadline wrapper, owner labels."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from skupin.dockerd import DEADLINE_GRACE_S, KILL_AFTER_S, SANDBOX_LABEL, ContainerSpec, Docker
from skupin.dockerd.capture import OutputCapture
from skupin.dockerd.owners import owner_gone, owner_labels
from skupin.dockerd.specs import OWNER_BOOT_LABEL, OWNER_PID_LABEL, OWNER_PIDNS_LABEL, OWNER_START_LABEL

# ---------------------------------------------------------------- capture


def test_stdout_is_kept_whole_and_stderr_as_head_and_tail() -> None:
    cap = OutputCapture(max_stdout=1000, max_stderr=10**9, keep_stdout=True)
    assert cap.feed(1, b"frame-") and cap.feed(1, b"bytes")
    for i in range(40_000):
        assert cap.feed(2, f"line {i}\n".encode())
    assert cap.stdout_bytes() == b"frame-bytes" and not cap.overflow
    err = cap.text(stdout=False)
    assert err.startswith("line 0\n") and err.endswith("line 39999\n") and "bytes not kept" in err
    assert len(err) < 400 * 1024


def test_passing_a_cap_is_an_overflow_and_drops_what_was_kept() -> None:
    cap = OutputCapture(max_stdout=10, max_stderr=10, keep_stdout=True)
    assert cap.feed(1, b"12345")
    assert not cap.feed(1, b"678901")
    assert "stdout passed its cap of 10 bytes" in cap.overflow and cap.stdout_bytes() == b""
    err = OutputCapture(max_stdout=10, max_stderr=3, keep_stdout=False)
    assert not err.feed(2, b"abcd") and "stderr passed its cap of 3 bytes" in err.overflow


def test_the_pump_detaches_then_kills_on_overflow(monkeypatch) -> None:
    events: list[str] = []

    class Sock:
        def close(self) -> None:
            events.append("close")

    frames = iter([(1, b"abc"), (1, b"defgh"), (1, b"never read")])
    monkeypatch.setattr("skupin.dockerd.capture._frames_iter", lambda sock, tty: frames)
    cap = OutputCapture(max_stdout=4, max_stderr=4, keep_stdout=True, on_overflow=lambda: events.append("kill"))
    cap.start(Sock())
    assert cap.join(5)
    assert events[:2] == ["close", "kill"] and cap.overflow and cap.stdout_bytes() == b""
    assert next(frames) == (1, b"never read")  # reading stopped at the overflow


# ---------------------------------------------------------------- the deadline wrapper


class FakeApi:
    def inspect_image(self, ref: str) -> dict:
        return {"Config": {"Entrypoint": ["/entry.sh"], "Cmd": ["serve", "--port", "8000"]}}


def docker() -> Docker:
    return Docker(SimpleNamespace(api=FakeApi()), host="unix:///nonexistent.sock")


def test_a_deadline_runs_the_command_under_timeout_as_pid_1() -> None:
    spec = ContainerSpec(image="img", entrypoint=("python3",), command=("/skupin/probe.py", "--out", "-"), deadline_s=100)
    entry, command = docker()._argv(spec)
    assert entry == ["/usr/bin/timeout", f"--kill-after={KILL_AFTER_S}", f"{100 + DEADLINE_GRACE_S}s", "python3",
                     "/skupin/probe.py", "--out", "-"]
    assert command is None


def test_without_an_entrypoint_the_images_own_command_is_wrapped() -> None:
    entry, _ = docker()._argv(ContainerSpec(image="img", deadline_s=10))
    assert entry[3:] == ["/entry.sh", "serve", "--port", "8000"]
    entry, _ = docker()._argv(ContainerSpec(image="img", command=("other",), deadline_s=10))
    assert entry[3:] == ["/entry.sh", "other"]


def test_without_a_deadline_nothing_is_wrapped() -> None:
    assert docker()._argv(ContainerSpec(image="img", entrypoint=("sh",), command=("-c", "true"))) == (["sh"], ["-c", "true"])


# ---------------------------------------------------------------- owners and the reaper's judgement


def fake_proc(tmp_path: Path, pid: int, *, state: str = "S", start: str = "4242") -> Path:
    fields = [state] + ["0"] * 18 + [start] + ["0"] * 10
    (tmp_path / str(pid)).mkdir(parents=True, exist_ok=True)
    (tmp_path / str(pid) / "stat").write_text(f"{pid} (python3 (x) y) {' '.join(fields)}\n")
    return tmp_path


def labels(pid: int = 77, start: str = "4242", boot: str = "boot-a", pidns: str = "pid:[1]") -> dict[str, str]:
    return {SANDBOX_LABEL: "1", OWNER_PID_LABEL: str(pid), OWNER_START_LABEL: start, OWNER_BOOT_LABEL: boot,
            OWNER_PIDNS_LABEL: pidns}


def test_this_process_is_named_with_its_start_time_and_boot() -> None:
    mine = owner_labels()
    assert mine[OWNER_PID_LABEL] == str(os.getpid()) and mine[OWNER_START_LABEL].isdigit()
    assert len(mine[OWNER_BOOT_LABEL]) == 36 and mine[OWNER_PIDNS_LABEL].startswith("pid:[")
    assert owner_gone(mine, boot_id=mine[OWNER_BOOT_LABEL], pid_namespace=mine[OWNER_PIDNS_LABEL]) == ""


@pytest.mark.parametrize("state, start, want", [
    ("S", "4242", ""),
    ("Z", "4242", "has exited"),
    ("S", "9999", "now belongs to another process"),
])
def test_owner_alive_zombie_or_reused(tmp_path: Path, state: str, start: str, want: str) -> None:
    proc = fake_proc(tmp_path, 77, state=state, start=start)
    why = owner_gone(labels(), boot_id="boot-a", pid_namespace="pid:[1]", proc=proc)
    assert (want in why) if want else why == ""


def test_owner_gone_when_its_pid_is_gone_or_it_ran_in_another_boot(tmp_path: Path) -> None:
    assert "has exited" in owner_gone(labels(), boot_id="boot-a", pid_namespace="pid:[1]", proc=tmp_path)
    proc = fake_proc(tmp_path, 77)
    assert "another boot" in owner_gone(labels(boot="boot-old"), boot_id="boot-a", pid_namespace="pid:[1]", proc=proc)


def test_containers_that_cannot_be_judged_are_left_alone(tmp_path: Path) -> None:
    assert owner_gone(labels(pidns="pid:[2]"), boot_id="boot-a", pid_namespace="pid:[1]", proc=tmp_path) == ""
    assert owner_gone({SANDBOX_LABEL: "1"}, boot_id="boot-a", pid_namespace="pid:[1]", proc=tmp_path) == ""
    assert owner_gone({**labels(), OWNER_PID_LABEL: "x1"}, boot_id="boot-a", pid_namespace="pid:[1]", proc=tmp_path) == ""


# ---------------------------------------------------------------- engine errors and cleanup


def test_a_failed_start_closes_the_registered_wait(monkeypatch) -> None:
    from skupin.common.errors import DockerError

    closed: list[str] = []

    class Response:
        def close(self) -> None:
            closed.append("wait")

    class Capture:
        def close(self) -> None:
            closed.append("capture")

    d = docker()
    monkeypatch.setattr(d, "_create", lambda spec: SimpleNamespace(id="c" * 64))
    monkeypatch.setattr(d, "_attach", lambda *a, **k: Capture())
    monkeypatch.setattr(d, "_wait_removed", lambda *a, **k: Response())
    monkeypatch.setattr(d, "_remove", lambda cid: closed.append("remove"))

    def refuse(*_a) -> None:
        raise DockerError("starting a container of img failed: no such binary")

    monkeypatch.setattr(d, "_start", refuse)
    with pytest.raises(DockerError, match="starting"):
        d.run(ContainerSpec(image="img", entrypoint=("sh",), deadline_s=10))
    assert sorted(closed) == ["capture", "remove", "wait"]


def test_an_engine_error_while_reloading_a_container_is_a_docker_error() -> None:
    import docker as docker_sdk

    from skupin.common.errors import DockerError
    from skupin.dockerd.client import RunningContainer

    class Broken:
        id = "c" * 64

        def reload(self) -> None:
            raise docker_sdk.errors.APIError("500 Server Error: the engine is restarting")

    running = RunningContainer(Broken(), OutputCapture(max_stdout=1, max_stderr=1, keep_stdout=False))  # type: ignore[arg-type]
    with pytest.raises(DockerError, match="restarting"):
        running.pid()
    with pytest.raises(DockerError, match="restarting"):
        running.running()


def test_one_image_config_reader_says_when_the_image_is_missing() -> None:
    import docker as docker_sdk

    from skupin.common.errors import DockerError

    class Missing:
        def inspect_image(self, ref: str) -> dict:
            raise docker_sdk.errors.ImageNotFound(f"No such image: {ref}")

    assert docker().image_config("img") == {"Entrypoint": ["/entry.sh"], "Cmd": ["serve", "--port", "8000"]}
    assert not hasattr(Docker, "_image_config")
    with pytest.raises(DockerError, match="not on this engine"):
        Docker(SimpleNamespace(api=Missing()), host="unix:///nonexistent.sock").image_config("img")


def test_bind_mounts_are_refused_on_an_engine_that_is_not_on_this_host(tmp_path) -> None:
    """A bind mount names a path of the engine's host: on a remote engine it would mount that host's files."""
    from skupin.common.errors import DockerError
    from skupin.dockerd import BindMount

    remote = Docker(SimpleNamespace(api=FakeApi()), host="tcp://10.0.0.5:2376")
    spec = ContainerSpec(image="img", command=("true",), mounts=(BindMount(source=tmp_path, target="/skupin"),))
    with pytest.raises(DockerError, match="bind-mounts this host's files \\(/skupin\\) but the engine at tcp://10.0.0.5"):
        remote._create(spec)
