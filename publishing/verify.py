"""Check a published image for operators: tag -> digest -> signed attestation -> the policy (publishing/policy.py).

`verify_reference` never raises for "not verified": it returns a `Verification` whose `line()` is
the one-line answer (`verified: REF -> name@sha256:... (...)` or `NOT verified: why`). It applies
exactly the policy `publish` applied before pushing: a signature from a trusted key, subject == the
digest the reference resolves to, the SKU asked for (default: the repository's last path part), the
gate passed with every required check, the committed reference bundle and tolerance entry, the
current lock. The SBOM attestation stored next to it (publishing/sbom.py) must then pass its own policy
(`evaluate_sbom`: a trusted key, subject == the digest, a valid CycloneDX document about it) when it is
there; an image published before skupin stored SBOMs has none, which is said ("no SBOM") and refused
only with `require_sbom`. `pull_verified` resolves `<sku>:verified`, verifies that digest and pulls it by
digest (never by a tag that may have moved since).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from clients.oci import RegistryClient, parse_image_ref
from common.errors import NetworkError, PublishError, SkupinError
from common.model import Frozen
from common.untrusted import json_depth, printable
from publishing.attest import BOM_PREDICATE_TYPE, TrustedKeys, VerificationPredicate, trusted_keys
from publishing.policy import (
    ExpectFor,
    PolicyResult,
    SbomResult,
    evaluate,
    evaluate_sbom,
    expectations,
    expected_for,
    signed_predicate,
)
from publishing.publish import VERIFIED_TAG, RegistryTarget, read_attestation_layers, read_attestations
from publishing.sbom import BomSummary

ClientFor = Callable[[str], RegistryClient]  # registry host -> client


class Verification(Frozen):
    """The answer for one reference."""

    ok: bool
    ref: str
    reference: str | None = None
    digest: str | None = None
    sku: str | None = None
    lock_sha256: str | None = None
    gate_date: str | None = None
    signer: str | None = Field(None, description="Key id of the trusted key that signed the attestation")
    reason: str = ""
    catalog: str | None = Field(None, description="The catalog whose lock, bundle and tolerance were compared; None: "
                                                  "no catalog, so signature, subject, SKU and gate only")
    unreachable: bool = Field(False, description="The registry could not be reached or answered wrongly (exit 9)")
    image_id: str | None = Field(None, exclude=True)  # the attestation's image id; not part of `verify --json`
    sbom: BomSummary | None = Field(None, description="The verified SBOM's counts; None: no SBOM was stored")
    sbom_signer: str | None = Field(None, description="Key id of the trusted key that signed the SBOM")
    bom: dict[str, Any] | None = Field(None, exclude=True, repr=False)  # the verified CycloneDX document

    def line(self) -> str:
        if self.ok:
            against = "" if self.catalog else "; no catalog: not compared with a current lock, bundle or tolerance"
            sbom = (f"; SBOM: {self.sbom.line()} (CycloneDX {self.sbom.spec_version}, signed by "
                    f"{str(self.sbom_signer)[:12]})") if self.sbom else "; no SBOM"
            return (f"verified: {self.ref} -> {self.reference} ({self.sku}, lock {str(self.lock_sha256)[:12]}, "
                    f"gate passed {self.gate_date or 'at an unknown date'}, signed by {str(self.signer)[:12]}{against})"
                    f"{sbom}")
        return f"NOT verified: {self.ref}: {printable(self.reason, 600)}"  # reasons quote what a registry said


MAX_MANIFEST_BYTES = 4 * 1024**2  # an image manifest is a few KB


def _default_client(host: str) -> RegistryClient:
    return RegistryClient(host)


def _trusted(keys: TrustedKeys | list[Path] | None) -> TrustedKeys:
    """The keys given, or the trusted keys found; PublishError when there are none (nothing can be verified)."""
    found = keys if isinstance(keys, TrustedKeys) else trusted_keys(keys)
    if not len(found):
        raise PublishError("no trusted public keys (keys/trusted/*.pub, .skupin/keys/trusted/*.pub or --key FILE)")
    return found


def verify_reference(*, ref: str, sku: str | None = None, expect: ExpectFor = expected_for,
                     trusted: TrustedKeys | list[Path] | None = None,
                     client_for: ClientFor = _default_client, require_sbom: bool = False) -> Verification:
    """Resolve `ref` (host/repo:tag or host/repo@sha256:...) and apply the policy to its attestations; then the SBOM's
    policy to its SBOM attestation (none: "no SBOM", refused only with `require_sbom`)."""
    name = parse_image_ref(ref)
    no = lambda why, **kw: Verification(ok=False, ref=ref, reason=why, **kw)  # noqa: E731
    if not name.tag and not name.digest:
        return no("give a tag or a digest (host/repo:tag)")
    asked = sku or name.repository.rsplit("/", 1)[-1]
    try:
        keys = _trusted(trusted)
    except PublishError as exc:
        return no(str(exc))
    expected = expectations(expect, asked)
    if isinstance(expected, str):
        return no(expected)
    client = client_for(name.registry)
    try:
        try:
            digest = client.resolve(name.repository, name.digest or name.tag or VERIFIED_TAG)
        except NetworkError as exc:
            return no(f"cannot resolve it: {exc}", unreachable=True)
        if name.digest and digest != name.digest:
            return no(f"the registry serves {digest} for {name.digest}")
        pinned = f"{name.registry}/{name.repository}@{digest}"
        try:
            layers = read_attestation_layers(client=client, repository=name.repository, digest=digest)
            image = client.get_manifest(name.repository, digest)
        except (PublishError, NetworkError) as exc:
            return no(str(exc), digest=digest, reference=pinned, unreachable=isinstance(exc, NetworkError))
        try:
            body = image.json() if len(image.body) <= MAX_MANIFEST_BYTES and json_depth(image.body) <= 16 else None
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            return no(f"the registry's manifest for {digest} is not a JSON object", digest=digest, reference=pinned)
        block = body.get("config")
        config = block.get("digest") if isinstance(block, dict) and isinstance(block.get("digest"), str) else None
        envelopes = [env for kind, env in layers if kind != BOM_PREDICATE_TYPE]
        if not envelopes:
            return no(f"no verification attestation for {digest[:19]} (only an SBOM)", digest=digest, reference=pinned)
        results = [evaluate(env, trusted=keys, digest=digest, expected=expected, image_id=config) for env in envelopes]
        best = next((r for r in results if r.ok), results[0])
        sboms = [evaluate_sbom(env, trusted=keys, digest=digest) for kind, env in layers if kind == BOM_PREDICATE_TYPE]
        return _answer(ref=ref, pinned=pinned, digest=digest, result=best, catalog=expected.catalog, sboms=sboms,
                       require_sbom=require_sbom)
    finally:
        client.close()


def _answer(*, ref: str, pinned: str, digest: str, result: PolicyResult, catalog: str | None,
            sboms: list[SbomResult], require_sbom: bool) -> Verification:
    p = result.predicate
    base: dict[str, Any] = dict(ref=ref, reference=pinned, digest=digest, signer=result.keyid, catalog=catalog)
    if p is not None:
        base.update(sku=p.sku, lock_sha256=p.lock_sha256, gate_date=p.gate_created, image_id=p.image_id)
    if not result.ok:
        return Verification(ok=False, reason=result.reason(), **base)
    sbom = next((s for s in sboms if s.ok), None)
    if sbom is not None:
        return Verification(ok=True, sbom=sbom.summary, sbom_signer=sbom.keyid, bom=sbom.bom, **base)
    if sboms:  # stored, but none verifies: the SBOM is refused, and so is the image
        return Verification(ok=False, reason=sboms[0].reason, **base)
    if require_sbom:
        return Verification(ok=False, reason=f"no SBOM attestation is stored for {digest[:19]} (published before "
                                             "skupin stored SBOMs, or stored without one); required here", **base)
    return Verification(ok=True, **base)


class Record(Frozen):
    """One attestation stored for a digest: its signer and record when a trusted key signed it, else why not."""

    signer: str | None = None
    predicate: VerificationPredicate | None = None
    sbom: BomSummary | None = Field(None, description="Set for an SBOM attestation (predicateType "
                                                      "https://cyclonedx.org/bom) a trusted key signed")
    problem: str = ""


class Inspection(Frozen):
    """What `skupin inspect REF` prints: the digest REF resolves to and every attestation stored for it."""

    ref: str
    reference: str
    digest: str
    records: tuple[Record, ...]


def inspect_reference(*, ref: str, trusted: TrustedKeys | list[Path] | None = None,
                      client_for: ClientFor = _default_client) -> Inspection:
    """Resolve `ref` and read its attestations; only what a trusted key signed is shown (the rest is named unread).

    NetworkError when the registry cannot be reached; PublishError when REF names neither tag nor digest,
    no key is trusted, or the registry holds no attestation for the digest. The SKU, lock and gate are
    reported as signed, not compared with a catalog (`verify` does that).
    """
    name = parse_image_ref(ref)
    if not name.tag and not name.digest:
        raise PublishError(f"{ref}: give a tag or a digest (host/repo:tag)")
    keys = _trusted(trusted)
    with client_for(name.registry) as client:
        digest = client.resolve(name.repository, name.digest or name.tag or VERIFIED_TAG)
        if name.digest and digest != name.digest:
            raise PublishError(f"{ref}: the registry serves {digest} for {name.digest}")
        layers = read_attestation_layers(client=client, repository=name.repository, digest=digest)
    records = []
    for kind, env in layers:
        if kind == BOM_PREDICATE_TYPE:
            checked = evaluate_sbom(env, trusted=keys, digest=digest)
            records.append(Record(signer=checked.keyid, sbom=checked.summary) if checked.ok
                           else Record(problem=checked.reason))
            continue
        try:
            predicate, keyid = signed_predicate(env, trusted=keys, digest=digest)
        except PublishError as exc:
            records.append(Record(problem=str(exc)))
            continue
        records.append(Record(signer=keyid, predicate=predicate))
    return Inspection(ref=ref, reference=f"{name.registry}/{name.repository}@{digest}", digest=digest,
                      records=tuple(records))


def pull_verified(*, sku: str, target: RegistryTarget, docker, expect: ExpectFor = expected_for,
                  trusted: TrustedKeys | list[Path] | None = None,
                  client_for: ClientFor = _default_client, require_sbom: bool = False) -> tuple[Verification, str]:
    """Verify `<sku>:verified` for SKU `sku` and pull its digest; (verification, local image id). PublishError when
    not verified, NetworkError when the registry cannot be reached (exit 9, as `verify`)."""
    ref = target.reference(sku, tag=VERIFIED_TAG)
    result = verify_reference(ref=ref, sku=sku, expect=expect, trusted=trusted,
                              client_for=lambda _host: client_for(target.url), require_sbom=require_sbom)
    if not result.ok or result.reference is None:
        raise (NetworkError if result.unreachable else PublishError)(result.line())
    image_id = docker.pull(result.reference)
    if image_id != result.image_id:
        raise PublishError(f"pulled {result.reference} but the engine has image {image_id}, "
                           f"the attestation says {result.image_id}")
    return result, image_id


def verified_image_id(*, sku: str, target: RegistryTarget, timeout: float = 3.0,
                      trusted: TrustedKeys | None = None) -> str | None:
    """The image id the signed attestation of `<sku>:verified` names (the SKU's currently verified image), or None.

    Any lock, bundle or tolerance: this is the baseline a new build is compared with, typically gated
    under the lock before a point release; the signature (a trusted key) and the subject digest are
    still required. None when the registry does not answer or holds no such tag or attestation.
    """
    try:
        keys = trusted if trusted is not None else trusted_keys()
        with RegistryClient(target.url, retries=0, timeout=timeout) as client:
            repository = target.repository(sku)
            digest = client.resolve(repository, VERIFIED_TAG)
            for env in read_attestations(client=client, repository=repository, digest=digest):
                try:
                    predicate, _keyid = signed_predicate(env, trusted=keys, digest=digest)
                except PublishError:
                    continue
                if predicate.sku == sku:
                    return predicate.image_id
    except (SkupinError, ValueError, TypeError, RecursionError):  # whatever the registry answered: no verified image
        return None
    return None
