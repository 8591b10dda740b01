"""Unit-test guards: no Docker client can be created and no socket leaves this machine."""

from __future__ import annotations

import ipaddress
import socket

import pytest


class ForbiddenInUnitTests(RuntimeError):
    pass


def _refuse_docker(*_args, **_kwargs):
    raise ForbiddenInUnitTests("unit tests must not talk to Docker; write an integration test")


@pytest.fixture(autouse=True)
def _no_docker_no_network(monkeypatch):
    import docker

    monkeypatch.setattr(docker, "from_env", _refuse_docker)
    monkeypatch.setattr(docker, "DockerClient", _refuse_docker)
    monkeypatch.setattr(docker, "APIClient", _refuse_docker)
    real_connect = socket.socket.connect

    def guarded_connect(sock, address):
        if sock.family == socket.AF_UNIX:
            raise ForbiddenInUnitTests(f"unit tests must not open unix sockets ({address})")
        host = address[0] if isinstance(address, tuple) else address
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise ForbiddenInUnitTests(f"unit tests must not reach the network ({address})")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    yield
