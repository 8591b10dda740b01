"""The signed attestation (in-toto Statement v1 in DSSE, ECDSA P-256), the policy both sides apply, signing keys, and
tolerance-file validation: no network, no Docker. The signature is also checked with OpenSSL (an independent
implementation of ECDSA/SHA-256 over the DSSE pre-authentication encoding)."""

from __future__ import annotations

import base64
import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from skupin.builder.catalog.lockfile import Lock, LockedBase
from skupin.common.errors import GateCouldNotRun, PublishError
from skupin.common.model import canonical_json
from skupin.publishing import attest
from skupin.publishing.attest import (
    PAYLOAD_TYPE,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    CheckOutcome,
    ReferencePin,
    Signer,
    TolerancePin,
    TrustedKeys,
    VerificationPredicate,
    pae,
    statement,
    tolerance_sha256,
)
from skupin.publishing.policy import Expected, evaluate, expected_for
from tests.paths import REPO

SIGNER = Signer(ec.generate_private_key(ec.SECP256R1()))
TRUSTED = TrustedKeys({SIGNER.keyid: (SIGNER.key.public_key(), "test")})
STRANGER = Signer(ec.generate_private_key(ec.SECP256R1()))
DIGEST = "sha256:" + "ab" * 32
OTHER_DIGEST = "sha256:" + "cd" * 32
IMAGE_ID = "sha256:" + "1" * 64
ENTRY = {"kernels": {"silu": 1e-3}, "provenance": {"runs": 3}}


def _lock(salt: str = "a") -> Lock:
    return Lock(sku="cpu-x86_64", manifest_sha256=salt * 64, python="3.11", platform="linux/amd64",
                base=LockedBase(kind="bootstrap", reference="skupin-base/x:1", recipe_sha256="b" * 64),
                layers={"framework": (), "compiler": (), "engine": (), "extras": ()}, dockerfile_sha256="c" * 64,
                resolver="none", tool_version="0.1.0", created="2026-11-29T00:00:00Z")


def predicate(**changes) -> VerificationPredicate:
    lk = _lock()
    checks = tuple(CheckOutcome(name=n, status="pass") for n in ("reference", "boot", "pins", "kernels", "model"))
    base = VerificationPredicate(
        sku="cpu-x86_64", repository="cpu-x86_64", image_id=IMAGE_ID, lock_sha256=lk.content_hash(),
        lock=lk.model_dump(mode="json"), reference=ReferencePin(sha256="d" * 64, path="gates/references/x"),
        tolerance=TolerancePin(key="cpu-x86_64/float32/tiny-llama", entry_sha256=tolerance_sha256(ENTRY),
                               provenance=ENTRY["provenance"]),
        decision="pass", reason="passed", checks=checks, verdict_sha256="e" * 64, gate_created="2026-11-30T00:00:00Z",
        gate_tool_version="0.1.0", tool_version="0.1.0", published="2026-11-30T00:00:01Z")
    return base.model_copy(update=changes)


EXPECTED = Expected(sku="cpu-x86_64", lock_sha256=_lock().content_hash(), bundle_sha256="d" * 64,
                    tolerance_key="cpu-x86_64/float32/tiny-llama", tolerance_sha256=tolerance_sha256(ENTRY), catalog="test")


def envelope(p: VerificationPredicate | None = None, *, digest: str = DIGEST, signer: Signer = SIGNER) -> bytes:
    return signer.sign_statement(statement(repository="cpu-x86_64", digest=digest, predicate=p or predicate()))


# ---------------------------------------------------------------- the format


def test_pae_is_the_dsse_v1_encoding():
    # the example of the DSSE specification (protocol.md)
    assert pae("http://example.com/HelloWorld", b"hello world") == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


def test_the_envelope_holds_an_in_toto_statement_v1_about_the_digest():
    env = json.loads(envelope())
    assert env["payloadType"] == PAYLOAD_TYPE == "application/vnd.in-toto+json"
    (sig,) = env["signatures"]
    assert sig["keyid"] == ""  # as `cosign attest` writes it (cosign skips a keyid it did not derive itself)
    stmt = json.loads(base64.b64decode(env["payload"]))
    assert stmt["_type"] == STATEMENT_TYPE == "https://in-toto.io/Statement/v1"
    assert stmt["subject"] == [{"name": "cpu-x86_64", "digest": {"sha256": "ab" * 32}}]
    assert stmt["predicateType"] == PREDICATE_TYPE and stmt["predicate"]["sku"] == "cpu-x86_64"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_openssl_verifies_the_signature_over_the_pre_authentication_encoding(tmp_path: Path):
    """An independent implementation: OpenSSL checks the ECDSA P-256/SHA-256 signature over PAE(type, payload),
    with PAE written out here from the specification, not with publishing.attest.pae."""
    env = json.loads(envelope())
    payload = base64.b64decode(env["payload"])
    ptype = env["payloadType"].encode()
    (tmp_path / "pae.bin").write_bytes(b"DSSEv1 " + str(len(ptype)).encode() + b" " + ptype + b" "
                                       + str(len(payload)).encode() + b" " + payload)
    (tmp_path / "sig.der").write_bytes(base64.b64decode(env["signatures"][0]["sig"]))
    (tmp_path / "key.pub").write_bytes(SIGNER.public_pem())
    run = subprocess.run(["openssl", "dgst", "-sha256", "-verify", str(tmp_path / "key.pub"), "-signature",
                          str(tmp_path / "sig.der"), str(tmp_path / "pae.bin")], capture_output=True, text=True)
    assert run.returncode == 0 and "Verified OK" in run.stdout, run.stdout + run.stderr
    (tmp_path / "pae.bin").write_bytes(payload)  # the payload alone (no PAE) must not verify
    run = subprocess.run(["openssl", "dgst", "-sha256", "-verify", str(tmp_path / "key.pub"), "-signature",
                          str(tmp_path / "sig.der"), str(tmp_path / "pae.bin")], capture_output=True, text=True)
    assert run.returncode != 0


# ---------------------------------------------------------------- the policy


def test_the_honest_attestation_passes():
    result = evaluate(envelope(), trusted=TRUSTED, digest=DIGEST, expected=EXPECTED, image_id=IMAGE_ID)
    assert result.ok, result.reasons
    assert result.keyid == SIGNER.keyid and result.predicate == predicate()


def _tampered() -> bytes:
    env = json.loads(envelope())
    stmt = json.loads(base64.b64decode(env["payload"]))
    stmt["predicate"]["reference"]["sha256"] = "f" * 64
    env["payload"] = base64.b64encode(canonical_json(stmt)).decode()
    return canonical_json(env)


def _unsigned() -> bytes:
    env = json.loads(envelope())
    env["signatures"] = []
    return canonical_json(env)


def _forged_record() -> bytes:
    """The issue's forged record: a hand-written JSON that says it passed."""
    return json.dumps({"sku": "cpu-x86_64", "passed": True, "bundle_sha256": "forged"}).encode()


@pytest.mark.parametrize("raw", [
    b'{"payloadType": "application/vnd.in-toto+json", "payload": "e30=", "signatures": 5}',
    b'{"payloadType": "application/vnd.in-toto+json", "payload": "e30=", "signatures": [{"keyid": ["x"], "sig": "AA=="}]}',
    b"[" * 100_000,
    b'{"payloadType": "application/vnd.in-toto+json", "payload": "e30=", "signatures": ' + b"[" * 5000 + b"]" * 5000 + b"}",
])
def test_a_hostile_envelope_is_refused_not_a_crash(raw: bytes) -> None:
    with pytest.raises(attest.EnvelopeError):
        attest.open_envelope(raw, TRUSTED)


@pytest.mark.parametrize("data, digest, expected, why", [
    (_forged_record(), DIGEST, EXPECTED, "not a DSSE envelope"),
    (_unsigned(), DIGEST, EXPECTED, "unsigned"),
    (envelope(signer=STRANGER), DIGEST, EXPECTED, f"signed by a key this catalog does not trust: {STRANGER.keyid}"),
    (_tampered(), DIGEST, EXPECTED, "does not verify with the key that claims it"),
    (envelope(digest=OTHER_DIGEST), DIGEST, EXPECTED, "a signature over another image"),
    (envelope(predicate(sku="cuda-h200")), DIGEST, EXPECTED, "is for SKU cuda-h200, not cpu-x86_64"),
    (envelope(), DIGEST, EXPECTED.model_copy(update={"sku": "cuda-h200"}), "not cuda-h200"),
    (envelope(predicate(checks=(CheckOutcome(name="pins", status="pass"),))), DIGEST, EXPECTED,
     "required checks did not pass: model (absent)"),
    (envelope(predicate(checks=(CheckOutcome(name="pins", status="pass"), CheckOutcome(name="model", status="skipped")))),
     DIGEST, EXPECTED, "model (skipped)"),
    (envelope(predicate(decision="fail")), DIGEST, EXPECTED, "the gate did not pass"),
    (envelope(predicate(reference=ReferencePin(sha256="f" * 64))), DIGEST, EXPECTED, "not the committed bundle"),
    (envelope(predicate(tolerance=None)), DIGEST, EXPECTED, "names no tolerance entry"),
    (envelope(predicate(tolerance=TolerancePin(key="cpu-x86_64/float32/tiny-llama", entry_sha256="0" * 64))), DIGEST,
     EXPECTED, "is not the committed entry"),
    (envelope(), DIGEST, EXPECTED.model_copy(update={"lock_sha256": _lock("f").content_hash()}),
     "an attestation for an older lock"),
])
def test_the_policy_refuses(data, digest, expected, why):
    result = evaluate(data, trusted=TRUSTED, digest=digest, expected=expected, image_id=IMAGE_ID)
    assert not result.ok
    assert why in result.reason(), result.reason()


def test_the_policy_checks_the_image_config():
    result = evaluate(envelope(), trusted=TRUSTED, digest=DIGEST, expected=EXPECTED, image_id="sha256:" + "9" * 64)
    assert not result.ok and "the gate ran" in result.reason()


def test_a_second_signature_by_a_trusted_key_is_enough():
    env = json.loads(envelope())
    env["signatures"].insert(0, {"keyid": STRANGER.keyid, "sig": base64.b64encode(b"nope").decode()})
    assert evaluate(canonical_json(env), trusted=TRUSTED, digest=DIGEST, expected=EXPECTED).ok


def test_expected_for_reads_the_committed_files():
    exp = expected_for("cpu-x86_64")
    assert exp.sku == "cpu-x86_64" and len(str(exp.lock_sha256)) == 64 and len(str(exp.bundle_sha256)) == 64
    assert str(exp.tolerance_key).startswith("cpu-x86_64/") and exp.tolerance_sha256 is not None
    assert exp.catalog == str(REPO)


NO_CATALOG = Expected(sku="cpu-x86_64", lock_sha256=None, bundle_sha256=None, tolerance_key=None, tolerance_sha256=None,
                      catalog=None)


def test_without_a_catalog_only_the_signed_facts_are_checked(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SKUPIN_ROOT", raising=False)
    assert expected_for("cpu-x86_64") == NO_CATALOG
    old_lock = predicate(reference=ReferencePin(sha256="f" * 64),
                         tolerance=TolerancePin(key="other/float32/x", entry_sha256="0" * 64))
    assert evaluate(envelope(old_lock), trusted=TRUSTED, digest=DIGEST, expected=NO_CATALOG, image_id=IMAGE_ID).ok
    for bad, why in ((envelope(signer=STRANGER), "signed by a key this catalog does not trust"),
                     (envelope(predicate(decision="fail")), "the gate did not pass"),
                     (envelope(predicate(sku="cuda-h200")), "is for SKU cuda-h200"),
                     (envelope(predicate(tolerance=None)), "names no tolerance entry"),
                     (envelope(digest=OTHER_DIGEST), "a signature over another image")):
        result = evaluate(bad, trusted=TRUSTED, digest=DIGEST, expected=NO_CATALOG, image_id=IMAGE_ID)
        assert not result.ok and why in result.reason(), result.reason()


# ---------------------------------------------------------------- keys


def test_keys_generate_writes_a_private_key_0600_and_trusts_the_default_one(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path / "state"))
    pair = attest.generate_keys()
    assert Path(pair.private) == tmp_path / "state" / "keys" / "signing.key"
    assert stat.S_IMODE(Path(pair.private).stat().st_mode) == 0o600
    assert pair.trusted_copy and Path(pair.trusted_copy).read_bytes() == Path(pair.public).read_bytes()
    assert pair.keyid in attest.trusted_keys()
    assert attest.find_signer().keyid == pair.keyid
    with pytest.raises(PublishError, match="refusing to overwrite"):
        attest.generate_keys()
    other = attest.generate_keys(out=tmp_path / "elsewhere")
    assert other.trusted_copy is None and other.keyid not in attest.trusted_keys()
    assert attest.trusted_keys([Path(other.public)]).keys.keys() == {other.keyid}


def test_keys_generate_refuses_a_folder_inside_the_repository():
    with pytest.raises(PublishError, match="inside the repository"):
        attest.generate_keys(out=REPO / "keys" / "trusted")


def test_find_signer_says_how_to_make_a_key_and_run_makes_one(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path))
    monkeypatch.delenv(attest.SIGNING_KEY_ENV, raising=False)
    with pytest.raises(PublishError, match="skupin keys generate"):
        attest.find_signer()
    monkeypatch.setenv(attest.SIGNING_KEY_ENV, str(tmp_path / "missing.key"))
    with pytest.raises(PublishError, match="does not exist"):
        attest.find_signer()
    monkeypatch.delenv(attest.SIGNING_KEY_ENV)
    said: list[str] = []
    signer = attest.find_signer(create=True, on_event=said.append)
    assert said and "generated a local signing key" in said[0] and signer.keyid in attest.trusted_keys()
    (tmp_path / "rsa.key").write_text("not a key")
    with pytest.raises(PublishError, match="not a readable"):
        attest.load_signer(tmp_path / "rsa.key")


# ---------------------------------------------------------------- tolerance files


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 0.0])
def test_a_tolerance_file_with_a_non_finite_or_non_positive_threshold_is_refused(tmp_path: Path, value: float):
    import yaml

    from skupin.gates.judge.tolerance import DEFAULT_PATH, load_tolerances

    data = yaml.safe_load(DEFAULT_PATH.read_text(encoding="utf-8"))
    op = next(iter(data["entries"][0]["kernels"]))
    data["entries"][0]["kernels"][op] = value
    path = tmp_path / "tolerances.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(GateCouldNotRun) as err:
        load_tolerances(path)
    assert str(path) in str(err.value) and f"entries.0.kernels.{op}" in str(err.value)
