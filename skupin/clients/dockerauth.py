"""Registry logins from the Docker config, as Docker finds them: `credHelpers`, `credsStore`, then `auths`.

The config is `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`. For a registry host:

1. `credHelpers[host]` names a credential helper for that host; else `credsStore` names one for every host;
2. the helper `docker-credential-<name>` (found on PATH) runs as Docker runs it (docker-credential-helpers'
   protocol): `docker-credential-<name> get`, the server address on stdin (the host, or
   `https://index.docker.io/v1/` for Docker Hub), a JSON object `{"ServerURL", "Username", "Secret"}` on stdout;
   "credentials not found" means no login there;
3. no helper, or no login in it: the host's `auths` entry (`auth`: base64 user:password, or `username` and
   `password`).

A helper runs with a deadline (HELPER_TIMEOUT) and its output is bounded (MAX_HELPER_OUTPUT): one that hangs or
floods is stopped and reported. A helper that is named but missing, fails, or answers something else is a
NetworkError naming it and the fix, never a silent anonymous request. An identity token (`Username: "<token>"`,
OAuth refresh tokens of some helpers) is refused the same way: this client logs in with a user and a password or
token only. The secret never appears in errors, reprs or logs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import selectors
import shutil
import subprocess
import time
from pathlib import Path

from pydantic import SecretStr

from skupin.common.errors import NetworkError
from skupin.common.model import Frozen

HELPER_TIMEOUT = 30.0
MAX_HELPER_OUTPUT = 64 * 1024
MAX_CONFIG_BYTES = 4 * 1024**2
HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DOCKER_HUB = ("registry-1.docker.io", "docker.io", "index.docker.io")
DOCKER_HUB_SERVER = "https://index.docker.io/v1/"
NOT_FOUND = "credentials not found"  # docker-credential-helpers' ErrCredentialsNotFound message
IDENTITY_TOKEN_USER = "<token>"


class Credentials(Frozen):
    """A registry login; the secret never shows in repr, str or logs."""

    username: str
    secret: SecretStr


def docker_config_path() -> Path:
    """$DOCKER_CONFIG/config.json, else ~/.docker/config.json (where Docker reads its config)."""
    folder = os.environ.get("DOCKER_CONFIG")
    return (Path(folder) if folder else Path.home() / ".docker") / "config.json"


def _read_config(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(MAX_CONFIG_BYTES + 1)[:MAX_CONFIG_BYTES])
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def docker_credentials(host: str, *, config: Path | None = None) -> Credentials | None:
    """The login for registry `host` (host[:port]) by Docker's rules (see the module doc); None: anonymous."""
    data = _read_config(config or docker_config_path())
    helpers = data.get("credHelpers")
    names = (host, *DOCKER_HUB) if host in DOCKER_HUB else (host,)
    helper = next((helpers[n] for n in names if isinstance(helpers, dict) and isinstance(helpers.get(n), str)), None)
    helper = helper or (data.get("credsStore") if isinstance(data.get("credsStore"), str) else None)
    if helper:
        found = helper_credentials(helper, DOCKER_HUB_SERVER if host in DOCKER_HUB else host)
        if found is not None:
            return found
    auths = data.get("auths")
    return _from_auths(host, auths) if isinstance(auths, dict) else None


def _from_auths(host: str, auths: dict) -> Credentials | None:
    keys = {host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"https://{host}/v2/"}
    if host in DOCKER_HUB:
        keys |= {DOCKER_HUB_SERVER, "index.docker.io", "docker.io"}
    for key, entry in auths.items():
        if key in keys and isinstance(entry, dict):
            if isinstance(entry.get("auth"), str) and entry["auth"]:
                try:
                    user, _, secret = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    continue
                return Credentials(username=user, secret=SecretStr(secret))
            if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str) \
                    and entry["username"] and entry["password"]:
                return Credentials(username=entry["username"], secret=SecretStr(entry["password"]))
    return None


def helper_credentials(name: str, server: str, *, timeout: float = HELPER_TIMEOUT) -> Credentials | None:
    """`docker-credential-<name> get` for `server`: its login, None when it has none; NetworkError otherwise."""
    program = f"docker-credential-{name}"
    if not HELPER_NAME.fullmatch(name):
        raise NetworkError(f"the Docker config names the credential helper {name[:80]!r}, which is no helper name; "
                           "fix: correct credsStore / credHelpers in the Docker config")
    path = shutil.which(program)
    if path is None:
        raise NetworkError(f"the Docker config names the credential helper {name!r} for {server}, but {program} is "
                           "not on PATH; fix: install it, or remove credsStore / credHelpers from the Docker config "
                           f"({docker_config_path()})")
    code, out, err = _run_bounded([path, "get"], stdin=server.encode(), timeout=timeout, what=program)
    text = out.decode("utf-8", "replace").strip()
    if code != 0:
        if NOT_FOUND in text.lower() or NOT_FOUND in err.decode("utf-8", "replace").lower():
            return None
        why = (err.decode("utf-8", "replace").strip() or text).splitlines()[:1]
        raise NetworkError(f"{program} get {server} failed (exit {code}): {_shown(why[0] if why else '')}; "
                           f"fix: check the helper (docker login {server})")
    try:
        answer = json.loads(text)
        user, secret = answer["Username"], answer["Secret"]
    except (ValueError, KeyError, TypeError) as exc:
        raise NetworkError(f"{program} get {server} did not answer a JSON object with Username and Secret") from exc
    if not isinstance(user, str) or not isinstance(secret, str):
        raise NetworkError(f"{program} get {server}: Username and Secret are not strings")
    if not secret:
        return None
    if user == IDENTITY_TOKEN_USER:
        raise NetworkError(f"{program} gave an identity token for {server} (Username {IDENTITY_TOKEN_USER}), which "
                           "skupin's registry client does not exchange; fix: docker login with a user and a password "
                           "or access token")
    return Credentials(username=user, secret=SecretStr(secret))


def _shown(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:200])


def _run_bounded(cmd: list[str], *, stdin: bytes, timeout: float, what: str) -> tuple[int, bytes, bytes]:
    """(exit code, stdout, stderr) of `cmd`; NetworkError when it outlives `timeout` or writes more than
    MAX_HELPER_OUTPUT bytes on either stream (it is killed then)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    sizes = dict.fromkeys(chunks, 0)
    deadline = time.monotonic() + timeout
    try:
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        with selectors.DefaultSelector() as sel:
            for stream in (proc.stdout, proc.stderr):
                sel.register(stream, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NetworkError(f"{what} did not answer within {timeout:g} s; fix: check the helper")
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    sizes[key.fd] += len(data)
                    if sizes[key.fd] > MAX_HELPER_OUTPUT:
                        raise NetworkError(f"{what} wrote more than {MAX_HELPER_OUTPUT} bytes; fix: check the helper")
                    chunks[key.fd].append(data)
        try:
            code = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            raise NetworkError(f"{what} did not exit within {timeout:g} s; fix: check the helper") from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    return code, b"".join(chunks[out_fd]), b"".join(chunks[err_fd])
