"""The one policy that decides whether a verification attestation vouches for an image: publish and verify both use it.

`evaluate(envelope, trusted=, digest=, expected=)` accepts an attestation only when

1. its DSSE signature verifies with a trusted public key (an unsigned envelope, an unknown key or a
   signature over other bytes is refused before anything in it is believed);
2. it is an in-toto Statement v1 of our predicate type whose subject digest is the image digest
   being published, verified or pulled;
3. its predicate is for the SKU asked for, and `predicate_problems` finds nothing: the gate passed,
   no check failed or errored, every required check (`REQUIRED_CHECKS`) passed, the reference bundle
   is the SKU's committed one, the tolerance entry is the committed entry of its key (by content
   hash), the lock hashes to the lock hash it names; and the image config id matches when known;
4. the lock is the SKU's current lock. A record for an older lock is refused (not a warning): the
   reason names both locks, so an operator sees it is stale rather than forged.

Without a catalog (an operator who only installed skupin), steps 1-3 still apply except the
comparisons with the catalog's bundle, tolerance entry and lock, which there is nothing to compare
with: `Expected.catalog` is None and the answer says so (`verify` prints "no catalog: ...").

The SBOM attestation (predicateType https://cyclonedx.org/bom, skupin/publishing/sbom.py) has its own, smaller
policy, `evaluate_sbom`: steps 1 and 2 (same trusted keys, subject == the digest) and a valid CycloneDX
document about that digest.

`publish` runs `predicate_problems` while planning (before anything is pushed) and `evaluate` on the
signed envelope before storing it; `verify`/`pull` run `evaluate` on what they fetch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from skupin.builder.catalog.lockfile import Lock, lock_path, read_lock
from skupin.common.errors import BundleError, PublishError, SkupinError
from skupin.common.model import Frozen, canonical_json
from skupin.common.paths import data_path, find_catalog, sku_path
from skupin.publishing.attest import (
    BOM_PREDICATE_TYPE,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    EnvelopeError,
    TrustedKeys,
    VerificationPredicate,
    hard_bounds_sha256,
    open_envelope,
    tolerance_sha256,
)
from skupin.publishing.sbom import BomSummary, bom_summary

if TYPE_CHECKING:
    from skupin.builder.catalog.manifest import SkuManifest
    from skupin.gates.judge.tolerance import Tolerances

REQUIRED_CHECKS = ("pins", "model")


class Expected(Frozen):
    """What the catalog knows about a SKU: its current lock, reference bundle and tolerance entry (all None, with
    `catalog` None, when there is no catalog: only the SKU's name is known)."""

    sku: str
    lock_sha256: str | None
    bundle_sha256: str | None
    tolerance_key: str | None
    tolerance_sha256: str | None = Field(description="None: the catalog has no calibrated entry for the key")
    catalog: str | None = Field(description="the catalog compared with; None: no catalog, nothing to compare")
    float32_bundle_sha256: str | None = Field(None, description="The float32 bundle the SKU's float32 pass must have "
                                              "used; None: the SKU has no float32 pass (or no catalog)")
    float32_tolerance_key: str | None = None
    float32_tolerance_sha256: str | None = Field(None, description="The committed float32 entry; None: none committed")
    hard_bounds_sha256: str | None = Field(None, description="The committed hard bounds; None: no catalog")
    checks: tuple[str, ...] = Field((), description="The SKU's gate.checks: each must have passed (a gate run from a "
                                    "manifest that asked for fewer checks is refused)")


ExpectFor = Callable[[str], Expected]


def expected_for(sku: str) -> Expected:
    """The committed facts of `sku`: skus/<sku>.lock.json, its gate.reference bundle, gates/data/tolerances.yaml;
    only its name when there is no catalog (skupin/common/paths.py: find_catalog)."""
    catalog = find_catalog()
    if catalog is None:
        return Expected(sku=sku, lock_sha256=None, bundle_sha256=None, tolerance_key=None, tolerance_sha256=None,
                        catalog=None)
    # the catalog's side only when there is a catalog: an operator's `verify` never imports the gate's modules
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.gates.judge.tolerance import ToleranceKey, catalog_tolerances, load_tolerances
    from skupin.gates.refdata.bundle import bundle_sha256

    path = sku_path(sku)
    manifest = load_manifest(path)
    lock = read_lock(lock_path(path))
    folder = data_path(manifest.gate.reference)
    try:
        bundle = bundle_sha256(folder)
    except (BundleError, OSError) as exc:
        raise PublishError(f"{manifest.name}: the committed reference bundle cannot be read ({folder}): {exc}") from exc
    key = ToleranceKey.of(manifest)
    tolerances = load_tolerances(catalog_tolerances())
    entry = tolerances.find(key)
    return Expected(sku=manifest.name, lock_sha256=lock.content_hash(), bundle_sha256=bundle, tolerance_key=key.label(),
                    tolerance_sha256=tolerance_sha256(entry.model_dump(mode="json")) if entry else None,
                    catalog=str(catalog), hard_bounds_sha256=hard_bounds_sha256(tolerances.hard_bounds.model_dump()),
                    checks=tuple(manifest.gate.checks),
                    **_float32_expected(manifest, tolerances))


def _float32_expected(manifest: SkuManifest, tolerances: Tolerances) -> dict[str, str | None]:
    """What the catalog commits for the SKU's float32 pass (the gate's `float32` check): its bundle and its entry;
    nothing when the gate runs none (the SKU serves float32, or its engine has no float32 path)."""
    from skupin.engines import engine_float32
    from skupin.gates.judge.tolerance import ToleranceKey
    from skupin.gates.refdata.bundle import bundle_sha256, float32_reference

    if manifest.gate.dtype == "float32" or not engine_float32(manifest.stack.engine.name):
        return {}
    try:
        folder = data_path(float32_reference(Path(manifest.gate.reference), dtype=manifest.gate.dtype).as_posix())
        bundle = bundle_sha256(folder)
    except (BundleError, OSError) as exc:
        raise PublishError(f"{manifest.name}: the committed float32 bundle cannot be read: {exc}") from exc
    key = ToleranceKey.of(manifest, float32=True)
    entry = tolerances.find(key)
    return {"float32_bundle_sha256": bundle, "float32_tolerance_key": key.label(),
            "float32_tolerance_sha256": tolerance_sha256(entry.model_dump(mode="json")) if entry else None}


def verdict_sha256(document: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(document)).hexdigest()


def predicate_problems(predicate: VerificationPredicate, expected: Expected) -> list[str]:
    """Every reason the predicate's content does not satisfy the policy for `expected` (empty = fine)."""
    out: list[str] = []
    if predicate.sku != expected.sku:
        out.append(f"the attestation is for SKU {predicate.sku}, not {expected.sku}")
    if predicate.decision != "pass":
        out.append(f"the gate did not pass ({predicate.decision}: {predicate.reason})")
    statuses = {c.name: c.status for c in predicate.checks}
    bad = [f"{c.name} {c.status}" for c in predicate.checks if c.status not in ("pass", "skipped")]
    if bad:
        out.append(f"checks did not pass: {', '.join(bad)}")
    missing = [n for n in dict.fromkeys((*REQUIRED_CHECKS, *expected.checks)) if statuses.get(n) != "pass"]
    if missing:
        out.append("required checks did not pass: " + ", ".join(f"{n} ({statuses.get(n, 'absent')})" for n in missing))
    tol = predicate.tolerance
    if tol is None or tol.entry_sha256 is None:
        out.append("the attestation names no tolerance entry")
    try:
        if Lock.model_validate(predicate.lock).content_hash() != predicate.lock_sha256:
            out.append("the attestation's lock does not hash to its lock_sha256")
    except ValueError as exc:
        out.append(f"the attestation's lock is malformed: {str(exc)[:200]}")
    return out + _catalog_problems(predicate, expected)


def _float32_problems(predicate: VerificationPredicate, expected: Expected) -> list[str]:
    """The float32 pass the catalog expects: run, against the committed float32 bundle, judged by the committed entry."""
    if expected.float32_bundle_sha256 is None:
        return []
    f32 = predicate.float32
    if f32 is None:
        return [f"the attestation records no float32 pass, which {expected.sku} runs (against bundle "
                f"{expected.float32_bundle_sha256[:12]})"]
    out = []
    if f32.reference.sha256 != expected.float32_bundle_sha256:
        out.append(f"float32 bundle {f32.reference.sha256[:12] or 'none'} is not the committed float32 bundle of "
                   f"{expected.sku} ({expected.float32_bundle_sha256[:12]})")
    got = f32.tolerance.entry_sha256 if f32.tolerance is not None else None
    if f32.tolerance is not None and f32.tolerance.key != expected.float32_tolerance_key:
        out.append(f"float32 tolerance entry {f32.tolerance.key} is not {expected.sku}'s ({expected.float32_tolerance_key})")
    elif got != expected.float32_tolerance_sha256:
        out.append(f"float32 tolerance entry {str(got or 'none')[:12]} is not the committed entry "
                   f"({str(expected.float32_tolerance_sha256 or 'none')[:12]}) of {expected.float32_tolerance_key}")
    return out


def _catalog_problems(predicate: VerificationPredicate, expected: Expected) -> list[str]:
    """Where the predicate differs from what the catalog commits (nothing to compare without a catalog)."""
    out: list[str] = []
    if expected.bundle_sha256 is not None and predicate.reference.sha256 != expected.bundle_sha256:
        out.append(f"reference bundle {predicate.reference.sha256[:12] or 'none'} is not the committed bundle of "
                   f"{expected.sku} ({expected.bundle_sha256[:12]})")
    tol = predicate.tolerance
    if tol is not None and tol.entry_sha256 is not None and expected.tolerance_key is not None:
        if tol.key != expected.tolerance_key:
            out.append(f"tolerance entry {tol.key} is not {expected.sku}'s ({expected.tolerance_key})")
        elif tol.entry_sha256 != expected.tolerance_sha256:
            out.append(f"tolerance entry {tol.key} ({tol.entry_sha256[:12]}) is not the committed entry "
                       f"({str(expected.tolerance_sha256)[:12]}) of gates/data/tolerances.yaml")
    out += _float32_problems(predicate, expected)
    if expected.hard_bounds_sha256 is not None and predicate.hard_bounds_sha256 != expected.hard_bounds_sha256:
        out.append(f"hard bounds {str(predicate.hard_bounds_sha256 or 'not attested')[:12]} are not the committed hard "
                   f"bounds ({expected.hard_bounds_sha256[:12]}) of gates/data/tolerances.yaml")
    if expected.lock_sha256 is not None and predicate.lock_sha256 != expected.lock_sha256:
        out.append(f"gated with lock {predicate.lock_sha256[:12]}, the current lock of {expected.sku} is "
                   f"{expected.lock_sha256[:12]} (an attestation for an older lock)")
    return out


class PolicyResult(Frozen):
    """The policy's answer for one attestation."""

    ok: bool
    reasons: tuple[str, ...] = ()
    keyid: str | None = None
    predicate: VerificationPredicate | None = None

    def reason(self) -> str:
        return "; ".join(self.reasons)


def signed_statement(envelope: bytes, *, trusted: TrustedKeys, digest: str,
                     predicate_type: str = PREDICATE_TYPE) -> tuple[dict[str, Any], str]:
    """Steps 1 and 2 for any of our attestations: (statement, signing key id) of an envelope signed by a trusted key
    over an in-toto Statement v1 of `predicate_type` about `digest`; PublishError (EnvelopeError) naming what failed."""
    statement, keyid = open_envelope(envelope, trusted)
    if statement.get("_type") != STATEMENT_TYPE:
        raise EnvelopeError(f"the signed payload is not an in-toto Statement v1 (_type {statement.get('_type')!r})")
    if statement.get("predicateType") != predicate_type:
        raise EnvelopeError(f"the statement's predicateType is {statement.get('predicateType')!r}, not {predicate_type}")
    hexpart = digest.partition(":")[2]
    subjects = [s.get("digest", {}).get("sha256") for s in statement.get("subject") or () if isinstance(s, dict)
                and isinstance(s.get("digest"), dict)]
    if hexpart not in subjects:
        shown = ", ".join(f"sha256:{str(s)[:12]}" for s in subjects) or "none"
        raise EnvelopeError(f"the attestation's subject is {shown}, not {digest[:19]} (a signature over another image)")
    return statement, keyid


def signed_predicate(envelope: bytes, *, trusted: TrustedKeys, digest: str) -> tuple[VerificationPredicate, str]:
    """Steps 1 and 2: (predicate, signing key id) of an envelope signed by a trusted key over a statement
    about `digest`; PublishError (EnvelopeError) naming what failed otherwise."""
    statement, keyid = signed_statement(envelope, trusted=trusted, digest=digest)
    try:
        predicate = VerificationPredicate.model_validate(statement.get("predicate"))
    except ValidationError as exc:
        raise EnvelopeError(f"the attestation's predicate is malformed: {str(exc)[:300]}") from exc
    return predicate, keyid


def evaluate(envelope: bytes, *, trusted: TrustedKeys, digest: str, expected: Expected,
             image_id: str | None = None) -> PolicyResult:
    """The whole policy (see the module doc) for one envelope and the image digest it must vouch for."""
    try:
        predicate, keyid = signed_predicate(envelope, trusted=trusted, digest=digest)
    except PublishError as exc:
        return PolicyResult(ok=False, reasons=(str(exc),))
    reasons = predicate_problems(predicate, expected)
    if image_id is not None and predicate.image_id != image_id:
        reasons.append(f"the image's config is {image_id[:19]}, the gate ran {predicate.image_id[:19]}")
    return PolicyResult(ok=not reasons, reasons=tuple(reasons), keyid=keyid, predicate=predicate)


class SbomResult(Frozen):
    """The policy's answer for one SBOM attestation; `bom` is the verified CycloneDX document (not in `repr`)."""

    ok: bool
    reason: str = ""
    keyid: str | None = None
    summary: BomSummary | None = None
    bom: dict[str, Any] | None = Field(None, repr=False)


def evaluate_sbom(envelope: bytes, *, trusted: TrustedKeys, digest: str) -> SbomResult:
    """The SBOM attestation's policy: signed by a trusted key (step 1), an in-toto Statement v1 of predicateType
    https://cyclonedx.org/bom whose subject is `digest` (step 2), a valid CycloneDX 1.6 BOM (the library's schema
    validator) whose metadata component is that same digest. Its content is reported, not judged: the `pins` check
    (the verification attestation) is what says the image's files are exactly its lock."""
    try:
        statement, keyid = signed_statement(envelope, trusted=trusted, digest=digest, predicate_type=BOM_PREDICATE_TYPE)
        bom = statement.get("predicate")
        summary = bom_summary(bom)
    except PublishError as exc:
        return SbomResult(ok=False, reason=f"the SBOM attestation: {exc}")
    if summary.image != digest:
        return SbomResult(ok=False, keyid=keyid, reason=f"the SBOM describes {summary.image[:19] or 'no image'}, "
                                                        f"not {digest[:19]}")
    return SbomResult(ok=True, keyid=keyid, summary=summary, bom=bom if isinstance(bom, dict) else None)


def expectations(expect: ExpectFor, sku: str) -> Expected | str:
    """`expect(sku)`, or the reason it cannot be known (an unknown SKU, an unreadable lock)."""
    try:
        return expect(sku)
    except (SkupinError, OSError) as exc:
        return f"cannot read what this repository knows about {sku}: {exc}"

