"""Check a published image for operators: tag -> digest -> signed attestation -> the policy (skupin/publishing/policy.py).

`verify_reference` never raises for "not verified": it returns a `Verification` whose `line()` is
the one-line answer (`verified: REF -> name@sha256:... (...)` or `NOT verified: why`). It applies
exactly the policy `publish` applied before pushing: a signature from a trusted key, subject == the
digest the reference resolves to, the SKU asked for (default: the repository's last path part), the
gate passed with every required check, the committed reference bundle and tolerance entry, the
current lock. The SBOM attestation stored next to it (skupin/publishing/sbom.py) must then pass its own policy
(`evaluate_sbom`: a trusted key, subject == the digest, a valid CycloneDX document about it) when it is
there; an image published before skupin stored SBOMs has none, which is said ("no SBOM") and refused
only with `require_sbom`. `pull_verified` resolves `<sku>:verified`, verifies that digest and pulls it by
digest (never by a tag that may have moved since).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from skupin.clients.oci import ImageName, RegistryClient, parse_image_ref
from skupin.common.errors import ImageRefError, NetworkError, NotFoundError, PublishError, SkupinError
from skupin.common.model import Frozen
from skupin.common.paths import find_catalog, operator_trust, passed_over
from skupin.common.untrusted import json_depth, printable
from skupin.publishing.attest import BOM_PREDICATE_TYPE, TrustedKeys, VerificationPredicate, trusted_keys
from skupin.publishing.freshness import freshness_problems, load_policy, remember, rollback_problem
from skupin.publishing.policy import (
    ExpectFor,
    PolicyResult,
    SbomResult,
    evaluate,
    evaluate_sbom,
    expectations,
    expected_for,
    signed_predicate,
)
from skupin.publishing.publish import VERIFIED_TAG, RegistryTarget, read_attestation_layers, read_attestations
from skupin.publishing.sbom import BomSummary

if TYPE_CHECKING:
    from skupin.dockerd import Docker

ClientFor = Callable[[str], RegistryClient]  # registry host -> client


def refusal(line: str, *, absent: bool, unreachable: bool) -> SkupinError:
    """The error a refused verify is: NotFoundError (exit 15) when the registry has no such tag or digest,
    NetworkError (exit 9) when it cannot be reached, PublishError (exit 8) when the policy refuses what it holds."""
    cls = NotFoundError if absent else NetworkError if unreachable else PublishError
    return cls(line)


def trust_line(trust: tuple[str, ...]) -> str:
    """The line naming the trust anchors a verify used."""
    return f"trust anchors: {printable('; '.join(trust) or 'none', 2000)}"


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
    absent: bool = Field(False, description="The registry answered that the tag or digest does not exist (exit 15)")
    image_id: str | None = Field(None, exclude=True)  # the attestation's image id; not part of `verify --json`
    sbom: BomSummary | None = Field(None, description="The verified SBOM's counts; None: no SBOM was stored")
    sbom_signer: str | None = Field(None, description="Key id of the trusted key that signed the SBOM")
    bom: dict[str, Any] | None = Field(None, exclude=True, repr=False)  # the verified CycloneDX document
    trust: tuple[str, ...] = Field((), description="The trust anchors this answer used: each trusted key and its file, "
                                                  "the catalog compared with (or none), catalogs passed over and why")

    def error(self) -> SkupinError:
        return refusal(self.line(), absent=self.absent, unreachable=self.unreachable)

    def trust_line(self) -> str:
        return trust_line(self.trust)

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


def _tagged(ref: str) -> ImageName:
    """`ref` parsed; ImageRefError (bad input, exit 2) when it is not an image reference or names no tag or digest."""
    name = parse_image_ref(ref)
    if not name.tag and not name.digest:
        raise ImageRefError(f"{ref}: give a tag or a digest", field="image reference",
                            fix=f"{ref}:verified, or {ref}@sha256:<digest>")
    return name


def _default_client(host: str) -> RegistryClient:
    return RegistryClient(host)


def _trusted(keys: TrustedKeys | list[Path] | None) -> TrustedKeys:
    """The keys given, or the trusted keys found; PublishError when there are none (nothing can be verified)."""
    found = keys if isinstance(keys, TrustedKeys) else trusted_keys(keys)
    if not len(found):
        raise PublishError("no trusted public keys (keys/trusted/*.pub, .skupin/keys/trusted/*.pub or --key FILE)")
    return found


def trust_anchors(keys: TrustedKeys | None, catalog: str | None, *, compares: bool = True) -> tuple[str, ...]:
    """What an operator's answer rested on, one line each (`skupin verify` prints them, `--json` has them): the keys, the
    catalog compared with (when the command `compares`), and every catalog passed over with why."""
    compared = (f"catalog {catalog} (its lock, reference bundle and tolerance compared)" if catalog
                else "no catalog (signature, subject, SKU and gate only)")
    ignored = tuple(f"catalog {folder} passed over: {why}; fix: --root {folder} if you trust it"
                    for folder, why in sorted(passed_over().items()))
    return (*(keys.anchors() if keys is not None else ()), *((compared,) if compares else ()), *ignored)


def verify_reference(*, ref: str, sku: str | None = None, expect: ExpectFor = expected_for,
                     trusted: TrustedKeys | list[Path] | None = None,
                     client_for: ClientFor = _default_client, require_sbom: bool = False) -> Verification:
    """Resolve `ref` (host/repo:tag or host/repo@sha256:...) and apply the policy to its attestations; then the SBOM's
    policy to its SBOM attestation (none: "no SBOM", refused only with `require_sbom`). Trust comes from the keys
    given, or from a catalog only as `operator_trust()` allows (skupin/common/paths.py); the answer names it all.
    A refusal's `error()` is the exception it exits as (8, 9 or 15); ImageRefError (exit 2) is raised, not answered,
    when `ref` is not an image reference or names neither tag nor digest."""
    with operator_trust():
        find_catalog()  # which catalog counts is settled first, so even an early refusal names it
        try:
            keys: TrustedKeys | None = _trusted(trusted)
        except PublishError:
            keys = None
        result = _verify(ref=ref, sku=sku, expect=expect, trusted=keys if keys is not None else trusted,
                         client_for=client_for, require_sbom=require_sbom)
        return result.model_copy(update={"trust": trust_anchors(keys, result.catalog)})


def _verify(*, ref: str, sku: str | None, expect: ExpectFor, trusted: TrustedKeys | list[Path] | None,
            client_for: ClientFor, require_sbom: bool) -> Verification:
    name = _tagged(ref)
    no = lambda why, **kw: Verification(ok=False, ref=ref, reason=why, **kw)  # noqa: E731
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
        except NotFoundError as exc:
            return no(f"cannot resolve it: {exc}", absent=True)
        except NetworkError as exc:
            return no(f"cannot resolve it: {exc}", unreachable=True)
        if name.digest and digest != name.digest:
            return no(f"the registry serves {digest} for {name.digest}")
        pinned = f"{name.registry}/{name.repository}@{digest}"
        try:
            layers = read_attestation_layers(client=client, repository=name.repository, digest=digest)
            image = client.get_manifest(name.repository, digest)
        except (PublishError, NetworkError) as exc:
            return no(str(exc), digest=digest, reference=pinned, absent=isinstance(exc, NotFoundError),
                      unreachable=isinstance(exc, NetworkError) and not isinstance(exc, NotFoundError))
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
        accepted = sorted((r for r in results if r.ok and r.predicate is not None),
                          key=lambda r: str(r.predicate.published if r.predicate else ""), reverse=True)
        sboms = [evaluate_sbom(env, trusted=keys, digest=digest) for kind, env in layers if kind == BOM_PREDICATE_TYPE]
        return _fresh_answer(ref=ref, pinned=pinned, digest=digest, result=accepted[0] if accepted else results[0],
                             catalog=expected.catalog, sboms=sboms, require_sbom=require_sbom,
                             moving=f"{name.registry}/{name.repository}" if name.tag == VERIFIED_TAG and not name.digest
                             else None)
    finally:
        client.close()


def _stale(predicate: VerificationPredicate, *, digest: str, keyid: str | None, moving: str | None) -> str:
    """Why a record the policy accepted is not fresh (skupin/publishing/freshness.py); "" when it is. `moving`: the
    repository when the reference is its moving `verified` tag (then a rollback is refused too)."""
    try:
        policy = load_policy(find_catalog())
        problems = freshness_problems(predicate, digest=digest, keyid=keyid, policy=policy)
        if moving and not problems and (rolled := rollback_problem(predicate, repository=moving, digest=digest)):
            problems.append(rolled)
    except PublishError as exc:
        return str(exc)
    return "; ".join(problems)


def _fresh_answer(*, ref: str, pinned: str, digest: str, result: PolicyResult, catalog: str | None,
                  sboms: list[SbomResult], require_sbom: bool, moving: str | None) -> Verification:
    """The answer for the best record: refused when not fresh, and remembered when it verified through `verified`."""
    if result.ok and result.predicate is not None:
        stale = _stale(result.predicate, digest=digest, keyid=result.keyid, moving=moving)
        if stale:
            return Verification(ok=False, ref=ref, reason=stale, digest=digest, reference=pinned, signer=result.keyid,
                                catalog=catalog, sku=result.predicate.sku, lock_sha256=result.predicate.lock_sha256,
                                gate_date=result.predicate.gate_created)
    answer = _answer(ref=ref, pinned=pinned, digest=digest, result=result, catalog=catalog, sboms=sboms,
                     require_sbom=require_sbom)
    if answer.ok and result.predicate is not None and moving:
        remember(result.predicate, repository=moving, digest=digest)
    return answer


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
    trust: tuple[str, ...] = Field((), description="The trusted keys used, and catalogs passed over")


def inspect_reference(*, ref: str, trusted: TrustedKeys | list[Path] | None = None,
                      client_for: ClientFor = _default_client) -> Inspection:
    """Resolve `ref` and read its attestations; only what a trusted key signed is shown (the rest is named unread).

    NetworkError when the registry cannot be reached; PublishError when REF names neither tag nor digest,
    no key is trusted, or the registry holds no attestation for the digest. The SKU, lock and gate are
    reported as signed, not compared with a catalog (`verify` does that); trust as `verify_reference` takes it.
    """
    name = _tagged(ref)
    with operator_trust():
        keys = _trusted(trusted)
        found = _inspect(ref=ref, name=name, keys=keys, client_for=client_for)
        return found.model_copy(update={"trust": trust_anchors(keys, None, compares=False)})


def _inspect(*, ref: str, name: ImageName, keys: TrustedKeys, client_for: ClientFor) -> Inspection:
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


def pull_verified(*, sku: str, target: RegistryTarget, docker: Docker, expect: ExpectFor = expected_for,
                  trusted: TrustedKeys | list[Path] | None = None,
                  client_for: ClientFor = _default_client, require_sbom: bool = False) -> tuple[Verification, str]:
    """Verify `<sku>:verified` for SKU `sku` and pull its digest; (verification, local image id). PublishError when
    not verified, NetworkError when the registry cannot be reached (exit 9, as `verify`), NotFoundError (exit 15)
    when it has no such tag."""
    ref = target.reference(sku, tag=VERIFIED_TAG)
    result = verify_reference(ref=ref, sku=sku, expect=expect, trusted=trusted,
                              client_for=lambda _host: client_for(target.url), require_sbom=require_sbom)
    if not result.ok or result.reference is None:
        raise result.error()
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
