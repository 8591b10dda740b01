"""The signed SBOM on the real engine and a real distribution 2.8 registry: the CPU image published (its layers read
from the engine, never run), verify/inspect/pull reading the SBOM, `skupin verify --sbom-out` writing it, a tampered
SBOM layer refused with exit 8, and an image published before SBOMs existed reported as "no SBOM".

The CPU image is published with a verdict made here (as test_publish.py does for tiny images: the gate is not what is
tested) and signed by the test key; the CLI runs in a folder with no catalog, so it compares signature, subject, SKU and
gate only (the committed bundle is not the test verdict's).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from skupin.clients.oci import RegistryClient
from skupin.common.errors import PublishError
from skupin.common.model import canonical_json
from skupin.dockerd import Docker
from skupin.publishing.attest import BOM_PREDICATE_TYPE, PREDICATE_TYPE, Signer, bom_statement, tolerance_sha256
from skupin.publishing.local_registry import LocalRegistry, untag_on_disk
from skupin.publishing.policy import Expected
from skupin.publishing.publish import (
    OCI_MANIFEST,
    attestation_artifact,
    attestation_tag,
    parse_target,
    plan_publish,
    publish_image,
    read_attestation_layers,
    verdict_facts,
)
from skupin.publishing.verify import pull_verified, verify_reference
from tests.integration.test_publish import (
    BUNDLE,
    REPO,
    SIGNER,
    TOL_ENTRY,
    TOL_KEY,
    TRUSTED,
    make_verdict,
    registry,  # noqa: F401 - a fixture
)

pytestmark = pytest.mark.integration
SKU = "cpu-x86_64"


def _store(registry: LocalRegistry, digest: str, *envelopes: tuple[bytes, str]) -> None:
    """Replace the attestation manifest of `digest` with these layers, as anyone with write access could."""
    (first, _kind), *rest = envelopes
    art = attestation_artifact(envelope=first, subject=None, more=tuple(rest))
    with RegistryClient(registry.url, retries=0) as client:
        client.push_blob(SKU, art.config)
        for layer in art.layers:
            client.push_blob(SKU, layer)
        client.put_manifest(SKU, attestation_tag(digest), art.manifest, OCI_MANIFEST)


def _skupin(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The installed command, in a folder with no catalog and its own state folder."""
    env = {**os.environ, "SKUPIN_STATE": str(cwd / "state")}
    return subprocess.run([str(REPO / ".venv" / "bin" / "skupin"), *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def test_the_cpu_image_is_published_with_a_signed_sbom_that_verify_reads(docker: Docker, registry: LocalRegistry,
                                                                         stack, honest_image, tmp_path: Path):
    lock = stack.lock
    expected = Expected(sku=SKU, lock_sha256=lock.content_hash(), bundle_sha256=BUNDLE, tolerance_key=TOL_KEY,
                        tolerance_sha256=tolerance_sha256(TOL_ENTRY), catalog="test")
    target = parse_target(registry.addr)
    plan = plan_publish(sku=SKU, engine_version=stack.manifest.stack.engine.version, lock=lock,
                        dockerfile_sha256="c" * 64, image_id=honest_image,
                        verdict=verdict_facts(make_verdict(image_id=honest_image, lock=lock, sku=SKU)), target=target,
                        expected=expected)
    t0 = time.monotonic()
    with RegistryClient(target.url) as client:
        published = publish_image(plan=plan, docker=docker, client=client, signer=SIGNER, trusted=TRUSTED,
                                  untag=lambda r, t: untag_on_disk(registry=registry, repository=r, tag=t))
        layers = read_attestation_layers(client=client, repository=SKU, digest=published.digest)
    publish_s = time.monotonic() - t0
    assert [kind for kind, _env in layers] == [PREDICATE_TYPE, BOM_PREDICATE_TYPE]  # one .att manifest, two layers
    (_, verification), (_, sbom_env) = layers
    with RegistryClient(registry.url) as client:  # the referrer (OCI 1.1 subject) carries both
        att = client.get_manifest(SKU, attestation_tag(published.digest)).json()
    assert att["subject"]["digest"] == published.digest and len(att["layers"]) == 2

    ref = f"{registry.addr}/{SKU}:verified"
    t0 = time.monotonic()
    result = verify_reference(ref=ref, expect=lambda _sku: expected, trusted=TRUSTED)
    verify_s = time.monotonic() - t0
    assert result.ok and result.sbom is not None and result.bom is not None, result.line()
    assert result.sbom.python == len(lock.packages()), (result.sbom, sorted(lock.packages()))
    assert result.sbom.image == published.digest and result.sbom_signer == SIGNER.keyid
    assert published.sbom == result.sbom
    by_name = {(c["purl"].split("/")[0], c["name"]): c for c in result.bom["components"]}
    torch = by_name[("pkg:pypi", "torch")]
    locked = lock.packages()["torch"]
    assert torch["version"] == locked.version and torch["hashes"] == [{"alg": "SHA-256", "content": locked.sha256}]
    libc = by_name[("pkg:deb", "libc6")]
    assert libc["purl"].startswith("pkg:deb/debian/libc6@") and "arch=amd64" in libc["purl"]
    assert result.sbom.debian >= 50  # a Debian minbase has about a hundred

    # the command: verify writes the verified BOM, inspect shows it
    key = tmp_path / "trusted.pub"
    key.write_bytes(SIGNER.public_pem())
    out = tmp_path / "sbom.json"
    run = _skupin(["verify", ref, "--key", str(key), "--sbom-out", str(out)], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SBOM: {result.sbom.python} Python distributions" in run.stdout
    assert json.loads(out.read_text(encoding="utf-8")) == result.bom
    run = _skupin(["inspect", ref, "--key", str(key)], tmp_path)
    assert run.returncode == 0 and "attestation 2: SBOM signed by" in run.stdout, run.stdout + run.stderr
    assert f"{result.sbom.python} Python distributions" in run.stdout

    # a tampered SBOM layer: re-signed by an unknown key, or its payload changed; refused with exit 8
    stranger = Signer(ec.generate_private_key(ec.SECP256R1()))
    resigned = stranger.sign_statement(bom_statement(repository=SKU, digest=published.digest, bom=result.bom))
    env = json.loads(sbom_env)
    stmt = json.loads(base64.b64decode(env["payload"]))
    stmt["predicate"]["components"] = [c for c in stmt["predicate"]["components"] if c["name"] != "torch"]
    env["payload"] = base64.b64encode(canonical_json(stmt)).decode()
    for why, bad in (("re-signed by an unknown key", resigned), ("payload changed", canonical_json(env))):
        _store(registry, published.digest, (verification, PREDICATE_TYPE), (bad, BOM_PREDICATE_TYPE))
        refused = verify_reference(ref=ref, expect=lambda _sku: expected, trusted=TRUSTED)
        assert not refused.ok and "the SBOM attestation" in refused.reason, (why, refused.line())
        if why == "payload changed":  # the command too (once: each run costs a second or two)
            run = _skupin(["verify", ref, "--key", str(key)], tmp_path)
            assert run.returncode == 8 and "NOT verified" in run.stdout and "SBOM" in run.stdout, (why, run.stdout)
    with pytest.raises(PublishError, match="the SBOM attestation"):  # pull refuses before pulling anything
        pull_verified(sku=SKU, target=target, docker=docker, expect=lambda _sku: expected, trusted=TRUSTED)

    # published before SBOMs existed: verified, said "no SBOM"; refused where one is required
    _store(registry, published.digest, (verification, PREDICATE_TYPE))
    old = verify_reference(ref=ref, expect=lambda _sku: expected, trusted=TRUSTED)
    assert old.ok and old.sbom is None and old.line().endswith("; no SBOM"), old.line()
    assert not verify_reference(ref=ref, expect=lambda _sku: expected, trusted=TRUSTED, require_sbom=True).ok
    run = _skupin(["verify", ref, "--key", str(key), "--require-sbom"], tmp_path)
    assert run.returncode == 8 and "no SBOM attestation" in run.stdout, run.stdout + run.stderr
    print(f"\nCPU image publish with SBOM {publish_s:.1f} s (push {published.push_s:.1f} s), verify {verify_s:.2f} s: "
          f"{result.line()}")
