"""Check the keyless (Sigstore) attestation CI publishes beside the key-signed one: `skupin verify REF --sigstore-bundle`.

images.yml's publish job signs the same verification predicate with `actions/attest`: a DSSE envelope over an in-toto
Statement v1 whose subject is the image digest, signed with a short-lived Fulcio certificate issued to the OIDC
identity of the workflow (`https://github.com/<owner>/<repo>/.github/workflows/images.yml@refs/heads/main`, issuer
`https://token.actions.githubusercontent.com`), the signature logged in Rekor, all of it in one Sigstore bundle.
`verify_keyless` accepts such a bundle only when, in this order:

1. the bundle file is a regular file of at most `MAX_BUNDLE_BYTES` (never read through a link, never blocking on a
   FIFO), one Sigstore bundle (JSON) or JSON lines of them (`gh attestation download` writes those);
2. sigstore-python's `Verifier` accepts it against a trust root: `trusted_root.json` given as a file (offline; never
   fetched), else the public-good instance's, fetched and checked over TUF (online only): the certificate chains to
   that root's Fulcio, its time is proven by the root's transparency log or timestamp authority, the DSSE signature
   verifies with the certificate's key;
3. the certificate's identity is exactly the one the operator names (`KeylessIdentity`: the subject alternative name
   and the OIDC issuer), never "any identity";
4. `statement_predicate`: the signed payload is an in-toto Statement v1 of predicate type
   `https://skupin.dev/verification/v1` whose subject digest is the digest REF resolves to (a separate, pure step);
5. the predicate then goes through the same checks the key-signed record does (`policy.predicate_problems`: SKU,
   gate decision, required checks, committed bundle, tolerance and lock when there is a catalog; the image config id;
   skupin/publishing/freshness.py's age, version and revocation rules, and the rollback rule for `verified`).

sigstore is an optional dependency (`pip install 'skupin[keyless]'`), imported only here and only when a bundle is
checked, so the key-based `skupin verify` stays fast without it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import Field, ValidationError

from skupin.clients.oci import RegistryClient, parse_image_ref
from skupin.common.errors import ImageRefError, NetworkError, NotFoundError, PublishError, SkupinError, UsageError
from skupin.common.model import Frozen
from skupin.common.paths import find_catalog, operator_trust
from skupin.common.untrusted import UntrustedInputError, json_depth, load_json, printable, read_regular_file
from skupin.publishing.attest import PREDICATE_TYPE, STATEMENT_TYPE, VerificationPredicate
from skupin.publishing.freshness import freshness_problems, load_policy, remember, rollback_problem
from skupin.publishing.policy import ExpectFor, expectations, expected_for, predicate_problems
from skupin.publishing.publish import VERIFIED_TAG
from skupin.publishing.verify import MAX_MANIFEST_BYTES, ClientFor, refusal, trust_anchors, trust_line

GITHUB_ISSUER = "https://token.actions.githubusercontent.com"
WORKFLOW = ".github/workflows/images.yml"  # the workflow whose publish job signs keylessly
WORKFLOW_REF = "refs/heads/main"
IN_TOTO_PAYLOAD = "application/vnd.in-toto+json"
MAX_BUNDLE_BYTES = 16 * 1024**2  # a bundle is ~10 KB plus its predicate (the lock: some hundred KB)
MAX_BUNDLES = 64  # bundles in one JSON-lines file
MAX_TRUSTED_ROOT_BYTES = 4 * 1024**2  # public-good's trusted_root.json is ~10 KB
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}")
INSTALL_FIX = "pip install 'skupin[keyless]' (the sigstore package)"


class KeylessIdentity(Frozen):
    """Who must have signed: the Fulcio certificate's subject alternative name, exactly, and its OIDC issuer; for a
    GitHub Actions identity also the repository and ref whose run it was (the SAN names the *workflow file*, which a
    reusable workflow's callers in other repositories would share)."""

    identity: str = Field(description="e.g. https://github.com/<owner>/<repo>/.github/workflows/images.yml@refs/heads/main")
    issuer: str = GITHUB_ISSUER
    source_repository: str = Field("", description="the certificate's OIDC source repository URI (Fulcio OID "
                                                   "1.3.6.1.4.1.57264.1.12) that must have run it; empty: not checked")
    source_ref: str = Field("", description="the certificate's OIDC source repository ref (OID ...1.14); empty: not "
                                            "checked")

    def line(self) -> str:
        run = f", run by {self.source_repository}@{self.source_ref}" if self.source_repository else ""
        return f"{self.identity} (issuer {self.issuer}{run})"


def workflow_identity(repository: str) -> KeylessIdentity:
    """The identity images.yml signs with on the main branch of `repository` (OWNER/REPO): `--keyless-identity`."""
    if not _REPO.fullmatch(repository) or repository.endswith((".", "/")) or ".." in repository:
        raise UsageError(f"--keyless-identity {printable(repository, 120)}: not a GitHub OWNER/REPO",
                         field="--keyless-identity", fix="--keyless-identity <owner>/<repo>, e.g. acme/skupin")
    return KeylessIdentity(identity=f"https://github.com/{repository}/{WORKFLOW}@{WORKFLOW_REF}",
                           source_repository=f"https://github.com/{repository}", source_ref=WORKFLOW_REF)


def identity_from(*, identity: str | None, issuer: str | None, repository: str | None) -> KeylessIdentity:
    """The identity an operator named: `--keyless-identity OWNER/REPO`, or `--certificate-identity` (with
    `--certificate-oidc-issuer`, default GitHub Actions'); UsageError when neither or both are given."""
    if repository and identity:
        raise UsageError("give --keyless-identity or --certificate-identity, not both", field="--keyless-identity")
    if repository:
        if issuer and issuer != GITHUB_ISSUER:
            raise UsageError(f"--keyless-identity is a GitHub Actions identity (issuer {GITHUB_ISSUER}); use "
                             "--certificate-identity for another issuer", field="--certificate-oidc-issuer")
        return workflow_identity(repository)
    if not identity:
        raise UsageError("--sigstore-bundle needs the identity that must have signed it (never any identity)",
                         field="--certificate-identity",
                         fix=f"--keyless-identity <owner>/<repo> (CI's {WORKFLOW} on {WORKFLOW_REF}), or "
                             "--certificate-identity URI [--certificate-oidc-issuer URL]")
    return KeylessIdentity(identity=identity, issuer=issuer or GITHUB_ISSUER)


def _read(path: Path, *, max_bytes: int, what: str, flag: str) -> bytes:
    """A file the operator named: regular, bounded, not a link; SkupinError (exit 1) naming it otherwise."""
    try:
        return read_regular_file(path, max_bytes=max_bytes)
    except (UntrustedInputError, OSError) as exc:
        raise SkupinError(f"{what} {exc}", file=str(path), field=flag,
                          fix=f"{flag} FILE naming a regular file (not a link) of at most {max_bytes // 1024} KiB") from exc


def read_bundles(path: Path) -> list[str]:
    """The Sigstore bundles (JSON texts) in `path`: one JSON object, or JSON lines of them; an object that wraps one
    under "bundle" (as GitHub's attestation API lists them) is unwrapped. SkupinError (exit 1) when the file cannot be
    read as `_read` allows; PublishError (exit 8) when it holds no bundle."""
    data = _read(path, max_bytes=MAX_BUNDLE_BYTES, what="the Sigstore bundle", flag="--sigstore-bundle")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PublishError(f"{path}: not a Sigstore bundle (not UTF-8 text)", file=str(path)) from exc
    try:
        documents = [load_json(data, source=str(path), max_bytes=MAX_BUNDLE_BYTES)]
    except UntrustedInputError:  # perhaps JSON lines
        lines = [line for line in text.splitlines() if line.strip()]
        if not 1 < len(lines) <= MAX_BUNDLES:
            raise PublishError(f"{path}: not a Sigstore bundle (neither one JSON object nor up to {MAX_BUNDLES} JSON "
                               "lines of them)", file=str(path)) from None
        try:
            documents = [load_json(line, source=f"{path} line {n}") for n, line in enumerate(lines, 1)]
        except UntrustedInputError as exc:
            raise PublishError(f"not a Sigstore bundle: {exc}", file=str(path)) from exc
    bundles = []
    for doc in documents:
        if isinstance(doc, dict) and "mediaType" not in doc and isinstance(doc.get("bundle"), dict):
            doc = doc["bundle"]
        if not isinstance(doc, dict):
            raise PublishError(f"{path}: not a Sigstore bundle (a JSON {type(doc).__name__})", file=str(path))
        bundles.append(json.dumps(doc))
    return bundles


class DsseVerifier(Protocol):
    """What checks a bundle: sigstore's `Verifier` (or several, `_AnyRoot`); tests pass a stub."""

    def verify_dsse(self, bundle: Any, policy: Any) -> tuple[str, bytes]: ...


class _AnyRoot:
    """Several trust roots in one file: a bundle verifies when one of them accepts it (the identity is still exact)."""

    def __init__(self, verifiers: Sequence[DsseVerifier]) -> None:
        self.verifiers = verifiers

    def verify_dsse(self, bundle: Any, policy: Any) -> tuple[str, bytes]:
        reasons = []
        for verifier in self.verifiers:
            try:
                return verifier.verify_dsse(bundle, policy)
            except Exception as exc:  # each root's refusal, reported together below
                reasons.append(str(exc))
        raise ValueError("; ".join(f"root {n}: {r}" for n, r in enumerate(reasons, 1)))


def sigstore_verifier(*, trusted_root: Path | None, offline: bool) -> tuple[DsseVerifier, str]:
    """(sigstore Verifier, the trust root it rests on, in words): `trusted_root` read offline, else the public-good
    instance's root fetched over TUF. UsageError without the sigstore package, with `offline` and no file, or with a
    file that is no trusted root; SkupinError (exit 1) when the file cannot be read; NetworkError when TUF fails."""
    try:
        from sigstore.errors import Error as SigstoreError
        from sigstore.models import TrustedRoot
        from sigstore.verify import Verifier
        from sigstore_models.trustroot import v1 as trustroot_v1
    except ImportError as exc:
        raise UsageError(f"--sigstore-bundle needs the sigstore package, which is not installed: {exc}",
                         fix=INSTALL_FIX) from exc
    if trusted_root is not None:
        data = _read(trusted_root, max_bytes=MAX_TRUSTED_ROOT_BYTES, what="the trusted root", flag="--trusted-root")
        # one trusted root, or JSON lines of them (`gh attestation trusted-root`: public-good's and GitHub's)
        try:
            if json_depth(data) > 64:
                raise ValueError("JSON nested too deeply")
            try:
                texts = [data] if isinstance(load_json(data, source=str(trusted_root)), dict) else []
            except UntrustedInputError:
                texts = [line for line in data.splitlines() if line.strip()]
            if not 0 < len(texts) <= 8:
                raise ValueError("neither one trusted root nor JSON lines of up to 8")
            verifiers = [Verifier(trusted_root=TrustedRoot(trustroot_v1.TrustedRoot.from_json(text))) for text in texts]
        except (SigstoreError, ValueError, TypeError, KeyError) as exc:
            raise UsageError(f"{trusted_root}: not a Sigstore trusted_root.json: {printable(str(exc), 300)}",
                             file=str(trusted_root), field="--trusted-root",
                             fix="a trusted_root.json fetched over TUF (docs/guide-operator.md, 'Keyless (Sigstore) "
                                 "verification')") from exc
        words = (f"Sigstore trusted root{'s' if len(verifiers) > 1 else ''} {trusted_root} "
                 f"(sha256 {hashlib.sha256(data).hexdigest()[:12]}, offline)")
        return (verifiers[0] if len(verifiers) == 1 else _AnyRoot(verifiers)), words
    if offline:
        raise UsageError("--offline: no Sigstore trust root to check the bundle against (the public-good one is "
                         "fetched over TUF, online)", field="--trusted-root",
                         fix="--trusted-root FILE, a trusted_root.json fetched over TUF on a connected machine "
                             "(docs/guide-operator.md, 'Keyless (Sigstore) verification')")
    try:
        return Verifier.production(), "Sigstore public-good trust root (TUF, tuf-repo-cdn.sigstore.dev)"
    except (SigstoreError, OSError, ValueError) as exc:
        raise NetworkError(f"cannot fetch Sigstore's public-good trust root over TUF: {printable(str(exc), 300)}",
                           fix="--trusted-root FILE (a trusted_root.json fetched over TUF where the network is), "
                               "with --offline") from exc


def verified_statement(bundle_json: str, *, verifier: DsseVerifier, identity: KeylessIdentity) -> dict[str, Any]:
    """Steps 2 and 3: the in-toto statement a bundle signs, once sigstore verified it against the verifier's trust root
    and `identity`; PublishError naming what failed otherwise."""
    from sigstore.models import Bundle
    from sigstore.verify.policy import AllOf, Identity, OIDCSourceRepositoryRef, OIDCSourceRepositoryURI

    policy: Any = Identity(identity=identity.identity, issuer=identity.issuer)
    if identity.source_repository:
        policy = AllOf([policy, OIDCSourceRepositoryURI(identity.source_repository),
                        *([OIDCSourceRepositoryRef(identity.source_ref)] if identity.source_ref else [])])
    try:
        bundle = Bundle.from_json(bundle_json)
        payload_type, payload = verifier.verify_dsse(bundle, policy)
    except Exception as exc:  # hostile input reaches sigstore's parsers and checks: whatever they raise is a refusal
        raise PublishError(f"the Sigstore bundle does not verify: {printable(' '.join(str(exc).split()), 400)} "
                           f"(required signer: {identity.line()})") from exc
    if payload_type != IN_TOTO_PAYLOAD:
        raise PublishError(f"the Sigstore bundle signs a {printable(payload_type, 80)!r} payload, not an in-toto "
                           "statement")
    try:
        statement = load_json(payload, source="the Sigstore bundle's payload", max_bytes=MAX_BUNDLE_BYTES)
    except UntrustedInputError as exc:
        raise PublishError(str(exc)) from exc
    if not isinstance(statement, dict):
        raise PublishError("the Sigstore bundle's payload is not a JSON object")
    return statement


def statement_predicate(statement: dict[str, Any], *, digest: str, predicate_type: str = PREDICATE_TYPE) -> Any:
    """Step 4, pure: the predicate of a verified in-toto Statement v1 of `predicate_type` whose subject digest is
    `digest` (sha256:<hex>); PublishError naming what differs (a real statement about another artifact is refused)."""
    if statement.get("_type") != STATEMENT_TYPE:
        raise PublishError(f"the signed payload is not an in-toto Statement v1 (_type "
                           f"{printable(str(statement.get('_type')), 80)!r})")
    if statement.get("predicateType") != predicate_type:
        raise PublishError(f"the statement's predicateType is {printable(str(statement.get('predicateType')), 120)!r}, "
                           f"not {predicate_type}")
    algorithm, _, hexpart = digest.partition(":")
    listed = statement.get("subject")
    if not isinstance(listed, list):
        raise PublishError("the statement's subject is not a list of artifacts (an in-toto Statement v1 has one)")
    subjects = [s["digest"].get("sha256") for s in listed if isinstance(s, dict) and isinstance(s.get("digest"), dict)]
    if algorithm != "sha256" or not hexpart or hexpart not in subjects:
        shown = ", ".join(f"sha256:{printable(str(s), 12)}" for s in subjects) or "none"
        raise PublishError(f"the keyless attestation's subject is {shown}, not {digest[:19]} (a signature over "
                           "another image)")
    return statement.get("predicate")


class KeylessVerification(Frozen):
    """The answer of `skupin verify REF --sigstore-bundle FILE` (the keyless counterpart of verify.Verification)."""

    ok: bool
    ref: str
    keyless: bool = True
    reference: str | None = None
    digest: str | None = None
    sku: str | None = None
    lock_sha256: str | None = None
    gate_date: str | None = None
    identity: str = Field(description="The certificate identity (subject alternative name) that had to sign")
    issuer: str = Field(description="The OIDC issuer the certificate had to name")
    trusted_root: str = Field("", description="The Sigstore trust root the bundle was checked against, in words")
    reason: str = ""
    catalog: str | None = None
    unreachable: bool = False
    absent: bool = False
    trust: tuple[str, ...] = ()

    def error(self) -> SkupinError:
        return refusal(self.line(), absent=self.absent, unreachable=self.unreachable)

    def trust_line(self) -> str:
        return trust_line(self.trust)

    def line(self) -> str:
        if self.ok:
            against = "" if self.catalog else "; no catalog: not compared with a current lock, bundle or tolerance"
            return (f"verified (keyless): {self.ref} -> {self.reference} ({self.sku}, lock {str(self.lock_sha256)[:12]}, "
                    f"gate passed {self.gate_date or 'at an unknown date'}, signed by {self.identity} via Sigstore"
                    f"{against})")
        return f"NOT verified (keyless): {self.ref}: {printable(self.reason, 600)}"


def _resolve(client: RegistryClient, ref: str) -> tuple[str, str, str | None, bool]:
    """(digest, pinned reference, image config digest, through the moving `verified` tag) of `ref`; the registry's
    NotFoundError/NetworkError propagate, PublishError when it serves another digest or a manifest that is no object."""
    name = parse_image_ref(ref)
    digest = client.resolve(name.repository, name.digest or name.tag or VERIFIED_TAG)
    if name.digest and digest != name.digest:
        raise PublishError(f"the registry serves {digest} for {name.digest}")
    image = client.get_manifest(name.repository, digest)
    try:
        body = image.json() if len(image.body) <= MAX_MANIFEST_BYTES and json_depth(image.body) <= 16 else None
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        raise PublishError(f"the registry's manifest for {digest} is not a JSON object")
    block = body.get("config")
    config = block.get("digest") if isinstance(block, dict) and isinstance(block.get("digest"), str) else None
    return digest, f"{name.registry}/{name.repository}@{digest}", config, name.tag == VERIFIED_TAG and not name.digest


def predicate_reasons(raw: Any, *, digest: str, expected_sku: ExpectFor, sku: str, image_id: str | None,
                      moving: str | None) -> tuple[VerificationPredicate | None, list[str]]:
    """Step 5: (the predicate, every reason the policy refuses it); the same checks the key-signed record gets."""
    try:
        predicate = VerificationPredicate.model_validate(raw)
    except ValidationError as exc:
        return None, [f"the keyless attestation's predicate is malformed: {str(exc)[:300]}"]
    expected = expectations(expected_sku, sku)
    if isinstance(expected, str):
        return predicate, [expected]
    reasons = predicate_problems(predicate, expected)
    if image_id is not None and predicate.image_id != image_id:
        reasons.append(f"the image's config is {image_id[:19]}, the gate ran {predicate.image_id[:19]}")
    if not reasons:
        try:
            reasons = freshness_problems(predicate, digest=digest, keyid=None, policy=load_policy(find_catalog()))
        except PublishError as exc:
            reasons = [str(exc)]
        if moving and not reasons and (rolled := rollback_problem(predicate, repository=moving, digest=digest)):
            reasons.append(rolled)
    return predicate, reasons


def verify_keyless(*, ref: str, bundle: Path, identity: KeylessIdentity, trusted_root: Path | None = None,
                   offline: bool = False, sku: str | None = None, expect: ExpectFor = expected_for,
                   client_for: ClientFor | None = None, verifier: DsseVerifier | None = None) -> KeylessVerification:
    """Steps 1-5 of the module doc for `ref`. Raised, not answered: ImageRefError (2) for a bad REF, SkupinError (1)
    for an unreadable bundle or trust root file, UsageError (2) for no trust root offline or without sigstore,
    NetworkError (9) when the public-good root cannot be fetched. A refusal by the registry (9, 15) or by the policy
    (8) is the answer's `error()`. `verifier`: one already built (tests)."""
    name = parse_image_ref(ref)
    if not name.tag and not name.digest:
        raise ImageRefError(f"{ref}: give a tag or a digest", field="image reference",
                            fix=f"{ref}:verified, or {ref}@sha256:<digest>")
    bundles = read_bundles(bundle)
    rests_on = "a Sigstore verifier given by the caller"
    if verifier is None:
        verifier, rests_on = sigstore_verifier(trusted_root=trusted_root, offline=offline)
    asked = sku or name.repository.rsplit("/", 1)[-1]
    with operator_trust():
        catalog = find_catalog()
        base: dict[str, Any] = dict(ref=ref, identity=identity.identity, issuer=identity.issuer, trusted_root=rests_on,
                                    catalog=str(catalog) if catalog else None,
                                    trust=(f"keyless signer {identity.line()}", rests_on,
                                           *trust_anchors(None, str(catalog) if catalog else None)))
        client = (client_for or RegistryClient)(name.registry)
        try:
            digest, pinned, config, through_tag = _resolve(client, ref)
        except NotFoundError as exc:
            return KeylessVerification(ok=False, reason=f"cannot resolve it: {exc}", absent=True, **base)
        except NetworkError as exc:
            return KeylessVerification(ok=False, reason=f"cannot resolve it: {exc}", unreachable=True, **base)
        except PublishError as exc:
            return KeylessVerification(ok=False, reason=str(exc), **base)
        finally:
            client.close()
        base.update(digest=digest, reference=pinned)
        moving = f"{name.registry}/{name.repository}" if through_tag else None
        refusals: list[str] = []
        for text in bundles:
            try:
                statement = verified_statement(text, verifier=verifier, identity=identity)
                raw = statement_predicate(statement, digest=digest)
            except PublishError as exc:
                refusals.append(str(exc))
                continue
            predicate, reasons = predicate_reasons(raw, digest=digest, expected_sku=expect, sku=asked, image_id=config,
                                                   moving=moving)
            if predicate is not None:
                base.update(sku=predicate.sku, lock_sha256=predicate.lock_sha256, gate_date=predicate.gate_created)
            if reasons:
                refusals.append("; ".join(reasons))
                continue
            if moving and predicate is not None:
                remember(predicate, repository=moving, digest=digest)
            return KeylessVerification(ok=True, **base)
        shown = refusals[0] if len(refusals) == 1 else " | ".join(f"bundle {n}: {r}" for n, r in enumerate(refusals, 1))
        return KeylessVerification(ok=False, reason=shown, **base)
