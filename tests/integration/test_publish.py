"""Publish/verify/pull on the real engine and a real distribution 2.8 registry (started per module on its own port).

Tiny images are imported from a small rootfs (a static-enough `sleep`: the host's binary and its two
libraries) so these tests need no CPU build; each gets a verdict JSON built here that GateVerdict
accepts. The end-to-end test with the real CPU image runs only when its build record and lock exist.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.lockfile import Lock, LockedBase
from clients.oci import RegistryClient
from common.errors import NetworkError, PublishError
from dockerd import Docker
from publishing.local_registry import LocalRegistry, registry_down, registry_status, registry_up, untag_on_disk
from publishing.publish import PublishedImage, parse_target, plan_publish, publish_image, read_record, record_tag, verdict_facts
from publishing.verify import pull_verified, verify_reference

pytestmark = pytest.mark.integration
SKU = "tiny-test"
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- helpers (also used by test_faults.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_lock(sku: str = SKU, salt: str = "a") -> Lock:
    return Lock(sku=sku, manifest_sha256=salt * 64, python="3.11", platform="linux/amd64",
                base=LockedBase(kind="bootstrap", reference="skupin-base/test:1", recipe_sha256="b" * 64),
                layers={"framework": (), "compiler": (), "engine": (), "extras": ()}, dockerfile_sha256="c" * 64,
                resolver="none", tool_version="0.1.0", created="2026-11-29T00:00:00Z")


def make_verdict(*, image_id: str, lock: Lock, decision: str = "pass", sku: str = SKU) -> dict:
    """A verdict JSON for `image_id`, valid for gates.verdict.GateVerdict."""
    from gates.verdict import GateVerdict

    status = "pass" if decision == "pass" else "fail"
    checks = [{"name": n, "status": "pass", "reason": "ok"} for n in ("reference", "boot", "pins", "kernels")]
    checks.append({"name": "model", "status": status, "reason": "ok" if status == "pass" else "kl: 40/40 prompts exceed"})
    data = {"sku": sku, "hardware_class": "cpu-x86_64", "image": image_id, "image_id": image_id,
            "lock_hash": lock.content_hash(), "reference": {"path": "gates/references/x", "sha256": "d" * 64},
            "tolerance": None, "checks": checks, "decision": decision,
            "reason": "passed" if decision == "pass" else "model: kl: 40/40 prompts exceed",
            "timings": {}, "tool_version": "0.1.0", "created": "2026-11-29T21:00:00+00:00"}
    return json.loads(GateVerdict.model_validate(data).model_dump_json())


def tiny_rootfs(folder: Path, salt: str) -> Path:
    """A rootfs with the host's `sleep` (and its libraries) and a salt file, so each image id is new."""
    folder.mkdir(parents=True)
    for src in ("/usr/bin/sleep", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
        dst = folder / src.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    (folder / "salt").write_text(salt, encoding="utf-8")
    return folder


class TinyImages:
    """Imports tiny images on demand; removes them afterwards."""

    def __init__(self, docker: Docker, tmp: Path) -> None:
        self.engine, self.tmp, self.refs = docker, tmp, []

    def make(self, name: str) -> str:
        ref = f"skupin-test/{name}:{os.urandom(4).hex()}"
        rootfs = tiny_rootfs(self.tmp / ref.replace("/", "_").replace(":", "_"), salt=os.urandom(16).hex())
        self.refs.append(ref)
        return self.engine.import_rootfs(rootfs=rootfs, reference=ref)

    def cleanup(self) -> None:
        for ref in self.refs:
            self.engine.remove_image(ref, force=True)


@pytest.fixture
def tiny(docker: Docker, tmp_path: Path) -> Iterator[TinyImages]:
    images = TinyImages(docker, tmp_path / "tiny")
    yield images
    images.cleanup()


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[LocalRegistry]:
    """Our own distribution 2.8 registry on a free loopback port, in tmp_path; stopped afterwards."""
    reg = LocalRegistry(addr=f"127.0.0.1:{free_port()}", folder=tmp_path / "registry")
    registry_up(registry=reg)
    yield reg
    registry_down(registry=reg)


def publish(*, docker: Docker, registry: LocalRegistry, image_id: str, lock: Lock, verdict: dict,
            url: str | None = None, on_event=lambda _s: None) -> PublishedImage:
    """The library path `skupin publish` takes, with an injected image/lock/verdict."""
    target = parse_target(url or registry.addr)
    plan = plan_publish(sku=SKU, engine_version="5.24.0", lock=lock, image_id=image_id,
                        verdict=verdict_facts(verdict), target=target)
    with RegistryClient(target.url, retries=1, backoff=0.1) as client:
        return publish_image(plan=plan, lock=lock, docker=docker, client=client, on_event=on_event,
                             untag=lambda repo, tag: untag_on_disk(registry=registry, repository=repo, tag=tag))


def tags(registry: LocalRegistry, repo: str = SKU) -> set[str]:
    """The repository's tags; empty when the repository does not exist."""
    with RegistryClient(registry.url, retries=0) as client:
        try:
            return set(client.list_tags(repo))
        except NetworkError:
            return set()


def configs(registry: LocalRegistry, repo: str = SKU) -> dict[str, str]:
    """tag -> config digest (image id) of every image tag in the repository."""
    out = {}
    with RegistryClient(registry.url, retries=0) as client:
        for tag in tags(registry, repo):
            if tag.endswith(".verification"):
                continue
            out[tag] = (client.get_manifest(repo, tag).json().get("config") or {}).get("digest")
    return out


# ---------------------------------------------------------------- tests


def test_registry_up_is_idempotent_and_down_leaves_others_alone(tmp_path: Path, registry: LocalRegistry):
    again = registry_up(registry=registry)
    assert again.answering and again.ours and "already running" in again.action
    # a second folder pointing at the same address did not start that registry: it must not stop it
    stranger = LocalRegistry(addr=registry.addr, folder=tmp_path / "other")
    assert "left alone" in registry_up(registry=stranger).action
    assert "left alone" in registry_down(registry=stranger).action
    assert registry_status(registry=registry).answering


def test_publish_verify_pull(docker: Docker, registry: LocalRegistry, tiny: TinyImages):
    image_id = tiny.make("good")
    lock = make_lock()
    t0 = time.monotonic()
    published = publish(docker=docker, registry=registry, image_id=image_id, lock=lock,
                        verdict=make_verdict(image_id=image_id, lock=lock))
    publish_s = time.monotonic() - t0
    assert published.reference == f"{registry.addr}/{SKU}@{published.digest}"
    assert tags(registry) == {"verified", published.tags[0], record_tag(published.digest)}  # temporary tag gone
    assert set(configs(registry).values()) == {image_id}
    assert not docker.image_exists(f"{registry.addr}/{SKU}:{published.tags[0]}")  # no local temporary tag either

    t0 = time.monotonic()
    result = verify_reference(ref=f"{registry.addr}/{SKU}:verified", current_lock=lambda _sku: lock.content_hash())
    verify_s = time.monotonic() - t0
    assert result.ok, result.line()
    assert result.line().startswith(f"verified: {registry.addr}/{SKU}:verified -> {published.reference} ({SKU}, lock ")
    # a newer lock makes the same digest unverified
    stale = verify_reference(ref=f"{registry.addr}/{SKU}:verified", current_lock=lambda _sku: make_lock(salt="e").content_hash())
    assert not stale.ok and "current lock" in stale.line()

    docker.remove_image(published.reference, force=True)
    result, pulled = pull_verified(sku=SKU, target=parse_target(registry.addr), docker=docker,
                                   current_lock=lambda _sku: lock.content_hash())
    assert pulled == image_id and result.reference == published.reference
    docker.remove_image(published.reference, force=True)
    print(f"\npublish {publish_s:.2f} s (push {published.push_s:.2f} s), verify {verify_s:.3f} s")


def test_verified_image_id_is_the_serve_baseline_even_under_a_newer_lock(docker: Docker, registry: LocalRegistry,
                                                                        tiny: TinyImages):
    from publishing.verify import verified_image_id

    target = parse_target(registry.addr)
    assert verified_image_id(sku=SKU, target=target) is None  # nothing verified yet
    image_id = tiny.make("baseline")
    lock = make_lock()
    publish(docker=docker, registry=registry, image_id=image_id, lock=lock,
            verdict=make_verdict(image_id=image_id, lock=lock))
    assert verified_image_id(sku=SKU, target=target) == image_id
    registry_down(registry=registry)
    assert verified_image_id(sku=SKU, target=target) is None  # a registry that does not answer: no baseline


def test_verify_catches_a_tag_moved_to_an_unrecorded_image(docker: Docker, registry: LocalRegistry, tiny: TinyImages):
    lock = make_lock()
    good = tiny.make("good")
    publish(docker=docker, registry=registry, image_id=good, lock=lock, verdict=make_verdict(image_id=good, lock=lock))
    # someone pushes another image straight to :verified, bypassing the gate
    rogue = tiny.make("rogue")
    ref = f"{registry.addr}/{SKU}:verified"
    docker.tag(rogue, ref)
    try:
        docker.push(ref)
    finally:
        docker.remove_image(ref)
    result = verify_reference(ref=ref, current_lock=lambda _sku: lock.content_hash())
    assert not result.ok and "no verification record" in result.reason


def test_refused_verdicts_push_nothing(docker: Docker, registry: LocalRegistry, tiny: TinyImages):
    lock = make_lock()
    image_id = tiny.make("refused")
    other = tiny.make("other")
    cases = {
        "failed gate": make_verdict(image_id=image_id, lock=lock, decision="fail"),
        "another image's pass": make_verdict(image_id=other, lock=lock),
        "an older lock's pass": make_verdict(image_id=image_id, lock=make_lock(salt="f")),
    }
    for _why, verdict in cases.items():
        with pytest.raises(PublishError, match="refusing to publish"):
            publish(docker=docker, registry=registry, image_id=image_id, lock=lock, verdict=verdict)
    assert tags(registry) == set(), "a refused publish must push nothing"


def test_end_to_end_cpu_image_gate_publish_and_verify(docker: Docker, registry: LocalRegistry, stack, honest_image,
                                                      tmp_path: Path):
    """The real CPU image, gated by the real gate, published with that verdict, verified by an operator."""
    from gates.gate import gate_image

    verdict_obj = gate_image(stack=stack, image=honest_image, docker=docker, out=tmp_path / "gate")
    assert verdict_obj.decision == "pass", verdict_obj.reason
    verdict = json.loads((tmp_path / "gate" / "verdict.json").read_text(encoding="utf-8"))
    lock, target = stack.lock, parse_target(registry.addr)
    plan = plan_publish(sku="cpu-x86_64", engine_version=stack.manifest.stack.engine.version, lock=lock,
                        image_id=honest_image, verdict=verdict_facts(verdict), target=target)
    t0 = time.monotonic()
    with RegistryClient(target.url) as client:
        published = publish_image(plan=plan, lock=lock, docker=docker, client=client,
                                  untag=lambda r, t: untag_on_disk(registry=registry, repository=r, tag=t))
        assert read_record(client=client, repository="cpu-x86_64", digest=published.digest).image_id == honest_image
    result = verify_reference(ref=f"{registry.addr}/cpu-x86_64:verified")
    assert result.ok, result.line()
    assert result.digest == published.digest
    print(f"\nCPU image publish {time.monotonic() - t0:.1f} s (push {published.push_s:.1f} s): {result.line()}")
