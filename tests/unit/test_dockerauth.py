"""Registry logins from the Docker config (skupin/clients/dockerauth.py): credential helpers run as real processes
(small executables on PATH that speak docker-credential-helpers' protocol), then `auths`. No network."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from skupin.clients.dockerauth import MAX_HELPER_OUTPUT, docker_credentials, helper_credentials
from skupin.clients.oci import RegistryClient
from skupin.common.errors import NetworkError

SECRET = "s3cret-value"


@pytest.fixture
def helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder first on PATH for fake docker-credential-* programs; each logs its stdin to <name>.calls."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
    return folder


def _helper(folder: Path, name: str, body: str) -> Path:
    """docker-credential-<name>: `body` runs with `server` (stdin) and `op` (argv[1]) set; every call is logged."""
    path = folder / f"docker-credential-{name}"
    path.write_text(f"#!{sys.executable}\nimport json, sys, time\nop = sys.argv[1]\nserver = sys.stdin.read()\n"
                    f"open({str(folder / (name + '.calls'))!r}, 'a').write(op + ' ' + server + '\\n')\n{body}\n")
    path.chmod(0o755)
    return path


def _answers(folder: Path, name: str, logins: dict[str, tuple[str, str]]) -> None:
    _helper(folder, name, f"logins = {logins!r}\n"
                          "if server not in logins:\n"
                          "    print('credentials not found in native keychain'); sys.exit(1)\n"
                          "user, secret = logins[server]\n"
                          "print(json.dumps({'ServerURL': server, 'Username': user, 'Secret': secret}))")


def _calls(folder: Path, name: str) -> list[str]:
    log = folder / f"{name}.calls"
    return log.read_text().splitlines() if log.exists() else []


def _config(tmp_path: Path, **data: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def _auth(user: str, password: str) -> dict[str, str]:
    return {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_cred_helpers_name_the_helper_of_one_registry(tmp_path: Path, helpers: Path) -> None:
    _answers(helpers, "ecr", {"123.dkr.ecr.example.com": ("AWS", SECRET)})
    config = _config(tmp_path, credHelpers={"123.dkr.ecr.example.com": "ecr"},
                     auths={"123.dkr.ecr.example.com": _auth("file", "file-pw")})
    login = docker_credentials("123.dkr.ecr.example.com", config=config)
    assert login is not None and (login.username, login.secret.get_secret_value()) == ("AWS", SECRET)
    assert _calls(helpers, "ecr") == ["get 123.dkr.ecr.example.com"]  # `get`, the server on stdin, as Docker does
    assert docker_credentials("other.example.com", config=config) is None  # no helper, no auths entry for it
    assert _calls(helpers, "ecr") == ["get 123.dkr.ecr.example.com"]


def test_creds_store_serves_every_registry_and_docker_hub_by_its_v1_address(tmp_path: Path, helpers: Path) -> None:
    _answers(helpers, "pass", {"https://index.docker.io/v1/": ("hubuser", SECRET), "ghcr.io": ("me", "gh-token")})
    config = _config(tmp_path, credsStore="pass", auths={"ghcr.io": {}})  # Docker leaves empty entries beside a store
    hub = docker_credentials("registry-1.docker.io", config=config)
    assert hub is not None and hub.username == "hubuser"
    ghcr = docker_credentials("ghcr.io", config=config)
    assert ghcr is not None and ghcr.secret.get_secret_value() == "gh-token"
    assert _calls(helpers, "pass") == ["get https://index.docker.io/v1/", "get ghcr.io"]


def test_cred_helpers_win_over_creds_store(tmp_path: Path, helpers: Path) -> None:
    _answers(helpers, "gcloud", {"gcr.io": ("oauth2accesstoken", "ya29")})
    _answers(helpers, "desktop", {"gcr.io": ("wrong", "wrong")})
    config = _config(tmp_path, credsStore="desktop", credHelpers={"gcr.io": "gcloud"})
    login = docker_credentials("gcr.io", config=config)
    assert login is not None and login.username == "oauth2accesstoken"
    assert _calls(helpers, "desktop") == []


def test_a_helper_without_a_login_falls_back_to_auths(tmp_path: Path, helpers: Path) -> None:
    _answers(helpers, "desktop", {})
    config = _config(tmp_path, credsStore="desktop", auths={"127.0.0.1:5000": _auth("local", "pw")})
    login = docker_credentials("127.0.0.1:5000", config=config)
    assert login is not None and (login.username, login.secret.get_secret_value()) == ("local", "pw")
    assert docker_credentials("127.0.0.1:5001", config=config) is None


def test_docker_config_is_where_docker_reads_it(tmp_path: Path, helpers: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _config(tmp_path, auths={"ghcr.io": _auth("env", "pw")})
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    login = docker_credentials("ghcr.io")
    assert login is not None and login.username == "env"


@pytest.mark.parametrize(("body", "why", "timeout"), [
    ("print('permission denied by the keyring', file=sys.stderr); sys.exit(3)",
     "failed (exit 3): permission denied by the keyring", 30.0),
    ("print('not json')", "did not answer a JSON object with Username and Secret", 30.0),
    ("print(json.dumps({'Username': '<token>', 'Secret': 'refresh'}))", "identity token", 30.0),
    ("time.sleep(30)", "did not answer within 0.5 s", 0.5),
    ("sys.stdout.write('x' * (1 << 20)); sys.stdout.flush(); time.sleep(30)", f"more than {MAX_HELPER_OUTPUT} bytes", 20.0),
])
def test_a_helper_that_fails_hangs_or_floods_is_a_clear_error(helpers: Path, body: str, why: str,
                                                              timeout: float) -> None:
    """(A deadline only where the case is the deadline: a helper that answers at once may still take seconds to start
    on a loaded host.)"""
    _helper(helpers, "bad", body)
    with pytest.raises(NetworkError, match="docker-credential-bad") as err:
        helper_credentials("bad", "ghcr.io", timeout=timeout)
    assert why in str(err.value)


def test_a_missing_helper_is_named_with_the_fix(tmp_path: Path, helpers: Path) -> None:
    config = _config(tmp_path, credsStore="desktop")
    with pytest.raises(NetworkError) as err:
        docker_credentials("ghcr.io", config=config)
    assert "docker-credential-desktop is not on PATH" in str(err.value) and "fix: install it" in str(err.value)


def test_a_helper_name_is_never_a_path(tmp_path: Path, helpers: Path) -> None:
    config = _config(tmp_path, credsStore="../../bin/sh")
    with pytest.raises(NetworkError, match="no helper name"):
        docker_credentials("ghcr.io", config=config)


def test_the_registry_client_runs_the_helper_only_when_a_login_is_needed(tmp_path: Path, helpers: Path) -> None:
    _answers(helpers, "desktop", {"ghcr.io": ("me", SECRET)})
    config = _config(tmp_path, credsStore="desktop")
    with RegistryClient("ghcr.io", docker_config=config) as client:
        assert _calls(helpers, "desktop") == []  # an anonymous registry never runs it
        basic = client._basic()
        assert basic == "Basic " + base64.b64encode(f"me:{SECRET}".encode()).decode()
        client._basic()
        assert _calls(helpers, "desktop") == ["get ghcr.io"]  # once per client
        assert SECRET not in repr(client)
