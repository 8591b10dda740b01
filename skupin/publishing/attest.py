"""The signed verification attestation: an in-toto Statement v1 in a DSSE envelope, signed with ECDSA P-256.

    envelope  {"payloadType": "application/vnd.in-toto+json", "payload": base64(statement),
               "signatures": [{"keyid": "" (as cosign writes it), "sig": base64(DER ECDSA),
                               "publicKey": base64(DER SubjectPublicKeyInfo): the claimed signer, never trusted}]}
    statement {"_type": "https://in-toto.io/Statement/v1",
               "subject": [{"name": <repository>, "digest": {"sha256": <image manifest digest hex>}}],
               "predicateType": "https://skupin.dev/verification/v1", "predicate": VerificationPredicate}

The SBOM attestation (`bom_statement`) is the same statement with predicateType
`https://cyclonedx.org/bom` (cosign's CycloneDX type) and the CycloneDX JSON BOM of skupin/publishing/sbom.py
as its predicate, signed the same way by the same key.

The signature is over the DSSE pre-authentication encoding, exactly as the DSSE v1 spec says:
`"DSSEv1" SP len(type) SP type SP len(body) SP body` (lengths in ASCII decimal), hashed with SHA-256
(what cosign does for an ECDSA P-256 key, so `cosign verify-attestation --key` can check it).

Keys: PEM files. A private key is PKCS#8 (`signing.key`, mode 0600, never in the repository: the
default place is `.skupin/keys/`, git-ignored); its public key is SubjectPublicKeyInfo PEM
(`signing.pub`). Trusted public keys are `keys/trusted/*.pub` (committed) plus this machine's
`.skupin/keys/trusted/*.pub` (a key `skupin keys generate` or `skupin run` made here), or exactly the
files given with `--key`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import Field

from skupin.common.errors import PublishError
from skupin.common.model import Frozen, canonical_json
from skupin.common.paths import ensure_state, find_catalog, state_dir, trust_problem
from skupin.common.revision import SourcePin
from skupin.common.untrusted import UntrustedInputError, json_depth, read_regular_file

if TYPE_CHECKING:
    from collections.abc import Callable

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://skupin.dev/verification/v1"
BOM_PREDICATE_TYPE = "https://cyclonedx.org/bom"  # cosign's predicate type for `--type cyclonedx`
PAYLOAD_TYPE = "application/vnd.in-toto+json"
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
MAX_ENVELOPE_BYTES = 4 * 1024**2
MAX_KEY_BYTES = 64 * 1024  # a PEM key is a few hundred bytes


def trusted_dirs() -> list[Path]:
    """Where trusted public keys live: the catalog's keys/trusted/ (in git, when there is a catalog), then this
    machine's STATE/keys/trusted/ (git-ignored)."""
    catalog = find_catalog()
    return [*([catalog / "keys" / "trusted"] if catalog is not None else []), local_keys_dir() / "trusted"]


def local_keys_dir() -> Path:
    """Where this machine keeps its signing key and the public keys it trusts locally (git-ignored)."""
    return state_dir() / "keys"


# ---------------------------------------------------------------- the predicate and the statement


class CheckOutcome(Frozen):
    name: str
    status: str
    reason: str = ""


class ReferencePin(Frozen):
    """The reference bundle the gate compared with."""

    sha256: str = Field(description="sha256 of the bundle's SHA256SUMS (gates/refdata/bundle.py bundle_sha256)")
    path: str = ""


class TolerancePin(Frozen):
    """The tolerance entry the gate applied: its key, its content hash and where it came from."""

    key: str
    source: str = ""
    entry_sha256: str | None = Field(description="sha256 of the entry's canonical JSON; None: the gate had no entry")
    provenance: dict[str, Any] | None = None


class Float32Pin(Frozen):
    """The float32 pass of a SKU that serves another dtype: the float32 bundle and the float32 entry it was judged by."""

    reference: ReferencePin
    tolerance: TolerancePin | None


def hard_bounds_sha256(bounds: dict[str, Any]) -> str:
    """The hard bounds' identity: sha256 of their canonical JSON (gates/data/tolerances.yaml `hard_bounds`)."""
    return hashlib.sha256(canonical_json(bounds)).hexdigest()


class BuildPin(Frozen):
    """How the image's bytes were made, so anyone can make them again (docs/REPRODUCIBLE.md)."""

    layers: str = Field(description="The rewrite that made the image id reproducible (builder/reproducible.py "
                                    "LAYER_FORMAT)")
    push: str = Field(description="How its layers were compressed for the registry (publishing/imagepush.py)")
    builder: str | None = Field(None, description="The engine whose BuildKit built it (`docker <version>`), when the "
                                                  "build record says")


class VerificationPredicate(Frozen):
    """What the gate established about the image (the statement's predicate)."""

    sku: str
    repository: str
    image_id: str = Field(description="The image (config) id the gate ran")
    lock_sha256: str
    lock: dict[str, Any]
    reference: ReferencePin
    tolerance: TolerancePin | None
    decision: str
    reason: str
    checks: tuple[CheckOutcome, ...]
    verdict_sha256: str = Field(description="sha256 of the gate verdict's canonical JSON")
    gate_created: str | None
    gate_tool_version: str | None
    tool_version: str = Field(description="skupin version that published")
    published: str
    source: SourcePin | None = Field(None, description="The catalog's git repository and commit the publish ran "
                                     "from (OCI's image.source and image.revision, signed); absent outside git")
    float32: Float32Pin | None = Field(None, description="The float32 pass's bundle and entry; absent when the gate ran "
                                       "none (the SKU serves float32, or its engine has no float32 path)")
    hard_bounds_sha256: str | None = Field(None, description="sha256 of the hard bounds the gate applied; absent only "
                                           "in records made before they were attested (refused by the policy)")
    build: BuildPin | None = Field(None, description="How the image was built and pushed; absent in records made "
                                                     "before images were reproducible, and for an image no build "
                                                     "record of this host names")


def tolerance_sha256(entry: dict[str, Any]) -> str:
    """A tolerance entry's identity: sha256 of its canonical JSON (the entry as the gate's verdict records it)."""
    return hashlib.sha256(canonical_json(entry)).hexdigest()


def statement(*, repository: str, digest: str, predicate: VerificationPredicate) -> dict[str, Any]:
    absent = {name for name in ("source", "float32", "hard_bounds_sha256", "build") if getattr(predicate, name) is None}
    data = predicate.model_dump(mode="json", exclude=absent or None)  # an older record's shape is kept
    return _statement(repository=repository, digest=digest, predicate_type=PREDICATE_TYPE, predicate=data)


def bom_statement(*, repository: str, digest: str, bom: dict[str, Any]) -> dict[str, Any]:
    """The SBOM attestation's statement: predicateType https://cyclonedx.org/bom, predicate = the CycloneDX JSON BOM
    (what `cosign attest --type cyclonedx` writes)."""
    return _statement(repository=repository, digest=digest, predicate_type=BOM_PREDICATE_TYPE, predicate=bom)


def _statement(*, repository: str, digest: str, predicate_type: str, predicate: dict[str, Any]) -> dict[str, Any]:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64:
        raise PublishError(f"not a sha256 digest: {digest!r}")
    return {"_type": STATEMENT_TYPE, "subject": [{"name": repository, "digest": {"sha256": hexpart}}],
            "predicateType": predicate_type, "predicate": predicate}


# ---------------------------------------------------------------- DSSE


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


CLAIMED_KEY = "publicKey"  # a signature's claimed signing key: base64 DER SubjectPublicKeyInfo (see Signer.sign_statement)


def keyid_of(public_key: ec.EllipticCurvePublicKey) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


class Signer:
    """A private ECDSA P-256 key and its key id."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, *, path: Path | None = None) -> None:
        self.key, self.path = key, path
        self.keyid = keyid_of(key.public_key())

    def sign_statement(self, data: dict[str, Any]) -> bytes:
        """The DSSE envelope (JSON bytes) of a statement."""
        payload = canonical_json(data)
        sig = self.key.sign(pae(PAYLOAD_TYPE, payload), ec.ECDSA(hashes.SHA256()))
        # keyid "" as `cosign attest` writes it: cosign's verifier skips a signature whose keyid differs from the one it
        # derives (an SSH-style fingerprint); open_envelope then tries every trusted key. The public key rides beside
        # the signature (CLAIMED_KEY, unauthenticated, ignored by DSSE verifiers that do not know it): never trusted for
        # what it is, it only lets a refusal say which key signed ("a key this catalog does not trust: <keyid>") apart
        # from a signature that the key claiming it does not verify ("tampered or re-signed")
        envelope = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
                    "signatures": [{"keyid": "", "sig": base64.b64encode(sig).decode(),
                                    CLAIMED_KEY: base64.b64encode(self.public_der()).decode()}]}
        return canonical_json(envelope)

    def public_der(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.DER,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo)

    def public_pem(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo)


def _key_bytes(path: Path, *, named: bool) -> bytes:
    """A key file's bytes, bounded and never blocking (a FIFO, a device or a folder is refused). A key found in a trusted
    folder is not followed through a link; one the operator named (`--key`, `--signing-key`) may be a link they chose."""
    try:
        return read_regular_file(Path(path).resolve() if named else path, max_bytes=MAX_KEY_BYTES)
    except (UntrustedInputError, OSError) as exc:
        raise PublishError(f"{path}: not a key file: {exc}") from exc


def load_signer(path: Path) -> Signer:
    """The private key at `path` (PEM, PKCS#8, unencrypted, ECDSA P-256)."""
    try:
        key = serialization.load_pem_private_key(_key_bytes(path, named=True), password=None)
    except (ValueError, TypeError) as exc:
        raise PublishError(f"{path}: not a readable unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise PublishError(f"{path}: the signing key must be ECDSA P-256 (make one with `skupin keys generate`)")
    return Signer(key, path=Path(path))


def load_public_key(path: Path, *, named: bool = True) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(_key_bytes(path, named=named))
    except ValueError as exc:
        raise PublishError(f"{path}: not a readable PEM public key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise PublishError(f"{path}: a trusted key must be an ECDSA P-256 public key")
    return key


class TrustedKeys:
    """Public keys by key id, with the file each came from."""

    def __init__(self, keys: dict[str, tuple[ec.EllipticCurvePublicKey, str]]) -> None:
        self.keys = keys

    def __contains__(self, keyid: object) -> bool:
        return keyid in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def describe(self) -> str:
        return ", ".join(f"{k[:12]} ({src})" for k, (_, src) in sorted(self.keys.items())) or "none"

    def anchors(self) -> tuple[str, ...]:
        """One line per trusted key: its id and the file it came from."""
        return tuple(f"key {k[:12]} ({src})" for k, (_, src) in sorted(self.keys.items()))


MAX_TRUSTED_KEYS = 256


def trusted_keys(files: list[Path] | tuple[Path, ...] | None = None) -> TrustedKeys:
    """`files` when given (`--key`), else the *.pub files of `trusted_dirs()`: regular files, never followed through a
    link, only from folders and files that this user or root owns and no one else can write (PublishError naming the
    file otherwise: a planted key is refused, not skipped), for verify and publish alike."""
    named = bool(files)
    if files:
        paths = [Path(f) for f in files]
    else:
        paths = []
        for folder in trusted_dirs():
            if (why := trust_problem(folder.parent) or trust_problem(folder)) is not None:
                raise PublishError(f"{why}: its keys cannot be trusted; fix: make it yours and not writable by others, "
                                   "or name the keys with --key FILE")
            if folder.is_dir() and not folder.is_symlink():
                paths += sorted(folder.glob("*.pub"))
    if len(paths) > MAX_TRUSTED_KEYS:
        raise PublishError(f"{len(paths)} trusted key files, more than {MAX_TRUSTED_KEYS}")
    found: dict[str, tuple[ec.EllipticCurvePublicKey, str]] = {}
    for path in paths:
        if not named and (why := trust_problem(path)) is not None:
            raise PublishError(f"{why}: a trusted key must be yours and writable by no one else")
        key = load_public_key(path, named=named)
        found[keyid_of(key)] = (key, str(path))
    return TrustedKeys(found)


MAX_ENVELOPE_DEPTH = 16
MAX_SIGNATURES = 16


class EnvelopeError(PublishError):
    """An envelope that does not verify (the reason says why)."""


def _parse_envelope(data: bytes) -> tuple[bytes, list[dict[str, Any]]]:
    """(payload bytes, signatures) of a DSSE envelope of our payload type; EnvelopeError otherwise."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"the attestation is too large ({len(data)} bytes, at most {MAX_ENVELOPE_BYTES})")
    try:
        if json_depth(data) > MAX_ENVELOPE_DEPTH:
            raise EnvelopeError(f"the attestation is nested deeper than {MAX_ENVELOPE_DEPTH}")
        env = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise EnvelopeError("the attestation is not a DSSE envelope (not JSON)") from exc
    if not isinstance(env, dict) or not isinstance(env.get("payload"), str):
        raise EnvelopeError("the attestation is not a DSSE envelope (no payload)")
    if env.get("payloadType") != PAYLOAD_TYPE:
        raise EnvelopeError(f"the envelope's payloadType is {env.get('payloadType')!r}, not {PAYLOAD_TYPE}")
    try:
        payload = base64.b64decode(env["payload"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EnvelopeError("the envelope's payload is not base64") from exc
    listed = env.get("signatures")
    if not isinstance(listed, list):
        raise EnvelopeError("the attestation is unsigned (the envelope's signatures are not a list)")
    sigs = [s for s in listed[:MAX_SIGNATURES] if isinstance(s, dict) and isinstance(s.get("sig"), str) and s["sig"]
            and isinstance(s.get("keyid", ""), str)]
    if not sigs:
        raise EnvelopeError("the attestation is unsigned (the envelope has no signature)")
    return payload, sigs


def _verifies(key: ec.EllipticCurvePublicKey, sig: str, message: bytes) -> bool:
    try:
        key.verify(base64.b64decode(sig), message, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def _claimed_key(sig: dict[str, Any]) -> tuple[str, ec.EllipticCurvePublicKey] | None:
    """(key id, key) of the public key a signature says made it (CLAIMED_KEY), or None: none, or not a P-256 key."""
    text = sig.get(CLAIMED_KEY)
    if not isinstance(text, str) or len(text) > 1024:
        return None
    try:
        key = serialization.load_der_public_key(base64.b64decode(text, validate=True))
    except (ValueError, TypeError, binascii.Error):
        return None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        return None
    return keyid_of(key), key


def _why_not(sigs: list[dict[str, Any]], message: bytes, trusted: TrustedKeys) -> EnvelopeError:
    """Why no signature verified with a trusted key: a key this catalog does not trust made it (its claimed key
    verifies it), or it does not verify with the key that claims it (tampered or re-signed), or it names no key."""
    foreign: list[str] = []
    broken: list[str] = []
    named: list[str] = []
    for sig in sigs:
        keyid, claimed = str(sig.get("keyid") or ""), _claimed_key(sig)
        if claimed is not None and claimed[0] not in trusted and _verifies(claimed[1], sig["sig"], message):
            foreign.append(claimed[0])
        elif claimed is not None or keyid in trusted:
            broken.append((claimed[0] if claimed is not None else keyid)[:12])
        elif keyid:
            named.append(keyid[:12])
    fix = "; fix: trust that key (keys/trusted/<name>.pub, or --key FILE) only if you trust whoever holds it"
    if foreign:
        return EnvelopeError(f"the attestation is signed by a key this catalog does not trust: {', '.join(foreign)} "
                             f"(trusted: {trusted.describe()}){fix}")
    if broken:
        return EnvelopeError(f"the attestation's signature does not verify with the key that claims it "
                             f"({', '.join(broken)}): tampered or re-signed")
    if named:
        return EnvelopeError(f"the attestation names a signing key this catalog does not trust: {', '.join(named)} "
                             f"(trusted: {trusted.describe()}){fix}")
    return EnvelopeError("the attestation's signature does not verify with any trusted key and names no key: signed by "
                         f"a key this catalog does not trust, or tampered (trusted: {trusted.describe()})")


def open_envelope(data: bytes, trusted: TrustedKeys) -> tuple[dict[str, Any], str]:
    """(the statement, the key id that signed it) of a DSSE envelope; EnvelopeError when it is not one,
    is unsigned, is signed by no trusted key or its signature does not verify (`_why_not` says which)."""
    payload, sigs = _parse_envelope(data)
    message = pae(PAYLOAD_TYPE, payload)
    for sig in sigs:
        keyid = sig.get("keyid")
        candidates = [str(keyid)] if keyid in trusted else ([] if keyid else list(trusted.keys))
        signed_by = next((k for k in candidates if _verifies(trusted.keys[k][0], sig["sig"], message)), None)
        if signed_by is None:
            continue
        try:
            stmt = json.loads(payload)
        except ValueError as exc:
            raise EnvelopeError("the signed payload is not JSON") from exc
        if not isinstance(stmt, dict):
            raise EnvelopeError("the signed payload is not an in-toto statement")
        return stmt, signed_by
    raise _why_not(sigs, message, trusted)


# ---------------------------------------------------------------- key files


class KeyPair(Frozen):
    private: str
    public: str
    keyid: str
    trusted_copy: str | None = None


def _inside_repository_unignored(path: Path) -> bool:
    """True when `path` is inside the catalog but not under the git-ignored .skupin/ state folder."""
    resolved = path.resolve()
    catalog = find_catalog()
    if catalog is None or not resolved.is_relative_to(catalog.resolve()):
        return False
    return not resolved.is_relative_to((catalog / ".skupin").resolve()) and not resolved.is_relative_to(state_dir().resolve())


def generate_keys(*, out: Path | None = None, trust_locally: bool | None = None) -> KeyPair:
    """Write a new ECDSA P-256 key pair: `<out>/signing.key` (0600) and `<out>/signing.pub`.

    Default `out`: .skupin/keys/ (git-ignored); then the public key is also trusted on this machine
    (.skupin/keys/trusted/local-<keyid12>.pub). An existing private key is never overwritten; a
    folder inside the repository other than .skupin/ is refused (private keys never go in git).
    """
    if out is None:
        ensure_state()  # the default folder ignores itself for git before a private key lands in it
    folder = Path(out) if out else local_keys_dir()
    if _inside_repository_unignored(folder):
        raise PublishError(f"{folder}: refusing to write a private key inside the repository; "
                           "fix: choose a folder outside it (or the default .skupin/keys/)")
    private, public = folder / "signing.key", folder / "signing.pub"
    if private.exists():
        raise PublishError(f"{private} exists; refusing to overwrite a signing key (move it away first)")
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    signer = Signer(key, path=private)
    public.write_bytes(signer.public_pem())
    copy = None
    if trust_locally if trust_locally is not None else out is None:
        trusted = local_keys_dir() / "trusted"
        trusted.mkdir(parents=True, exist_ok=True)
        copy = trusted / f"local-{signer.keyid[:12]}.pub"
        copy.write_bytes(signer.public_pem())
    return KeyPair(private=str(private), public=str(public), keyid=signer.keyid,
                   trusted_copy=str(copy) if copy else None)


SIGNING_KEY_ENV = "SKUPIN_SIGNING_KEY"


def find_signer(path: Path | None = None, *, create: bool = False, on_event: Callable[[str], None] | None = None) -> Signer:
    """The signing key: `path` (--signing-key), else $SKUPIN_SIGNING_KEY, else .skupin/keys/signing.key.

    None of them: with `create` (what `skupin run` does on a fresh machine) a local key is generated
    and trusted on this machine, and that is said through `on_event`; without it, a PublishError
    saying how to make one.
    """
    given = path or (Path(os.environ[SIGNING_KEY_ENV]) if os.environ.get(SIGNING_KEY_ENV) else None)
    if given is not None:
        if not Path(given).is_file():
            raise PublishError(f"signing key {given} does not exist; fix: `skupin keys generate --out DIR` "
                               "and pass DIR/signing.key")
        return load_signer(Path(given))
    default = local_keys_dir() / "signing.key"
    if default.is_file():
        return load_signer(default)
    if not create:
        raise PublishError("no signing key: pass --signing-key FILE or set $SKUPIN_SIGNING_KEY; "
                           "fix: `skupin keys generate` (writes .skupin/keys/signing.key and trusts it on this machine)")
    pair = generate_keys()
    if on_event is not None:
        on_event(f"generated a local signing key {pair.private} (key id {pair.keyid[:12]}) and trusted it on this "
                 f"machine ({pair.trusted_copy}); to let others verify, commit {pair.public} as keys/trusted/<name>.pub")
    return load_signer(Path(pair.private))
