"""What skupin does to the host: the Docker engine it talks to (DOCKER_HOST, Docker contexts) and Debian packages it
installs only when asked (issue 20). No engine, no apt-get: the refusals and the lookups are pure."""

from __future__ import annotations

import hashlib
import json

import pytest

from skupin.common import apt
from skupin.common.errors import DockerError, PublishError
from skupin.dockerd import DEFAULT_SOCKET, engine_host
from skupin.dockerd.daemon import local_socket


@pytest.fixture
def docker_env(tmp_path, monkeypatch):
    for name in ("DOCKER_HOST", "DOCKER_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    return tmp_path


def _context(config, name: str, host: str) -> None:
    meta = config / "contexts" / "meta" / hashlib.sha256(name.encode()).hexdigest()
    meta.mkdir(parents=True)
    (meta / "meta.json").write_text(json.dumps({"Name": name, "Endpoints": {"docker": {"Host": host}}}))


def test_the_engine_is_the_one_the_docker_cli_would_use(docker_env, monkeypatch):
    assert engine_host() == f"unix://{DEFAULT_SOCKET}"
    _context(docker_env, "remote", "tcp://10.0.0.5:2376")
    (docker_env / "config.json").write_text(json.dumps({"currentContext": "remote"}))
    assert engine_host() == "tcp://10.0.0.5:2376"
    _context(docker_env, "other", "unix:///run/user/1000/docker.sock")
    monkeypatch.setenv("DOCKER_CONTEXT", "other")
    assert engine_host() == "unix:///run/user/1000/docker.sock"
    assert local_socket(engine_host()) is not None and str(local_socket(engine_host())) == "/run/user/1000/docker.sock"
    monkeypatch.setenv("DOCKER_HOST", "ssh://builder@host")
    assert engine_host() == "ssh://builder@host" and local_socket(engine_host()) is None


def test_a_context_that_cannot_be_read_is_named(docker_env, monkeypatch):
    monkeypatch.setenv("DOCKER_CONTEXT", "gone")
    with pytest.raises(DockerError, match="cannot read the endpoint of Docker context 'gone'.*docker context use default"):
        engine_host()
    (docker_env / "config.json").write_text("[" * 100_000)  # a hostile config is "no context", not a crash
    monkeypatch.delenv("DOCKER_CONTEXT")
    assert engine_host() == f"unix://{DEFAULT_SOCKET}"


def test_packages_are_installed_only_when_asked(monkeypatch):
    monkeypatch.delenv(apt.ENV, raising=False)
    ran: list[str] = []
    monkeypatch.setattr(apt.subprocess, "run", lambda *a, **k: ran.append(a[0]))  # never reached when not allowed
    with pytest.raises(PublishError, match=r"docker-registry not found: Debian's docker-registry is needed; fix: "
                                           r"`apt-get install docker-registry`, or .*--install-missing"):
        apt.apt_install("docker-registry", why="docker-registry not found", error=PublishError, on_event=ran.append)
    assert ran == []
    monkeypatch.setenv(apt.ENV, "1")
    assert apt.installs_allowed()
    monkeypatch.delenv(apt.ENV)
    apt.allow_installs()
    try:
        assert apt.installs_allowed()
    finally:
        apt.allow_installs(False)
    assert not apt.installs_allowed()
