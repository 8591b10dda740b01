"""Publish/verify/pull on the real engine and a real distribution 2.8 registry (started per module on its own port).

Tiny images are imported from a small rootfs (a static-enough `sleep`: the host's binary and its two
libraries) so these tests need no CPU build; each gets a verdict JSON built here that GateVerdict
accepts, and is signed with a key made for this test run (`SIGNER`, the only trusted key here). The
end-to-end test with the real CPU image runs only when its build record and lock exist.
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
from cryptography.hazmat.primitives.asymmetric import ec

from skupin.builder.catalog.lockfile import Lock, LockedBase
from skupin.builder.render import render
from skupin.clients.oci import RegistryClient
from skupin.common.errors import NetworkError, PublishError
from skupin.dockerd import Docker
from skupin.publishing.attest import Signer, TrustedKeys, tolerance_sha256
from skupin.publishing.local_registry import LocalRegistry, registry_down, registry_status, registry_up, untag_on_disk
from skupin.publishing.policy import Expected
from skupin.publishing.publish import (
    PublishedImage,
    attestation_tag,
    parse_target,
    plan_publish,
    publish_image,
    read_attestations,
    verdict_facts,
    version_tag,
)
from skupin.publishing.verify import Verification, pull_verified, verify_reference

pytestmark = pytest.mark.integration
SKU = "tiny-test"
REPO = Path(__file__).resolve().parents[2]
SIGNER = Signer(ec.generate_private_key(ec.SECP256R1()))
TRUSTED = TrustedKeys({SIGNER.keyid: (SIGNER.key.public_key(), "test key")})
BUNDLE = "d" * 64
TOL_ENTRY = {"kernels": {"silu": 1e-3}, "provenance": {"runs": 3, "reference_sha256": BUNDLE}}
TOL_KEY = "cpu-x86_64/float32/tiny-llama"


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
    """A verdict JSON for `image_id`, valid for gates.judge.verdict.GateVerdict."""
    from skupin.gates.judge.verdict import GateVerdict

    status = "pass" if decision == "pass" else "fail"
    checks = [{"name": n, "status": "pass", "reason": "ok"} for n in ("reference", "boot", "pins", "kernels")]
    checks.append({"name": "model", "status": status, "reason": "ok" if status == "pass" else "kl: 40/40 prompts exceed"})
    data = {"sku": sku, "hardware_class": "cpu-x86_64", "image": image_id, "image_id": image_id,
            "lock_hash": lock.content_hash(), "reference": {"path": "gates/references/x", "sha256": BUNDLE},
            "tolerance": {"key": TOL_KEY, "source": "gates/data/tolerances.yaml", "entry": TOL_ENTRY,
                          "hard_bounds": {"max_mean_kl": 0.5}},
            "checks": checks, "decision": decision,
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
        image_id = self.engine.import_rootfs(rootfs=rootfs, reference=ref)
        self.refs.append(image_id)
        return image_id

    def cleanup(self) -> None:
        # by id as well: a test that pulls the image back (`skupin pull`) leaves it under the registry's name too
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


def expected(lock: Lock, sku: str = SKU) -> Expected:
    """What "the repository" knows about the test SKU: this lock, the test bundle and tolerance entry."""
    return Expected(sku=sku, lock_sha256=lock.content_hash(), bundle_sha256=BUNDLE, tolerance_key=TOL_KEY,
                    tolerance_sha256=tolerance_sha256(TOL_ENTRY), catalog="test")


def publish(*, docker: Docker, registry: LocalRegistry, image_id: str, lock: Lock, verdict: dict,
            url: str | None = None, on_event=lambda _s: None, client: RegistryClient | None = None) -> PublishedImage:
    """The library path `skupin publish` takes, with an injected image/lock/verdict, signed by the test key."""
    target = parse_target(url or registry.addr)
    plan = plan_publish(sku=SKU, engine_version="5.24.0", lock=lock, dockerfile_sha256="c" * 64, image_id=image_id,
                        verdict=verdict_facts(verdict), target=target, expected=expected(lock))
    with client or RegistryClient(target.url, retries=1, backoff=0.1) as reg:
        return publish_image(plan=plan, docker=docker, client=reg, signer=SIGNER, trusted=TRUSTED, on_event=on_event,
                             untag=lambda repo, tag: untag_on_disk(registry=registry, repository=repo, tag=tag))


def verify(ref: str, lock: Lock) -> Verification:
    """`skupin verify REF` for the test SKU: the test key trusted, `lock` the current lock."""
    return verify_reference(ref=ref, expect=lambda sku: expected(lock, sku), trusted=TRUSTED)


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
            if tag.endswith(".att"):
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
    assert tags(registry) == {"verified", published.tags[0], attestation_tag(published.digest)}  # temporary tag gone
    assert set(configs(registry).values()) == {image_id}
    assert not docker.image_exists(f"{registry.addr}/{SKU}:{published.tags[0]}")  # no local temporary tag either

    t0 = time.monotonic()
    result = verify(f"{registry.addr}/{SKU}:verified", lock)
    verify_s = time.monotonic() - t0
    assert result.ok, result.line()
    assert result.line().startswith(f"verified: {registry.addr}/{SKU}:verified -> {published.reference} ({SKU}, lock ")
    assert result.signer == SIGNER.keyid
    # a newer lock makes the same digest unverified, and says it is an older lock's attestation
    stale = verify(f"{registry.addr}/{SKU}:verified", make_lock(salt="e"))
    assert not stale.ok and "an attestation for an older lock" in stale.line()
    # the attestation carries the OCI 1.1 subject: distribution 2.8 stores it (it just has no referrers API)
    with RegistryClient(registry.url) as client:
        att = client.get_manifest(SKU, attestation_tag(published.digest)).json()
    assert att["subject"]["digest"] == published.digest

    docker.remove_image(published.reference, force=True)
    result, pulled = pull_verified(sku=SKU, target=parse_target(registry.addr), docker=docker,
                                   expect=lambda sku: expected(lock, sku), trusted=TRUSTED)
    assert pulled == image_id and result.reference == published.reference
    docker.remove_image(published.reference, force=True)
    print(f"\npublish {publish_s:.2f} s (push {published.push_s:.2f} s), verify {verify_s:.3f} s")


def test_verified_image_id_is_the_serve_baseline_even_under_a_newer_lock(docker: Docker, registry: LocalRegistry,
                                                                        tiny: TinyImages):
    from skupin.publishing.verify import verified_image_id

    target = parse_target(registry.addr)
    assert verified_image_id(sku=SKU, target=target, trusted=TRUSTED) is None  # nothing verified yet
    image_id = tiny.make("baseline")
    lock = make_lock()
    publish(docker=docker, registry=registry, image_id=image_id, lock=lock,
            verdict=make_verdict(image_id=image_id, lock=lock))
    assert verified_image_id(sku=SKU, target=target, trusted=TRUSTED) == image_id
    assert verified_image_id(sku=SKU, target=target, trusted=TrustedKeys({})) is None  # signed by no trusted key
    registry_down(registry=registry)
    assert verified_image_id(sku=SKU, target=target, trusted=TRUSTED) is None  # a registry that does not answer


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
    result = verify(ref, lock)
    assert not result.ok and "no attestation" in result.reason


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
    from skupin.gates.gate import gate_image
    from skupin.publishing.policy import expected_for

    verdict_obj = gate_image(stack=stack, image=honest_image, docker=docker, out=tmp_path / "gate")
    assert verdict_obj.decision == "pass", verdict_obj.reason
    verdict = json.loads((tmp_path / "gate" / "verdict.json").read_text(encoding="utf-8"))
    lock, target = stack.lock, parse_target(registry.addr)
    plan = plan_publish(sku="cpu-x86_64", engine_version=stack.manifest.stack.engine.version, lock=lock,
                        dockerfile_sha256=render(stack).sha256, image_id=honest_image,
                        verdict=verdict_facts(verdict), target=target,
                        expected=expected_for("cpu-x86_64"))
    t0 = time.monotonic()
    with RegistryClient(target.url) as client:
        published = publish_image(plan=plan, docker=docker, client=client, signer=SIGNER, trusted=TRUSTED,
                                  untag=lambda r, t: untag_on_disk(registry=registry, repository=r, tag=t))
        assert len(read_attestations(client=client, repository="cpu-x86_64", digest=published.digest)) == 2
    result = verify_reference(ref=f"{registry.addr}/cpu-x86_64:verified", trusted=TRUSTED)
    assert result.ok, result.line()
    assert result.digest == published.digest
    print(f"\nCPU image publish {time.monotonic() - t0:.1f} s (push {published.push_s:.1f} s): {result.line()}")


# ---------------------------------------------------------------- attacks on the attestation (issue 19)


def _store_envelope(registry: LocalRegistry, digest: str, envelope: bytes, repo: str = SKU) -> None:
    """Write an attestation for `digest` as anyone with write access could (cosign's .att layout)."""
    from skupin.publishing.publish import OCI_MANIFEST, attestation_artifact

    art = attestation_artifact(envelope=envelope, subject=None)
    with RegistryClient(registry.url, retries=0) as client:
        client.push_blob(repo, art.config)
        client.push_blob(repo, art.layer)
        client.put_manifest(repo, attestation_tag(digest), art.manifest, OCI_MANIFEST)


def _push_rogue(docker: Docker, registry: LocalRegistry, image_id: str, repo: str = SKU) -> str:
    """Push an image straight to <repo>:verified (bypassing publish); its digest."""
    ref = f"{registry.addr}/{repo}:verified"
    docker.tag(image_id, ref)
    try:
        return docker.push(ref)
    finally:
        docker.remove_image(ref)


def test_the_forged_record_of_the_issue_fails_verify_and_pull(docker: Docker, registry: LocalRegistry, tiny: TinyImages,
                                                              tmp_path: Path):
    """An unrelated image pushed with a hand-written `{passed: true}` record (old and new tag layouts): refused by the
    library and by the `skupin verify` / `skupin pull` commands themselves (exit 8, the reason named)."""
    import subprocess
    import sys

    from skupin.publishing.publish import OCI_MANIFEST

    rogue = tiny.make("unrelated")
    repo = "cpu-x86_64"  # a real SKU, so the commands use the committed lock, bundle and tolerances
    digest = _push_rogue(docker, registry, rogue, repo)
    forged = json.dumps({"sku": repo, "passed": True, "bundle_sha256": "forged", "image_digest": digest}).encode()
    _store_envelope(registry, digest, forged, repo)
    with RegistryClient(registry.url, retries=0) as client:  # and the pre-attestation record layout
        layer = client.push_blob(repo, forged)
        cfg = client.push_blob(repo, b"{}")
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": 2},
                    "layers": [{"mediaType": "application/vnd.skupin.verification.v1+json", "digest": layer,
                                "size": len(forged)}]}
        client.put_manifest(repo, f"sha256-{digest.split(':')[1]}.verification", json.dumps(manifest).encode(),
                            OCI_MANIFEST)
    result = verify_reference(ref=f"{registry.addr}/{repo}:verified", trusted=TRUSTED)
    assert not result.ok and "not a DSSE envelope" in result.reason, result.line()
    with pytest.raises(PublishError, match="NOT verified"):
        pull_verified(sku=repo, target=parse_target(registry.addr), docker=docker, trusted=TRUSTED)
    key = tmp_path / "trusted.pub"
    key.write_bytes(SIGNER.public_pem())
    skupin = [sys.executable, "-m", "skupin.cli"] if not (REPO / ".venv" / "bin" / "skupin").exists() else \
        [str(REPO / ".venv" / "bin" / "skupin")]
    for args in (["verify", f"{registry.addr}/{repo}:verified", "--key", str(key)],
                 ["pull", repo, "--registry", registry.addr, "--key", str(key)]):
        run = subprocess.run([*skupin, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert run.returncode == 8, (args, run.returncode, run.stdout, run.stderr)
        assert "NOT verified" in run.stdout + run.stderr and "DSSE" in run.stdout + run.stderr, run.stdout + run.stderr
    assert not docker.image_exists(f"{registry.addr}/{repo}@{digest}")


def test_every_attack_of_the_acceptance_list_is_refused(docker: Docker, registry: LocalRegistry, tiny: TinyImages):
    """Unsigned, unknown key, a valid signature over another digest, another SKU, a tampered predicate, a required
    check that did not run, an older record replayed for a new image: each refused by verify and pull, with the
    reason; the honest path verifies."""
    import base64

    from skupin.common.model import canonical_json
    from skupin.publishing.attest import CheckOutcome, statement

    lock = make_lock()
    honest = tiny.make("honest")
    published = publish(docker=docker, registry=registry, image_id=honest, lock=lock,
                        verdict=make_verdict(image_id=honest, lock=lock))
    with RegistryClient(registry.url) as client:
        good_env, _sbom = read_attestations(client=client, repository=SKU, digest=published.digest)
    from skupin.publishing.policy import signed_predicate

    good, _ = signed_predicate(good_env, trusted=TRUSTED, digest=published.digest)
    new = tiny.make("new")
    digest = _push_rogue(docker, registry, new)
    own = good.model_copy(update={"image_id": new})
    stranger = Signer(ec.generate_private_key(ec.SECP256R1()))

    def signed(predicate=own, *, signer: Signer = SIGNER, about: str = digest) -> bytes:
        return signer.sign_statement(statement(repository=SKU, digest=about, predicate=predicate))

    def tampered() -> bytes:
        env = json.loads(signed())
        stmt = json.loads(base64.b64decode(env["payload"]))
        stmt["predicate"]["checks"] = [c for c in stmt["predicate"]["checks"] if c["name"] != "model"]
        env["payload"] = base64.b64encode(canonical_json(stmt)).decode()
        return canonical_json(env)

    unsigned = json.loads(signed())
    unsigned["signatures"] = []
    cases = {
        "unsigned": (canonical_json(unsigned), "unsigned"),
        "unknown key": (signed(signer=stranger), "signed by a key this catalog does not trust: " + stranger.keyid),
        "valid signature over another digest": (signed(about=published.digest), "a signature over another image"),
        "another SKU": (signed(own.model_copy(update={"sku": "other-sku"})), "is for SKU other-sku"),
        "tampered predicate": (tampered(), "does not verify with the key that claims it"),
        "required check did not run": (signed(own.model_copy(update={"checks": tuple(
            c for c in own.checks if c.name != "model") + (CheckOutcome(name="model", status="skipped"),)})),
            "required checks did not pass: model (skipped)"),
        "older record replayed for a new image": (good_env, "a signature over another image"),
        "older lock": (signed(own.model_copy(update={"lock": make_lock(salt="e").model_dump(mode="json"),
                                                     "lock_sha256": make_lock(salt="e").content_hash()})),
                       "an attestation for an older lock"),
    }
    target = parse_target(registry.addr)
    for why, (envelope, reason) in cases.items():
        _store_envelope(registry, digest, envelope)
        result = verify(f"{registry.addr}/{SKU}:verified", lock)
        assert not result.ok and reason in result.reason, (why, result.line())
        with pytest.raises(PublishError, match="NOT verified") as err:
            pull_verified(sku=SKU, target=target, docker=docker, expect=lambda s: expected(lock, s), trusted=TRUSTED)
        assert reason in str(err.value), (why, str(err.value))
    _store_envelope(registry, digest, signed())  # the honest attestation of the new image
    assert verify(f"{registry.addr}/{SKU}:verified", lock).ok


def test_a_version_tag_never_moves_and_a_failed_publish_leaves_no_temporary_tag(docker: Docker, registry: LocalRegistry,
                                                                                tiny: TinyImages):
    lock = make_lock()
    first, second = tiny.make("first"), tiny.make("second")
    published = publish(docker=docker, registry=registry, image_id=first, lock=lock,
                        verdict=make_verdict(image_id=first, lock=lock))
    again = publish(docker=docker, registry=registry, image_id=first, lock=lock,
                    verdict=make_verdict(image_id=first, lock=lock))
    assert again.digest == published.digest  # the same image again: the tag stays where it is
    with pytest.raises(PublishError, match="a version tag never moves to another digest"):
        publish(docker=docker, registry=registry, image_id=second, lock=lock,
                verdict=make_verdict(image_id=second, lock=lock))
    assert configs(registry) == {"verified": first, published.tags[0]: first}

    class FailsAtTheAttestation(RegistryClient):
        def put_manifest(self, repo, ref, body, media_type):
            if ref.endswith(".att"):
                raise NetworkError("registry 127.0.0.1: HTTP 500 (injected)")
            return super().put_manifest(repo, ref, body, media_type)

    other_lock = make_lock(salt="9")
    third = tiny.make("third")
    with pytest.raises(PublishError, match="storing the attestation"):
        publish(docker=docker, registry=registry, image_id=third, lock=other_lock,
                verdict=make_verdict(image_id=third, lock=other_lock),
                client=FailsAtTheAttestation(parse_target(registry.addr).url, retries=0))
    assert not [t for t in tags(registry) if t.startswith("skupin-push-")], tags(registry)
    assert configs(registry) == {"verified": first, published.tags[0]: first}  # nothing moved
    assert not [t for t in docker.inspect_image(third).tags if "skupin-push-" in t]



def test_a_publish_that_loses_the_race_for_its_version_tag_claims_nothing(docker: Docker, registry: LocalRegistry,
                                                                          tiny: TinyImages):
    """Another host publishing the same version tag at the same moment, its put injected at the exact point: taken
    right after our attestation is stored, we refuse before tagging; overwritten right after our own put, the read-back
    makes us fail. Either way the `verified` tag stays with the rival and no temporary tag is left. The rival is a real
    publish of the same lock (its digest attested for it: a tag without that would be squatted, and replaced)."""

    class RivalTakesTheTag(RegistryClient):
        """Puts the rival's manifest under `contested` right after our put of a reference `after` accepts."""

        def __init__(self, contested: str, after) -> None:
            super().__init__(parse_target(registry.addr).url, retries=0)
            self.contested, self.after = contested, after

        def put_manifest(self, repo, ref, body, media_type):
            stored = super().put_manifest(repo, ref, body, media_type)
            if self.after(ref):
                super().put_manifest(repo, self.contested, rival_manifest.body, rival_manifest.media_type)
            return stored

    cases = (("e", lambda ref, vtag: ref.endswith(".att"), "already names"),
             ("f", lambda ref, vtag: ref == vtag, "by another publish"))
    for salt, after, message in cases:
        lock = make_lock(salt=salt)
        vtag = version_tag(sku=SKU, engine_version="5.24.0", lock=lock, dockerfile_sha256="c" * 64)
        rival_id = tiny.make(f"rival-{salt}")  # the other host's publish: attested, its version tag put at `after`
        rival = publish(docker=docker, registry=registry, image_id=rival_id, lock=lock,
                        verdict=make_verdict(image_id=rival_id, lock=lock))
        untag_on_disk(registry=registry, repository=SKU, tag=vtag)
        with RegistryClient(registry.url, retries=0) as reader:
            rival_manifest = reader.get_manifest(SKU, rival.digest)
        ours = tiny.make(f"ours-{salt}")
        client = RivalTakesTheTag(vtag, lambda ref, vtag=vtag, after=after: after(ref, vtag))
        with pytest.raises(PublishError, match=message):
            publish(docker=docker, registry=registry, image_id=ours, lock=lock,
                    verdict=make_verdict(image_id=ours, lock=lock), client=client)
        held = configs(registry)
        assert held["verified"] == rival_id and held[vtag] == rival_id, (salt, held)
        assert ours not in held.values(), (salt, held)
        assert not [t for t in tags(registry) if t.startswith("skupin-push-")], tags(registry)

    class CannotTellAfterThePush(RegistryClient):
        """The registry fails (HTTP 500) when the version tag is looked up again after the push."""

        lookups = 0

        def find_manifest(self, repo, ref, **kwargs):
            if ref == untold_tag:
                self.lookups += 1
                if self.lookups > 1:
                    raise NetworkError("registry 127.0.0.1: HTTP 500 (injected)")
            return super().find_manifest(repo, ref, **kwargs)

    lock = make_lock(salt="c")
    untold_tag = version_tag(sku=SKU, engine_version="5.24.0", lock=lock, dockerfile_sha256="c" * 64)
    ours = tiny.make("ours-untold")
    with pytest.raises(PublishError, match="cannot tell whether .* is free"):
        publish(docker=docker, registry=registry, image_id=ours, lock=lock, verdict=make_verdict(image_id=ours, lock=lock),
                client=CannotTellAfterThePush(parse_target(registry.addr).url, retries=0))
    held = configs(registry)
    assert held["verified"] == rival_id and ours not in held.values(), held  # "cannot tell" never counts as "free"
