"""Issue 30: a squatted version tag is not published and publish replaces it; publish refuses a verdict its gate run
did not sign, an image skupin did not build from the lock, and an SBOM that does not list the lock's packages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from skupin.builder.catalog.lockfile import Lock, LockedPackage
from skupin.common.errors import PublishError
from skupin.publishing.publish import (
    DOCKERFILE_LABEL,
    LOCK_LABEL,
    VERIFIED_TAG,
    attested_for,
    built_here_problems,
    check_verdict_envelope,
    publish_image,
    sbom_problems,
    sign_verdict,
    verdict_envelope_path,
)
from skupin.publishing.sbom import ImageInventory
from tests.unit.test_attest import SIGNER, STRANGER, TRUSTED
from tests.unit.test_publish_plan import (
    IMAGE,
    IMAGE_MANIFEST,
    INVENTORY,
    OTHER,
    FakeEngine,
    FakeRegistry,
    _image_manifest,
    _pushes_through_the_fake_engine,  # noqa: F401 (an autouse fixture: the fake engine's push stands for the image)
    built_cpu_image,
    expected,
    lock,
    plan,
    verdict,
)

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"


def _squat(reg: FakeRegistry, tag: str, image_id: str = OTHER) -> str:
    """Anyone who may push puts an image of their own under the (computable) next version tag: no attestation."""
    squatter = _image_manifest(image_id)
    reg.manifests[tag] = (squatter.body, DOCKER_MANIFEST)
    return squatter.digest


# ---------------------------------------------------------------- 1. freeze by squatting


def test_a_squatted_version_tag_is_not_published_and_publish_replaces_it(tmp_path):
    reg, p, events = FakeRegistry(), plan(verdict()), []
    squatter = _squat(reg, p.version_tag)
    held = reg.find_manifest(p.repository, p.version_tag)
    assert held is not None and held.digest == squatter
    # what `skupin matrix --skip-published` asks: no trusted attestation for this SKU and lock -> not published
    assert not attested_for(client=reg, repository=p.repository, held=held, sku=p.sku,  # type: ignore[arg-type]
                            lock_sha256=p.lock_sha256, trusted=TRUSTED)

    out = publish_image(plan=p, docker=FakeEngine(), client=reg, signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                        lock_folder=tmp_path, inventory=INVENTORY, on_event=events.append)
    assert out.digest == IMAGE_MANIFEST.digest
    assert reg.manifests[p.version_tag][0] == IMAGE_MANIFEST.body and reg.manifests[VERIFIED_TAG][0] == IMAGE_MANIFEST.body
    said = [e for e in events if "squatted); replaced" in e]
    assert len(said) == 1 and squatter in said[0] and p.version_tag in said[0]
    # now the tag's digest carries the publish's attestation: published
    held = reg.find_manifest(p.repository, p.version_tag)
    assert held is not None
    assert attested_for(client=reg, repository=p.repository, held=held, sku=p.sku,  # type: ignore[arg-type]
                        lock_sha256=p.lock_sha256, trusted=TRUSTED)
    # ... for that SKU and lock only
    assert not attested_for(client=reg, repository=p.repository, held=held, sku=p.sku,  # type: ignore[arg-type]
                            lock_sha256=lock("e").content_hash(), trusted=TRUSTED)


def test_a_tag_attested_by_an_untrusted_key_is_squatted_and_an_attested_one_never_moves(tmp_path):
    # a "publish" signed by a key nobody trusts is a squat too: replaced by the gated image
    reg, p = FakeRegistry(), plan(verdict())
    from skupin.publishing.attest import TrustedKeys

    stranger_trusts = TrustedKeys({STRANGER.keyid: (STRANGER.key.public_key(), "stranger")})
    publish_image(plan=p, docker=FakeEngine(), client=reg, signer=STRANGER, trusted=stranger_trusts,  # type: ignore[arg-type]
                  lock_folder=tmp_path, inventory=INVENTORY)
    held = reg.find_manifest(p.repository, p.version_tag)
    assert held is not None
    assert not attested_for(client=reg, repository=p.repository, held=held, sku=p.sku,  # type: ignore[arg-type]
                            lock_sha256=p.lock_sha256, trusted=TRUSTED)

    # a version tag a trusted publish attested stays immutable: another image is refused, nothing tagged
    reg, p = FakeRegistry(), plan(verdict())
    publish_image(plan=p, docker=FakeEngine(), client=reg, signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                  lock_folder=tmp_path, inventory=INVENTORY)
    before = dict(reg.manifests)
    other = plan(verdict(image_id=OTHER), image_id=OTHER)
    assert other.version_tag == p.version_tag
    with pytest.raises(PublishError, match="never moves"):
        publish_image(plan=other, docker=FakeEngine(), client=reg, signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                      lock_folder=tmp_path, inventory=INVENTORY)
    assert reg.manifests == before


def test_a_tag_squatted_between_the_check_and_the_put_is_still_claimed_and_said(tmp_path):
    """The race check right before the put: "free" is absent or squatted; a trusted holder there is refused."""
    reg, p, events = FakeRegistry(), plan(verdict()), []
    real_put = reg.put_manifest

    def put(repo, ref, body, media_type):
        if ref.endswith(".att") and p.version_tag not in reg.manifests:
            _squat(reg, p.version_tag)  # squatted while the attestation went in
        return real_put(repo, ref, body, media_type)

    reg.put_manifest = put  # type: ignore[method-assign]
    publish_image(plan=p, docker=FakeEngine(), client=reg, signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                  lock_folder=tmp_path, inventory=INVENTORY, on_event=events.append)
    assert reg.manifests[p.version_tag][0] == IMAGE_MANIFEST.body
    assert any("squatted); replaced" in e for e in events)


# ---------------------------------------------------------------- 2a. a hand-written verdict


def test_a_verdict_without_its_gate_runs_signature_is_refused():
    v = verdict()
    with pytest.raises(PublishError, match="no signed envelope"):
        check_verdict_envelope(None, v, trusted=TRUSTED, where="verdict.json")
    with pytest.raises(PublishError, match="does not verify"):  # signed, but by a key nobody trusts
        check_verdict_envelope(sign_verdict(v, STRANGER), v, trusted=TRUSTED, where="verdict.json")
    forged = {**v, "decision": "pass", "reason": "hand-written"}
    with pytest.raises(PublishError, match="does not verify|another verdict"):  # the envelope of another verdict
        check_verdict_envelope(sign_verdict(verdict(decision="fail"), SIGNER), forged, trusted=TRUSTED, where="x")
    with pytest.raises(PublishError):  # not an envelope at all
        check_verdict_envelope(b'{"payload": "e30=", "signatures": []}', v, trusted=TRUSTED, where="x")
    assert check_verdict_envelope(sign_verdict(v, SIGNER), v, trusted=TRUSTED, where="x") == SIGNER.keyid
    assert str(verdict_envelope_path(Path("out/verdict.json"))) == "out/verdict.dsse.json"


def test_publish_sku_refuses_a_hand_written_verdict_before_anything_is_pushed(tmp_path, monkeypatch):
    """`skupin publish --verdict` with a verdict JSON no gate run signed (the reviewed finding): refused."""
    import skupin.publishing.publish as publishing
    from skupin.dockerd import ImageInfo
    from tests.paths import SKUS

    sku = SKUS / "cpu-x86_64.yaml"
    from skupin.builder.catalog.lockfile import lock_path, read_lock
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.builder.render import render_manifest

    lk = read_lock(lock_path(sku))
    dockerfile = render_manifest(manifest=load_manifest(sku), lock=lk).sha256
    labels = {LOCK_LABEL: lk.content_hash(), DOCKERFILE_LABEL: dockerfile}

    class Engine(FakeEngine):
        def inspect_image(self, ref):
            return ImageInfo(id=IMAGE, tags=(), repo_digests=(), labels=labels, size=1, layers=(), created="now")

    pushed = []
    monkeypatch.setattr(publishing, "publish_image", lambda **kw: pushed.append(kw))
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path / "state"))
    path = tmp_path / "v" / "verdict.json"
    path.parent.mkdir()
    path.write_text(json.dumps(verdict(lk=lk)))
    key = tmp_path / "signing.key"
    from cryptography.hazmat.primitives import serialization

    key.write_bytes(SIGNER.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    args = dict(sku=str(sku), registry="127.0.0.1:5000", addr="127.0.0.1:5000", verdict_path=path, image="x",
                docker=Engine(), signing_key=key, trusted=TRUSTED)
    with pytest.raises(PublishError, match="no signed envelope"):
        publishing.publish_sku(**args)  # type: ignore[arg-type]
    path.with_name("verdict.dsse.json").write_bytes(sign_verdict(verdict(lk=lk, decision="fail"), SIGNER))
    with pytest.raises(PublishError, match="does not verify|another verdict"):
        publishing.publish_sku(**args)  # type: ignore[arg-type]
    assert pushed == []


# ---------------------------------------------------------------- 2b. an image skupin did not build


def test_an_image_without_skupin_labels_is_refused():
    lk = lock()
    assert built_here_problems(labels={}, lock_sha256=lk.content_hash(), dockerfile_sha256="c" * 64) == [
        "the image carries no io.skupin.* labels: skupin did not build it"]
    assert built_here_problems(labels=None, lock_sha256=lk.content_hash(), dockerfile_sha256="c" * 64)
    wrong_lock = built_here_problems(labels={LOCK_LABEL: "e" * 64, DOCKERFILE_LABEL: "c" * 64},
                                     lock_sha256=lk.content_hash(), dockerfile_sha256="c" * 64)
    assert len(wrong_lock) == 1 and LOCK_LABEL in wrong_lock[0]
    only_dockerfile = built_here_problems(labels={DOCKERFILE_LABEL: "c" * 64}, lock_sha256=lk.content_hash(),
                                          dockerfile_sha256="c" * 64)
    assert len(only_dockerfile) == 1 and LOCK_LABEL in only_dockerfile[0]
    assert built_here_problems(labels={LOCK_LABEL: lk.content_hash(), DOCKERFILE_LABEL: "c" * 64},
                               lock_sha256=lk.content_hash(), dockerfile_sha256="c" * 64) == []


def test_the_publish_stage_refuses_an_unlabelled_image_and_an_unsigned_verdict(monkeypatch, tmp_path):
    import skupin.publishing.publish as publishing
    from skupin.dockerd import ImageInfo
    from skupin.publishing.publish import parse_target

    labels: dict[str, str] = {}

    class Engine(FakeEngine):
        def inspect_image(self, ref):
            return ImageInfo(id=IMAGE, tags=(), repo_digests=(), labels=labels, size=1, layers=(), created="now")

    built, gated = built_cpu_image()
    monkeypatch.setattr(publishing, "expected_for", lambda _sku: expected())
    monkeypatch.setattr(publishing, "_execute", lambda **kw: pytest.fail("nothing may be pushed"))
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path))
    target = parse_target("127.0.0.1:5000")
    with pytest.raises(PublishError, match="no io.skupin"):
        publishing.publish(built, gated, target, docker=Engine(), signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                           verdict_envelope=sign_verdict(gated, SIGNER))
    labels.update({LOCK_LABEL: lock().content_hash(), DOCKERFILE_LABEL: "c" * 64})
    with pytest.raises(PublishError, match="no signed envelope"):
        publishing.publish(built, gated, target, docker=Engine(), signer=SIGNER, trusted=TRUSTED)  # type: ignore[arg-type]


# ---------------------------------------------------------------- 2c. an SBOM of 0 packages


def _package_lock() -> Lock:
    torch = LockedPackage(name="torch", version="2.13.0", filename="torch-2.13.0-cp311-cp311-linux_x86_64.whl",
                          sha256=hashlib.sha256(b"torch").hexdigest())
    return lock().model_copy(update={"layers": {"framework": (torch,), "compiler": (), "engine": (), "extras": ()}})


def test_an_sbom_that_does_not_list_the_locks_packages_is_refused(tmp_path):
    lk = _package_lock()
    assert sbom_problems(INVENTORY, lk) == []  # torch 2.13.0 is listed
    assert "0 Python distributions" in sbom_problems(ImageInventory(), lk)[0]
    assert sbom_problems(ImageInventory(), lock()) == []  # a lock of no packages: nothing to list
    p = plan(verdict(lk=lk), lk=lk)
    reg = FakeRegistry()
    with pytest.raises(PublishError, match="0 Python distributions.*nothing was pushed"):
        publish_image(plan=p, docker=FakeEngine(), client=reg, signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                      lock_folder=tmp_path, inventory=ImageInventory())
    assert reg.manifests == {}
    from skupin.publishing.sbom import PythonDistribution

    other = ImageInventory(python=(PythonDistribution(name="numpy", version="2.0.0", path="x/numpy-2.0.0.dist-info",
                                                      vendored=False),))
    assert "torch==2.13.0" in sbom_problems(other, lk)[0]
