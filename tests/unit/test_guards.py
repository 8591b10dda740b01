"""The unit-test guards themselves hold: Docker and the network are out of reach."""

import socket

import pytest

from tests.unit.conftest import ForbiddenInUnitTests


def test_docker_client_creation_is_refused():
    import docker

    with pytest.raises(ForbiddenInUnitTests):
        docker.from_env()


def test_outside_network_is_refused():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(ForbiddenInUnitTests):
        sock.connect(("192.0.2.1", 443))
