"""Publishing under faults, on the real engine and a real distribution 2.8 registry.

Registry down at publish (nothing tagged, clear error, retry after `registry up` succeeds); a gate
that failed (nothing pushed); a push error mid-stream from a fault-injecting loopback proxy in front
of the registry (nothing tagged); SIGINT during publish and during a gate container (no container
left, nothing published); two publishes at once (the verified tag ends on a gated digest, records
intact); a gate-failing image never ends up under any tag.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from skupin.clients.oci import RegistryClient
from skupin.common.errors import PublishError
from skupin.dockerd import Docker
from skupin.publishing.local_registry import LocalRegistry, registry_down, registry_up
from skupin.publishing.policy import signed_predicate
from skupin.publishing.publish import read_attestations
from tests.integration.test_publish import (
    SKU,
    TRUSTED,
    TinyImages,
    configs,
    free_port,
    make_lock,
    make_verdict,
    publish,
    registry,  # noqa: F401 - a fixture
    tags,
    tiny,  # noqa: F401 - a fixture
    verify,
)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- a fault-injecting proxy


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: str = ""
    mode: str = "pass"
    hits: list[str]

    def log_message(self, *_args) -> None:
        return None

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _fault(self, status: int, code: str) -> None:
        body = json.dumps({"errors": [{"code": code, "message": "injected fault", "detail": None}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self) -> None:
        body = self._body()
        blob_upload = "/blobs/uploads/" in self.path and self.command in ("PATCH", "PUT")
        manifest_put = "/manifests/" in self.path and self.command == "PUT"
        self.hits.append(f"{self.command} {self.path}")
        if blob_upload and self.mode == "deny_blob":
            return self._fault(403, "DENIED")
        if manifest_put and self.mode == "fail_manifest":
            return self._fault(500, "UNKNOWN")
        if blob_upload and self.mode == "slow_blob":
            time.sleep(60)
        headers = {
            k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length", "connection")
        }
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(self.upstream, timeout=30)
        try:
            conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "PATCH", "POST") else None,
                         headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        self.send_response(response.status)
        for k, v in response.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward


def start_proxy(upstream: str, mode: str) -> tuple[ThreadingHTTPServer, str, list[str]]:
    hits: list[str] = []
    handler = type("Handler", (_Proxy,), {"upstream": upstream, "mode": mode, "hits": hits})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}", hits


def human_tags(registry: LocalRegistry) -> set[str]:
    return {t for t in tags(registry) if not t.endswith(".att")}


# ---------------------------------------------------------------- registry down


def test_registry_down_at_publish_then_retry_after_up(docker: Docker, registry: LocalRegistry, tiny: TinyImages):
    lock = make_lock()
    image_id = tiny.make("down")
    verdict = make_verdict(image_id=image_id, lock=lock)
    registry_down(registry=registry)
    with pytest.raises(PublishError, match="does not answer.*nothing was pushed or tagged"):
        publish(docker=docker, registry=registry, image_id=image_id, lock=lock, verdict=verdict)
    registry_up(registry=registry)
    assert tags(registry) == set()
    published = publish(docker=docker, registry=registry, image_id=image_id, lock=lock, verdict=verdict)
    assert verify(f"{registry.addr}/{SKU}:verified", lock).ok
    assert configs(registry) == {"verified": image_id, published.tags[0]: image_id}


# ---------------------------------------------------------------- push errors mid-stream


@pytest.mark.parametrize("mode", ["deny_blob", "fail_manifest"])
def test_push_error_mid_stream_tags_nothing(docker: Docker, registry: LocalRegistry, tiny: TinyImages, mode: str):
    lock = make_lock()
    image_id = tiny.make(mode.replace("_", "-"))
    verdict = make_verdict(image_id=image_id, lock=lock)
    server, proxy, hits = start_proxy(registry.addr, mode)
    try:
        with pytest.raises(PublishError, match="push of .* failed.*nothing was tagged"):
            publish(docker=docker, registry=registry, image_id=image_id, lock=lock, verdict=verdict, url=proxy)
    finally:
        server.shutdown()
        server.server_close()
    assert any("/blobs/uploads/" in h for h in hits), "the fault proxy saw no upload: the push never started"
    assert human_tags(registry) == set()
    assert not [r for r in (docker.inspect_image(image_id).tags) if "skupin-push-" in r], "local temporary tag left"
    # and a later publish straight to the registry works
    publish(docker=docker, registry=registry, image_id=image_id, lock=lock, verdict=verdict)
    assert configs(registry)["verified"] == image_id


# ---------------------------------------------------------------- SIGINT


CHILD = r"""
import sys, time
from pathlib import Path
from skupin.dockerd import ContainerSpec, connect
from skupin.publishing.local_registry import LocalRegistry
from tests.integration.test_publish import make_lock, make_verdict, publish
mode, addr, folder, image_id, url = sys.argv[1:6]
docker = connect()
reg = LocalRegistry(addr=addr, folder=Path(folder))
lock = make_lock()
if mode == "gate":   # a stand-in for the gate's probe container, then publish
    print("GATE", flush=True)
    docker.run(ContainerSpec(image=image_id, entrypoint=("/usr/bin/sleep", "60"), labels={"io.skupin.test": "sigint"}),
               deadline_s=120)
print("PUBLISH", flush=True)
publish(docker=docker, registry=reg, image_id=image_id, lock=lock, verdict=make_verdict(image_id=image_id, lock=lock),
        url=url, on_event=lambda s: print(s, flush=True))
print("PUBLISHED", flush=True)
"""


def _run_and_interrupt(*, args: list[str], wait_for: str, docker: Docker, timeout: float = 60) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # A background job of a non-interactive shell starts with SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler: give the child the default disposition, as a terminal would.
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if wait_for in line:
            break
        assert time.monotonic() < deadline, "".join(seen)
    if wait_for == "GATE":  # wait until the container really runs
        while not docker.containers(label="io.skupin.test=sigint", all=False) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert docker.containers(label="io.skupin.test=sigint", all=False), "".join(seen)
    else:
        time.sleep(1.0)  # inside the (slowed) blob upload
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, "".join(seen) + out


def test_sigint_during_publish_publishes_nothing(docker: Docker, registry: LocalRegistry, tiny: TinyImages):
    image_id = tiny.make("sigint-publish")
    server, proxy, hits = start_proxy(registry.addr, "slow_blob")
    try:
        code, out = _run_and_interrupt(args=["publish", registry.addr, str(registry.folder), image_id, proxy],
                                       wait_for="pushing", docker=docker)
    finally:
        server.shutdown()
        server.server_close()
    assert code != 0 and "KeyboardInterrupt" in out and "PUBLISHED" not in out, out
    assert human_tags(registry) == set()
    assert not [t for t in docker.inspect_image(image_id).tags if "skupin-push-" in t], "local temporary tag left"


def test_sigint_during_gate_leaves_no_container_and_publishes_nothing(docker: Docker, registry: LocalRegistry,
                                                                       tiny: TinyImages):
    image_id = tiny.make("sigint-gate")
    code, out = _run_and_interrupt(args=["gate", registry.addr, str(registry.folder), image_id, registry.addr],
                                   wait_for="GATE", docker=docker)
    assert code != 0 and "PUBLISH" not in out.replace("GATE", ""), out
    assert docker.containers(label="io.skupin.test=sigint", all=True) == (), "the gate container was left behind"
    assert tags(registry) == set()


# ---------------------------------------------------------------- concurrency and the failing image


def test_two_publishes_at_once_serialize_and_the_version_tag_never_moves(docker: Docker, registry: LocalRegistry,
                                                                           tiny: TinyImages):
    """Two different images of one lock, published at once, three rounds: publishes from this host serialize (a lock
    file); the first to take the version tag keeps it, every publish of the other image is refused (immutable
    version tag), re-publishing the winner is fine, and no temporary tag is left."""
    from skupin.dockerd import connect

    lock = make_lock()
    images = [tiny.make("race-a"), tiny.make("race-b")]
    results: dict[str, list] = {i: [] for i in images}

    def one(image_id: str) -> None:
        eng = connect()
        try:
            results[image_id].append(publish(docker=eng, registry=registry, image_id=image_id, lock=lock,
                                             verdict=make_verdict(image_id=image_id, lock=lock)))
        except Exception as exc:  # recorded and asserted below
            results[image_id].append(exc)
        finally:
            eng.close()

    for _round in range(3):
        threads = [threading.Thread(target=one, args=(i,)) for i in images]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    winners = [i for i, rs in results.items() if all(not isinstance(r, Exception) for r in rs)]
    assert len(winners) == 1, results
    (winner,) = winners
    (loser,) = [i for i in images if i != winner]
    assert all(isinstance(r, PublishError) and "never moves" in str(r) for r in results[loser]), results[loser]
    assert len({r.digest for r in results[winner]}) == 1
    digest = results[winner][0].digest
    assert configs(registry) == {"verified": winner, results[winner][0].tags[0]: winner}
    result = verify(f"{registry.addr}/{SKU}:verified", lock)
    assert result.ok and result.digest == digest, result.line()
    with RegistryClient(registry.url) as client:
        envelope, _sbom = read_attestations(client=client, repository=SKU, digest=digest)
        predicate, _keyid = signed_predicate(envelope, trusted=TRUSTED, digest=digest)
        assert predicate.image_id == winner and predicate.decision == "pass"
    assert not [t for t in tags(registry) if t.startswith("skupin-push-")]
    assert len([t for t in tags(registry) if t.endswith(".att")]) == 1  # the loser's pushed digest got no attestation


def test_gate_failing_image_never_ends_under_a_tag(docker: Docker, registry: LocalRegistry, tiny: TinyImages):
    lock = make_lock()
    honest = tiny.make("honest")
    derived = tiny.make("derived-int4")  # stands for an image the gate failed (e.g. INT4 weights)
    publish(docker=docker, registry=registry, image_id=honest, lock=lock, verdict=make_verdict(image_id=honest, lock=lock))
    failing = make_verdict(image_id=derived, lock=lock, decision="fail")
    forged = dict(failing, decision="pass", reason="passed")  # decision flipped, the model check still failed
    attempts = {
        "its own failing verdict": failing,
        "the honest image's passing verdict": make_verdict(image_id=honest, lock=lock),
        "a verdict with the decision flipped": forged,
    }
    for _why, verdict in attempts.items():
        with pytest.raises(PublishError, match="refusing to publish"):
            publish(docker=docker, registry=registry, image_id=derived, lock=lock, verdict=verdict)
    assert derived not in configs(registry).values()
    assert configs(registry)["verified"] == honest
    assert verify(f"{registry.addr}/{SKU}:verified", lock).ok
