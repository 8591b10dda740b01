"""Publish a gated image: refuse unless its verdict passed for this image and lock, push by digest, attest, tag.

`publish(built, verdict, target)` is the publish stage: the image `build` made, with the verdict
`gate` returned (parsed once into `VerdictFacts`). `plan_publish` is pure and decides whether to
publish at all; `publish_image` executes the plan. `publish_sku` is the same for an image and a
verdict file found on this host (`skupin publish`). The flow:

1. refuse (PublishError) unless the verdict passed, names this exact image id, this SKU and the
   SKU's current lock hash, its pins and model checks passed, and the predicate it would sign passes
   the policy's content checks (skupin/publishing/policy.py: committed reference bundle and tolerance entry);
   refuse unless the signing key is a trusted key (else nobody could verify what it signs); refuse a
   verdict without the envelope its gate run signed (`verdict.dsse.json` beside `verdict.json`, a trusted
   key, a payload that is exactly this verdict: `check_verdict_envelope`), and an image whose labels do
   not name this lock and the current render's Dockerfile (or that has no skupin labels at all);
2. check the registry answers (a clear error naming `skupin registry up` otherwise); hold a lock file
   per registry and repository (.skupin/locks/) so publishes from this host serialize; refuse when the
   version tag already names another image that a publish attested (version tags are immutable); a
   version tag whose digest carries no attestation a trusted key signed for this SKU and lock is
   squatted (anyone may push one under the computable next tag): it is replaced, and that is said;
3. read what the SBOM will list from the image's layers on the engine (skupin/publishing/sbom.py: every Python
   distribution and Debian package; the gate's layer-index cache makes this a re-merge, not a re-read);
   refuse when it does not list every package the lock names (`sbom_problems`: 0 distributions for a
   lock of packages is not that lock's image);
   then tag the image with a temporary unique tag (`skupin-push-<random>`), push it through the
   engine (every stream chunk is checked for errors) and take the digest the registry stored;
   the local temporary tag is removed whatever happens;
4. read the pushed manifest back by digest and check that its config digest is the gated image id,
   and that the version tag, if it exists, names exactly this digest;
5. sign an in-toto Statement v1 about the digest (DSSE, ECDSA P-256: skupin/publishing/attest.py), run the
   whole policy on the signed envelope (`evaluate`, exactly what `verify` runs); make the CycloneDX
   SBOM of the digest and sign it as a second statement (predicateType https://cyclonedx.org/bom,
   checked with `evaluate_sbom`); store both the way cosign stores attestations (tag
   `sha256-<hex>.att`, one `application/vnd.dsse.envelope.v1+json` layer each, in one manifest put,
   OCI 1.1 `subject` = the image where the registry accepts it) and read them back;
6. only then move the human tags `<engine-version>-<hash12>` (over the lock and the locked Dockerfile)
   and `verified`, server-side: the registry stores the very manifest bytes of the pushed digest under each tag, so a tag names
   exactly the gated digest;
7. remove the temporary registry tag, also after a failure in any step above (HTTP DELETE where the
   registry supports it; for our own local distribution 2.8 registry, from its storage; otherwise it
   is reported as left over).

The attestation goes in before the human tags move: that way a human tag never names a digest that
has no attestation, even when the publish dies between two steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import Field

from skupin.builder.catalog.lockfile import Lock, content_tag, lock_path, read_lock, sku_image_tag
from skupin.clients.oci import Manifest, RegistryClient, registry_url, sha256_digest
from skupin.common import __version__
from skupin.common.errors import BundleError, DockerError, NetworkError, PublishError
from skupin.common.model import Frozen, canonical_json
from skupin.common.paths import NO_CATALOG_FIX, catalog, sku_path, state_dir
from skupin.common.revision import SourcePin, catalog_source
from skupin.common.untrusted import load_json, read_regular_file
from skupin.publishing.attest import (
    BOM_PREDICATE_TYPE,
    DSSE_MEDIA_TYPE,
    MAX_ENVELOPE_BYTES,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    BuildPin,
    CheckOutcome,
    Float32Pin,
    ReferencePin,
    Signer,
    TolerancePin,
    TrustedKeys,
    VerificationPredicate,
    bom_statement,
    find_signer,
    hard_bounds_sha256,
    statement,
    tolerance_sha256,
    trusted_keys,
)
from skupin.publishing.imagepush import push_format, push_image
from skupin.publishing.local_registry import default_registry, untag_on_disk
from skupin.publishing.policy import (
    REQUIRED_CHECKS,
    Expected,
    evaluate,
    evaluate_sbom,
    expected_for,
    predicate_problems,
    signed_predicate,
    signed_statement,
    verdict_sha256,
)
from skupin.publishing.sbom import BomSummary, ImageInventory, build_bom, image_inventory

if TYPE_CHECKING:  # the build side, Docker and the gate only where a publish runs: `verify` imports this module too
    from skupin.builder.build import BuiltImage
    from skupin.dockerd import Docker, ImageInfo
    from skupin.gates.judge.verdict import GateVerdict

VERIFIED_TAG = "verified"
LOCK_LABEL = "io.skupin.lock-sha256"  # templates/base.Dockerfile.j2: the lock hash the build was given
# builder/build.py's DOCKERFILE_LABEL, named here so that `verify`, which imports this module, never imports the build
# (tests/unit/test_bomschema.py checks the two agree)
DOCKERFILE_LABEL = "io.skupin.dockerfile-sha256"
VERDICT_PREDICATE_TYPE = "https://skupin.dev/gate-verdict/v1"
VERDICT_ENVELOPE_SUFFIX = ".dsse.json"  # verdict.json -> verdict.dsse.json, beside it
PUSH_TAG_PREFIX = "skupin-push-"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MAX_ENVELOPES = 16
OnEvent = Callable[[str], None]
Untag = Callable[[str, str], bool]  # (repository, tag) -> removed?


def _quiet(_: str) -> None:
    return None


# ---------------------------------------------------------------- where to publish


class RegistryTarget(Frozen):
    """A registry and an optional namespace: `127.0.0.1:5000`, `http://127.0.0.1:5000`, `ghcr.io/org`."""

    host: str = Field(description="host[:port] as image references name it")
    url: str = Field(description="base URL the HTTP client talks to")
    namespace: str = ""

    def repository(self, sku: str) -> str:
        return f"{self.namespace}/{sku}" if self.namespace else sku

    def reference(self, sku: str, *, tag: str | None = None, digest: str | None = None) -> str:
        name = f"{self.host}/{self.repository(sku)}"
        return f"{name}@{digest}" if digest else f"{name}:{tag or VERIFIED_TAG}"


def parse_target(text: str) -> RegistryTarget:
    """`[scheme://]host[:port][/namespace]` -> RegistryTarget (http for loopback hosts unless a scheme is given)."""
    raw = text.strip().rstrip("/")
    scheme = ""
    if "://" in raw:
        scheme, raw = raw.split("://", 1)
    host, _, namespace = raw.partition("/")
    if not host or any(c in host for c in " @?#") or (namespace and not all(namespace.split("/"))):
        raise PublishError(f"--registry {text!r}: expected host[:port][/namespace], e.g. 127.0.0.1:5000 or ghcr.io/org")
    url = f"{scheme}://{host}" if scheme else registry_url(host)
    if urlparse(url).scheme not in ("http", "https"):
        raise PublishError(f"--registry {text!r}: scheme must be http or https")
    return RegistryTarget(host=host, url=url, namespace=namespace.lower())


# ---------------------------------------------------------------- the verdict, read minimally


class VerdictFacts(Frozen):
    """What publish needs from a gate verdict (gates/judge/verdict.py GateVerdict, read as JSON), and that JSON."""

    sku: str
    decision: str
    reason: str
    image_id: str | None
    lock_hash: str | None
    bundle_sha256: str | None
    created: str | None
    checks: dict[str, str] = Field(description="check name -> status")
    check_reasons: dict[str, str] = Field(default_factory=dict)
    reference_path: str | None = None
    tolerance: dict[str, Any] | None = Field(None, description="The verdict's tolerance (key, source, entry)")
    tool_version: str | None = None
    float32: dict[str, Any] | None = Field(None, description="The float32 check's details when it ran (its bundle and "
                                           "entry), None when it was skipped or absent")
    document: dict[str, Any] = Field(default_factory=dict, repr=False,
                                     description="The verdict JSON these facts were read from (the record stores it)")


def facts_of(verdict: GateVerdict) -> VerdictFacts:
    """The facts of a verdict the gate returned, read exactly as its verdict.json would be."""
    return verdict_facts(json.loads(verdict.model_dump_json()))


def verdict_facts(data: dict[str, Any]) -> VerdictFacts:
    """The facts of a verdict JSON object (GateVerdict's fields; `passed: true` also reads as pass)."""
    if not isinstance(data, dict):
        raise PublishError("the verdict is not a JSON object")
    decision = data.get("decision") or ("pass" if data.get("passed") is True else "fail" if "passed" in data else None)
    if decision is None or not data.get("sku"):
        raise PublishError("the verdict has no decision or no sku: not a gate verdict")
    reference = data.get("reference") or {}
    listed = [c for c in data.get("checks") or () if isinstance(c, dict)]
    checks = {str(c.get("name")): str(c.get("status")) for c in listed}
    tolerance = data.get("tolerance")
    return VerdictFacts(sku=str(data["sku"]), decision=str(decision), reason=str(data.get("reason") or ""),
                        image_id=data.get("image_id"), lock_hash=data.get("lock_hash"),
                        bundle_sha256=reference.get("sha256") if isinstance(reference, dict) else None,
                        created=data.get("created"), checks=checks,
                        check_reasons={str(c.get("name")): str(c.get("reason") or "") for c in listed},
                        reference_path=str(reference.get("path") or "") if isinstance(reference, dict) else None,
                        tolerance=tolerance if isinstance(tolerance, dict) else None,
                        tool_version=str(data["tool_version"]) if data.get("tool_version") else None,
                        float32=_float32_details(listed), document=data)


def _float32_details(checks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The float32 check's details when it was judged (pass or fail), else None."""
    found = next((c for c in checks if c.get("name") == "float32"), None)
    details = found.get("details") if found is not None and found.get("status") in ("pass", "fail") else None
    return details if isinstance(details, dict) and details.get("reference_sha256") else None


def refusals(*, sku: str, image_id: str, lock_sha256: str, verdict: VerdictFacts) -> list[str]:
    """Every reason this verdict does not allow publishing this image of this SKU at this lock (empty = allowed)."""
    out: list[str] = []
    uncalibrated = [n for n, s in verdict.checks.items() if s == "uncalibrated"]
    if verdict.decision == "uncalibrated" or uncalibrated:
        out.append(f"the gate ran uncalibrated: {verdict.sku}'s tolerance key has no calibrated entry for this reference "
                   f"bundle, so only its calibration-free checks ran (hard bounds only or not run: "
                   f"{', '.join(uncalibrated) or 'see the verdict'}); an uncalibrated verdict is never published; "
                   f"fix: skupin calibrate {verdict.sku} on that hardware, then gate again")
    elif verdict.decision != "pass":
        out.append(f"the gate did not pass ({verdict.decision}: {verdict.reason})")
    if verdict.sku != sku:
        out.append(f"the verdict is for SKU {verdict.sku}, not {sku}")
    if verdict.image_id != image_id:
        out.append(f"the verdict is for image {verdict.image_id or 'none'}, not {image_id}")
    if verdict.lock_hash != lock_sha256:
        out.append(f"the verdict checked lock {str(verdict.lock_hash)[:12]}, the SKU's current lock is {lock_sha256[:12]}")
    if not verdict.bundle_sha256:
        out.append("the verdict names no reference bundle")
    bad = [f"{n} {s}" for n, s in verdict.checks.items() if s in ("fail", "error")]
    if bad:
        out.append(f"checks did not pass: {', '.join(bad)}")
    missing = [n for n in REQUIRED_CHECKS if verdict.checks.get(n) != "pass"]
    if missing:
        listed = ", ".join(f"{n} ({verdict.checks.get(n, 'absent')})" for n in missing)
        out.append(f"required checks did not pass: {listed}")
    return out


# ---------------------------------------------------------------- the verdict's envelope: bound to the gate run


def verdict_envelope_path(verdict_path: Path) -> Path:
    """Where the signed envelope of a verdict file lies: beside it, `verdict.json` -> `verdict.dsse.json`."""
    path = Path(verdict_path)
    return path.with_name(path.name.removesuffix(".json") + VERDICT_ENVELOPE_SUFFIX)


def verdict_document(verdict: GateVerdict | dict[str, Any]) -> dict[str, Any]:
    """The verdict as its verdict.json reads (the JSON the envelope signs and the attestation pins)."""
    from skupin.gates.judge.verdict import GateVerdict

    return json.loads(verdict.model_dump_json()) if isinstance(verdict, GateVerdict) else verdict


def verdict_statement(document: dict[str, Any]) -> dict[str, Any]:
    """The in-toto statement a gate run signs about its verdict: subject = the verdict's own canonical hash (so the
    signature covers exactly this verdict), predicate = the verdict JSON."""
    return {"_type": STATEMENT_TYPE,
            "subject": [{"name": f"{document.get('sku')}/verdict", "digest": {"sha256": verdict_sha256(document)}}],
            "predicateType": VERDICT_PREDICATE_TYPE, "predicate": document}


def sign_verdict(verdict: GateVerdict | dict[str, Any], signer: Signer) -> bytes:
    """The DSSE envelope of a verdict, signed with this host's key (what the gate's callers write beside verdict.json)."""
    return signer.sign_statement(verdict_statement(verdict_document(verdict)))


def write_verdict_envelope(folder: Path, verdict: GateVerdict, signer: Signer) -> Path:
    """Write `<folder>/verdict.dsse.json`: the gate run's signature over the verdict it wrote to `<folder>/verdict.json`."""
    path = verdict_envelope_path(Path(folder) / "verdict.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    tmp.write_bytes(sign_verdict(verdict, signer))
    os.replace(tmp, path)
    return path


def check_verdict_envelope(envelope: bytes | None, document: dict[str, Any], *, trusted: TrustedKeys,
                           where: str) -> str:
    """The key id that signed `document` through `envelope`; PublishError (nothing pushed) when there is no envelope,
    it is not signed by a trusted key, or its payload is not exactly this verdict: a verdict skupin's gate did not
    write and sign on a host whose key is trusted is never published."""
    fix = "fix: gate the image with `skupin gate` (or `skupin run`) on a host whose signing key is trusted"
    if envelope is None:
        raise PublishError(f"refusing to publish: the verdict {where} has no signed envelope; a verdict is published "
                           f"only with the signature of the gate run that wrote it; nothing was pushed; {fix}")
    digest = "sha256:" + verdict_sha256(document)
    try:
        statement, keyid = signed_statement(envelope, trusted=trusted, digest=digest,
                                            predicate_type=VERDICT_PREDICATE_TYPE)
    except PublishError as exc:
        raise PublishError(f"refusing to publish: the verdict envelope of {where} does not verify: {exc}; "
                           f"nothing was pushed; {fix}") from exc
    predicate = statement.get("predicate")
    if not isinstance(predicate, dict) or canonical_json(predicate) != canonical_json(document):
        raise PublishError(f"refusing to publish: the verdict envelope of {where} signs another verdict; "
                           f"nothing was pushed; {fix}")
    return keyid


def _read_envelope(path: Path) -> bytes | None:
    """The envelope file at `path` (a regular file, read bounded), None when there is none."""
    if not os.path.lexists(path):
        return None
    try:
        return read_regular_file(path, max_bytes=MAX_ENVELOPE_BYTES)
    except (OSError, BundleError, ValueError) as exc:
        raise PublishError(f"{path}: unreadable verdict envelope: {exc}") from exc


def built_here_problems(*, labels: dict[str, str] | None, lock_sha256: str, dockerfile_sha256: str) -> list[str]:
    """Why an image's labels do not say skupin built it from this lock and the current render (empty = they do)."""
    labels = labels or {}
    if not any(k.startswith("io.skupin.") for k in labels):
        return ["the image carries no io.skupin.* labels: skupin did not build it"]
    out = []
    if labels.get(LOCK_LABEL) != lock_sha256:
        out.append(f"it was built from lock {str(labels.get(LOCK_LABEL))[:12]} (label {LOCK_LABEL}), not the SKU's "
                   f"current lock {lock_sha256[:12]}")
    if labels.get(DOCKERFILE_LABEL) != dockerfile_sha256:
        out.append(f"it was built from Dockerfile {str(labels.get(DOCKERFILE_LABEL))[:12]} (label {DOCKERFILE_LABEL}), "
                   f"not {dockerfile_sha256[:12]}, which the current templates render for the lock")
    return out


def _refuse_unless_built_here(*, info: ImageInfo, ref: str, sku: str, lock_sha256: str, dockerfile_sha256: str) -> None:
    problems = built_here_problems(labels=info.labels, lock_sha256=lock_sha256, dockerfile_sha256=dockerfile_sha256)
    if problems:  # its version tag names the lock and this Dockerfile: they must be what built it
        raise PublishError(f"refusing to publish image {ref} for {sku}: " + "; ".join(problems)
                           + f"; nothing was pushed; fix: skupin build {sku}, then gate and publish that image")


def sbom_problems(inventory: ImageInventory, lock: Lock) -> list[str]:
    """Why what the SBOM will list is not the lock's Python packages (empty = every locked package is listed at its
    version). An image whose SBOM lists no distribution for a lock that names packages is not that lock's image."""
    wanted = lock.packages()
    if not wanted:
        return []
    if not inventory.python:
        return [f"the image's SBOM lists 0 Python distributions, the lock names {len(wanted)} packages"]
    have: dict[str, set[str]] = {}
    for dist in inventory.python:
        have.setdefault(canonicalize_name(dist.name), set()).add(_version_key(dist.version))
    missing = sorted(f"{name}=={pkg.version}" for name, pkg in wanted.items()
                     if _version_key(pkg.version) not in have.get(name, set()))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return [f"the image's SBOM does not list {len(missing)} locked package(s): {shown}"]
    return []


def _version_key(text: str) -> str:
    try:
        return str(Version(text))
    except InvalidVersion:
        return text


# ---------------------------------------------------------------- the plan (pure)


class PublishPlan(Frozen):
    """What one publish will do, decided before anything is pushed."""

    sku: str
    target: RegistryTarget
    repository: str
    image_id: str
    lock_sha256: str
    version_tag: str
    tags: tuple[str, ...] = Field(description="Human tags, moved in this order after the push and the record")
    push_tag: str
    verdict: VerdictFacts = Field(description="The verdict that allowed it")
    predicate: VerificationPredicate = Field(description="What the attestation will say (signed once the digest is known)")
    expected: Expected = Field(description="What this repository knows about the SKU (the policy's other side)")

    @property
    def push_reference(self) -> str:
        return f"{self.target.host}/{self.repository}:{self.push_tag}"


def version_tag(*, sku: str, engine_version: str, lock: Lock, dockerfile_sha256: str) -> str:
    """`<engine-version>-<hash12>` over the lock and the locked Dockerfile: the tag part of the local tag
    (builder/catalog/lockfile.py: content_tag; the same for every SKU, `sku` names whose it is)."""
    return content_tag(engine_version=engine_version, lock=lock, dockerfile_sha256=dockerfile_sha256)


def plan_publish(*, sku: str, engine_version: str, lock: Lock, dockerfile_sha256: str, image_id: str,
                 verdict: VerdictFacts, target: RegistryTarget, expected: Expected,
                 push_tag: str | None = None, source: SourcePin | None = None, build: BuildPin | None = None
                 ) -> PublishPlan:
    """Decide the publish: PublishError listing every reason when the verdict does not allow it, or when the
    attestation it would sign would not pass the policy `verify` applies (skupin/publishing/policy.py)."""
    lock_sha = lock.content_hash()
    if lock.sku != sku:
        raise PublishError(f"the lock is for SKU {lock.sku}, not {sku}")
    problems = refusals(sku=sku, image_id=image_id, lock_sha256=lock_sha, verdict=verdict)
    predicate = predicate_of(plan_sku=sku, repository=target.repository(sku), image_id=image_id, lock=lock,
                             facts=verdict, published=_now(), source=source, build=build)
    problems += [p for p in predicate_problems(predicate, expected) if p not in problems]
    if problems:
        raise PublishError(f"refusing to publish {sku} ({image_id[:19]}): " + "; ".join(problems)
                           + f"; fix: run `skupin gate {sku}` on this image and lock")
    vtag = version_tag(sku=sku, engine_version=engine_version, lock=lock, dockerfile_sha256=dockerfile_sha256)
    return PublishPlan(sku=sku, target=target, repository=target.repository(sku), image_id=image_id,
                       lock_sha256=lock_sha, version_tag=vtag, tags=(vtag, VERIFIED_TAG),
                       push_tag=push_tag or PUSH_TAG_PREFIX + secrets.token_hex(6), verdict=verdict,
                       predicate=predicate, expected=expected)


# ---------------------------------------------------------------- the attestation, stored the way cosign stores one


def attestation_tag(digest: str) -> str:
    """sha256:<hex> -> sha256-<hex>.att (the tag cosign gives an image's attestations)."""
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64:
        raise PublishError(f"not a sha256 digest: {digest!r}")
    return f"sha256-{hexpart}.att"


class Artifact(Frozen):
    """The attestations as an OCI artifact: config blob, layer blobs (the DSSE envelopes), manifest bytes."""

    config: bytes
    layers: tuple[bytes, ...]
    manifest: bytes

    @property
    def layer(self) -> bytes:
        """The first layer: the verification attestation."""
        return self.layers[0]


def attestation_artifact(*, envelope: bytes, subject: Manifest | None,
                         more: tuple[tuple[bytes, str], ...] = ()) -> Artifact:
    """An OCI image manifest laid out as cosign lays out `.att`: one layer per envelope (media type
    application/vnd.dsse.envelope.v1+json, the cosign signature annotation, predicateType), the verification
    attestation first, then `more` ((envelope, predicate type): the SBOM), as `cosign attest` appends one layer per
    attestation; an image config whose rootfs names those layers, and the OCI 1.1 `subject` = the image (None: left
    out)."""

    def desc(media: str, data: bytes) -> dict[str, Any]:
        return {"mediaType": media, "digest": sha256_digest(data), "size": len(data)}

    typed = ((envelope, PREDICATE_TYPE), *more)
    config = canonical_json({"architecture": "", "config": {}, "created": "0001-01-01T00:00:00Z",
                             "history": [{"created": "0001-01-01T00:00:00Z"} for _ in typed], "os": "",
                             "rootfs": {"type": "layers", "diff_ids": [sha256_digest(layer) for layer, _ in typed]}})
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": desc(OCI_CONFIG, config),
        "layers": [{**desc(DSSE_MEDIA_TYPE, layer),
                    "annotations": {"dev.cosignproject.cosign/signature": "", "predicateType": kind}}
                   for layer, kind in typed],
    }
    if subject is not None:
        manifest["subject"] = {"mediaType": subject.media_type, "digest": subject.digest, "size": len(subject.body)}
    return Artifact(config=config, layers=tuple(layer for layer, _ in typed), manifest=canonical_json(manifest))


def read_attestations(*, client: RegistryClient, repository: str, digest: str) -> list[bytes]:
    """The DSSE envelopes stored under `sha256-<hex>.att` for `digest`; PublishError when there are none,
    NetworkError when the registry cannot be read (a registry that went away is not "not attested")."""
    return [envelope for _kind, envelope in read_attestation_layers(client=client, repository=repository, digest=digest)]


def read_attestation_layers(*, client: RegistryClient, repository: str, digest: str) -> list[tuple[str, bytes]]:
    """(the layer's predicateType annotation, the DSSE envelope) of each attestation stored for `digest` (see
    `read_attestations`). The annotation is not signed: it only says which policy to apply (the signed statement's
    own predicateType must then match it)."""
    tag = attestation_tag(digest)
    art = client.find_manifest(repository, tag, accept=(OCI_MANIFEST, DOCKER_MANIFEST))
    if art is None:
        raise PublishError(f"no attestation for {digest[:19]} ({repository}:{tag} does not exist)")
    try:
        body = art.json()
        layers = [d for d in body.get("layers", ()) if d.get("mediaType") == DSSE_MEDIA_TYPE]
        subject = (body.get("subject") or {}).get("digest")
    except (ValueError, AttributeError, TypeError, RecursionError) as exc:
        raise PublishError(f"{repository}:{tag} is not an attestation manifest") from exc
    if not layers:
        raise PublishError(f"{repository}:{tag} holds no DSSE envelope")
    if subject is not None and subject != digest:
        raise PublishError(f"{repository}:{tag} names subject {subject}, not {digest}")
    out = []
    for layer in layers[:MAX_ENVELOPES]:
        if not isinstance(layer.get("size"), int) or layer["size"] > MAX_ENVELOPE_BYTES:
            continue
        notes = layer.get("annotations")
        kind = notes.get("predicateType") if isinstance(notes, dict) else None
        try:
            out.append((kind if isinstance(kind, str) else "",
                        client.get_blob(repository, layer["digest"], max_bytes=layer["size"])))  # bounded as declared
        except (NetworkError, KeyError, TypeError) as exc:
            raise PublishError(f"an envelope of {repository}:{tag} cannot be read: {exc}") from exc
    if not out:
        raise PublishError(f"{repository}:{tag} holds no readable DSSE envelope")
    return out


def _float32_pin(facts: VerdictFacts) -> Float32Pin | None:
    """The float32 pass as the predicate pins it: its bundle (by the manifest-relative path when it is the SKU's own)
    and the entry it was judged by (None: judged by the hard bounds alone)."""
    f32 = facts.float32
    if f32 is None:
        return None
    entry = f32.get("tolerance_entry")
    reference = str(f32.get("reference") or "")
    if facts.reference_path and not Path(facts.reference_path).is_absolute():  # the SKU's own bundle: its sibling
        reference = Path(facts.reference_path).with_name(Path(reference).name).as_posix()
    tolerance = (TolerancePin(key=str(f32.get("tolerance_key") or ""), source=str(facts.tolerance.get("source") or "")
                              if facts.tolerance else "", entry_sha256=tolerance_sha256(entry),
                              provenance=entry.get("provenance")) if isinstance(entry, dict) else None)
    return Float32Pin(reference=ReferencePin(sha256=str(f32["reference_sha256"]), path=reference), tolerance=tolerance)


def predicate_of(*, plan_sku: str, repository: str, image_id: str, lock: Lock, facts: VerdictFacts,
                 published: str, source: SourcePin | None = None, build: BuildPin | None = None) -> VerificationPredicate:
    """The predicate a publish signs: what the verdict established, pinned by hashes."""
    tol = facts.tolerance
    entry = tol.get("entry") if isinstance(tol, dict) else None
    pin = None
    if isinstance(tol, dict):
        pin = TolerancePin(key=str(tol.get("key") or ""), source=str(tol.get("source") or ""),
                           entry_sha256=tolerance_sha256(entry) if isinstance(entry, dict) else None,
                           provenance=entry.get("provenance") if isinstance(entry, dict) else None)
    bounds = tol.get("hard_bounds") if isinstance(tol, dict) else None
    return VerificationPredicate(
        float32=_float32_pin(facts), hard_bounds_sha256=hard_bounds_sha256(bounds) if isinstance(bounds, dict) else None,
        sku=plan_sku, repository=repository, image_id=image_id, lock_sha256=lock.content_hash(),
        lock=lock.json_data(),
        reference=ReferencePin(sha256=str(facts.bundle_sha256 or ""), path=facts.reference_path or ""),
        tolerance=pin, decision=facts.decision, reason=facts.reason,
        checks=tuple(CheckOutcome(name=n, status=s, reason=facts.check_reasons.get(n, "")) for n, s in facts.checks.items()),
        verdict_sha256=verdict_sha256(facts.document), gate_created=facts.created,
        gate_tool_version=facts.tool_version, tool_version=__version__, published=published, source=source, build=build)


# ---------------------------------------------------------------- executing the plan


class PublishedImage(Frozen):
    """A published, attested and tagged image."""

    sku: str
    registry: str
    repository: str
    digest: str
    reference: str = Field(description="name@sha256:... (what operators pull)")
    image_id: str
    lock_sha256: str
    tags: tuple[str, ...]
    attestation_tag: str
    attestation_digest: str
    keyid: str = Field(description="Key id (sha256 of the public key's DER) of the key that signed the attestation")
    sbom: BomSummary | None = Field(None, description="The signed SBOM stored with the attestation (its counts)")
    push_s: float
    total_s: float
    leftover_tags: tuple[str, ...] = Field(default=(), description="Temporary tags the registry could not delete")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_registry(*, client: RegistryClient, target: RegistryTarget, hint: str = "") -> None:
    """PublishError (nothing tagged) when the registry does not answer."""
    try:
        client.ping()
    except NetworkError as exc:
        fix = hint or f"make {target.url} reachable and log in (docker login {target.host})"
        raise PublishError(f"the registry {target.url} does not answer: {exc}; nothing was pushed or tagged; fix: {fix}") from exc


def push_by_digest(*, plan: PublishPlan, docker: Docker, client: RegistryClient, on_event: OnEvent = _quiet) -> str:
    """Push the image under the plan's temporary tag with skupin's own bytes (publishing/imagepush.py: one image id,
    one manifest digest on any machine); return the digest."""
    try:
        return push_image(docker=docker, client=client, repository=plan.repository, image_id=plan.image_id,
                          tag=plan.push_tag, on_event=on_event)
    except (DockerError, NetworkError) as exc:
        raise PublishError(f"push of {plan.sku} to {plan.target.url} failed: {exc}; nothing was tagged") from exc


@contextlib.contextmanager
def publish_lock(plan: PublishPlan, *, folder: Path | None = None) -> Iterator[None]:
    """Serialize publishes of one repository on one registry from this host (flock on a file under
    .skupin/locks/); publishes from other hosts are caught by the immutable version tag instead."""
    where = Path(folder) if folder else state_dir() / "locks"
    where.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"publish-{plan.target.host}-{plan.repository}") + ".lock"
    with open(where / name, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _version_tag_holder(*, plan: PublishPlan, client: RegistryClient) -> Manifest | None:
    """The manifest the plan's version tag already names in the registry (None: the registry answered 404, the tag
    or the repository does not exist). Any other answer is an error: "cannot tell" never counts as "free"."""
    try:
        return client.find_manifest(plan.repository, plan.version_tag, push=True)
    except NetworkError as exc:
        raise PublishError(f"cannot tell whether {plan.repository}:{plan.version_tag} is free: {exc}; "
                           "nothing was tagged") from exc


def _immutable(plan: PublishPlan, held: Manifest, *, image_id: str | None = None, digest: str | None = None) -> None:
    """PublishError when the version tag already names another image (by config id) or another digest."""
    config = (held.json().get("config") or {}).get("digest")
    if (image_id is not None and config != image_id) or (digest is not None and held.digest != digest):
        raise PublishError(
            f"{plan.target.host}/{plan.repository}:{plan.version_tag} already names {held.digest[:19]} "
            f"(image {str(config)[:19]}); "
            f"a version tag never moves to another digest, and this publish is {digest or image_id}; "
            "nothing was tagged; fix: publish the image that tag names, or change the lock (a new lock gives a new version tag)")


def publish_image(*, plan: PublishPlan, docker: Docker, client: RegistryClient, signer: Signer,
                  trusted: TrustedKeys | None = None, untag: Untag | None = None, on_event: OnEvent = _quiet,
                  registry_hint: str = "", lock_folder: Path | None = None,
                  inventory: ImageInventory | None = None) -> PublishedImage:
    """Execute a plan (see the module doc). Nothing is tagged unless every earlier step succeeded.

    `inventory`: what the SBOM lists; None (always, outside tests): read from the image's layers on the engine."""
    trusted = trusted if trusted is not None else trusted_keys()
    if signer.keyid not in trusted:
        raise PublishError(f"the signing key {signer.keyid[:12]} ({signer.path}) is not a trusted key, so nobody "
                           f"could verify what it signs (trusted: {trusted.describe()}); nothing was pushed; fix: add "
                           "its public key to keys/trusted/ (commit it) or .skupin/keys/trusted/ (this machine)")
    with publish_lock(plan, folder=lock_folder):
        return _publish_locked(plan=plan, docker=docker, client=client, signer=signer, trusted=trusted, untag=untag,
                               on_event=on_event, registry_hint=registry_hint, inventory=inventory)


def _publish_locked(*, plan: PublishPlan, docker: Docker, client: RegistryClient, signer: Signer,
                    trusted: TrustedKeys, untag: Untag | None, on_event: OnEvent, registry_hint: str,
                    inventory: ImageInventory | None) -> PublishedImage:
    start = time.monotonic()
    check_registry(client=client, target=plan.target, hint=registry_hint)
    held = _version_tag_holder(plan=plan, client=client)
    if held is not None and not _held_by_a_publish(plan=plan, held=held, client=client, trusted=trusted):
        on_event(f"version tag {plan.repository}:{plan.version_tag} holds {held.digest} with no trusted attestation "
                 f"for {plan.sku} at lock {plan.lock_sha256[:12]} (squatted); it will be replaced by the gated image")
        held = None  # squatted: free for the gated image
    if held is not None:
        _immutable(plan, held, image_id=plan.image_id)
    if inventory is None:
        inventory = image_inventory(docker=docker, image_id=plan.image_id, cache=state_dir() / "cache", on_event=on_event)
    on_event(f"SBOM: {len(inventory.python)} Python distributions, {len(inventory.debian)} Debian packages")
    unlisted = sbom_problems(inventory, Lock.model_validate(plan.predicate.lock))
    if unlisted:
        raise PublishError(f"refusing to publish {plan.sku} ({plan.image_id[:19]}): " + "; ".join(unlisted)
                           + "; nothing was pushed; fix: publish the image skupin built from this lock")
    on_event(f"pushing {plan.image_id[:19]} as {plan.push_reference}")
    digest = ""
    try:
        digest = push_by_digest(plan=plan, docker=docker, client=client, on_event=on_event)
        push_s = time.monotonic() - start
        on_event(f"pushed {digest}")
        try:
            image = client.get_manifest(plan.repository, digest)
        except NetworkError as exc:
            raise PublishError(f"pushed {digest} but cannot read it back: {exc}; nothing was tagged") from exc
        config = (image.json().get("config") or {}).get("digest")
        if config != plan.image_id:
            raise PublishError(f"pushed manifest {digest} has config {config}, not the gated image {plan.image_id}; "
                               "nothing was tagged")
        if held is not None:
            _immutable(plan, held, digest=digest)  # attested for this lock: only the same digest may be published again
        envelope = signer.sign_statement(statement(repository=plan.repository, digest=digest, predicate=plan.predicate))
        verdict = evaluate(envelope, trusted=trusted, digest=digest, expected=plan.expected, image_id=config)
        if not verdict.ok:
            raise PublishError(f"the attestation for {digest[:19]} would not verify: {verdict.reason()}; nothing was tagged")
        bom = build_bom(inventory, registry=plan.target.host, repository=plan.repository, digest=digest,
                        image_id=plan.image_id, timestamp=plan.predicate.published, lock=Lock.model_validate(plan.predicate.lock),
                        sku=plan.sku)
        sbom = signer.sign_statement(bom_statement(repository=plan.repository, digest=digest, bom=bom))
        checked = evaluate_sbom(sbom, trusted=trusted, digest=digest)
        if not checked.ok:
            raise PublishError(f"the SBOM attestation for {digest[:19]} would not verify: {checked.reason}; "
                               "nothing was tagged")
        att_digest = _store_attestation(plan=plan, envelopes=((envelope, PREDICATE_TYPE), (sbom, BOM_PREDICATE_TYPE)),
                                        subject=image, client=client, on_event=on_event)
        on_event(f"stored the signed attestation and SBOM {plan.repository}:{attestation_tag(digest)} "
                 f"(key {signer.keyid[:12]})")
        for tag in plan.tags:
            if tag == plan.version_tag:
                _claim_version_tag(plan=plan, image=image, client=client, trusted=trusted, on_event=on_event)
            else:
                _move_tag(plan=plan, tag=tag, image=image, client=client)
            on_event(f"tagged {plan.target.host}/{plan.repository}:{tag} -> {digest}")
    finally:
        leftover = _drop_push_tag(plan=plan, client=client, untag=untag, on_event=on_event, pushed=bool(digest))
    return PublishedImage(
        sku=plan.sku, registry=plan.target.url, repository=plan.repository, digest=digest,
        reference=plan.target.reference(plan.sku, digest=digest), image_id=plan.image_id, lock_sha256=plan.lock_sha256,
        tags=plan.tags, attestation_tag=attestation_tag(digest), attestation_digest=att_digest, keyid=signer.keyid,
        sbom=checked.summary, push_s=round(push_s, 3), total_s=round(time.monotonic() - start, 3), leftover_tags=leftover)


def _store_attestation(*, plan: PublishPlan, envelopes: tuple[tuple[bytes, str], ...], subject: Manifest,
                       client: RegistryClient, on_event: OnEvent) -> str:
    """Store the envelopes ((envelope, predicate type), the verification attestation first) as the layers of one
    manifest under sha256-<hex>.att with the OCI 1.1 subject; a registry that refuses the subject field gets the
    manifest without it (the tag is how cosign and verify find it). One manifest put: both or neither."""
    tag = attestation_tag(subject.digest)
    (first, _kind), *rest = envelopes
    art = attestation_artifact(envelope=first, subject=subject, more=tuple(rest))
    try:
        client.push_blob(plan.repository, art.config)
        for layer in art.layers:
            client.push_blob(plan.repository, layer)
        try:
            stored = client.put_manifest(plan.repository, tag, art.manifest, OCI_MANIFEST)
        except NetworkError as exc:
            on_event(f"the registry refused the attestation with an OCI 1.1 subject ({exc}); storing it without")
            art = attestation_artifact(envelope=first, subject=None, more=tuple(rest))
            stored = client.put_manifest(plan.repository, tag, art.manifest, OCI_MANIFEST)
    except NetworkError as exc:
        raise PublishError(f"storing the attestation {tag} failed: {exc}; no human tag was moved") from exc
    back = read_attestation_layers(client=client, repository=plan.repository, digest=subject.digest)
    if back != [(kind, envelope) for envelope, kind in envelopes]:
        raise PublishError(f"the attestation read back from {tag} differs from the one stored; no human tag was moved")
    return stored


def _claim_version_tag(*, plan: PublishPlan, image: Manifest, client: RegistryClient, trusted: TrustedKeys,
                       on_event: OnEvent = _quiet) -> None:
    """Move the version tag, the tag that never moves: found free (or naming this digest) right before the put and
    read back right after, before the `verified` tag moves. "Free" is absent or squatted: a tag whose digest carries
    no attestation a trusted key signed for this SKU and lock (anyone who may push can put one there, since the
    next tag can be computed from the repository) is replaced, and that is said; a tag a publish attested never
    moves. A registry cannot put a tag only if it is absent, so two
    hosts publishing one lock at once can still both put it; the read-back makes the one overwritten fail instead of
    both claiming it. Closing the last gap needs one publish per SKU at a time (images.yml's concurrency group) or
    the registry's own immutable tags (docs/guide-operator.md, "Immutable version tags")."""
    held = _version_tag_holder(plan=plan, client=client)
    squatted = (held is not None and held.digest != image.digest
                and not _held_by_a_publish(plan=plan, held=held, client=client, trusted=trusted))
    if held is not None and not squatted:
        _immutable(plan, held, digest=image.digest)
    _move_tag(plan=plan, tag=plan.version_tag, image=image, client=client)
    try:
        now = client.get_manifest(plan.repository, plan.version_tag)
    except NetworkError as exc:
        raise PublishError(f"tagged {plan.repository}:{plan.version_tag} but cannot read it back: {exc}; "
                           f"the {VERIFIED_TAG} tag was not moved") from exc
    if now.digest != image.digest:
        raise PublishError(
            f"{plan.target.host}/{plan.repository}:{plan.version_tag} was moved to {now.digest[:19]} by another "
            f"publish while this one tagged it; this publish claims nothing and the {VERIFIED_TAG} tag was not moved; "
            "fix: publish one SKU from one place at a time")
    if squatted and held is not None:
        on_event(f"version tag {plan.target.host}/{plan.repository}:{plan.version_tag} held {held.digest} with no "
                 "trusted attestation (squatted); replaced")


def attested_for(*, client: RegistryClient, repository: str, held: Manifest, sku: str, lock_sha256: str,
                 trusted: TrustedKeys) -> bool:
    """Whether the image manifest `held` carries a verification attestation a trusted key signed about its digest for
    SKU `sku` at lock `lock_sha256` naming its config as the gated image: what makes a version tag published (its
    holder came from a publish), rather than squatted. False when there is no attestation or none of them is that;
    NetworkError when the registry cannot be read ("cannot tell" never counts as "squatted")."""
    try:
        layers = read_attestation_layers(client=client, repository=repository, digest=held.digest)
    except PublishError as exc:
        if isinstance(exc.__cause__, NetworkError):
            raise exc.__cause__ from exc
        return False
    try:
        config = (held.json().get("config") or {}).get("digest")
    except (ValueError, AttributeError, TypeError, RecursionError):
        return False
    for kind, envelope in layers:
        if kind == BOM_PREDICATE_TYPE:
            continue
        try:
            predicate, _keyid = signed_predicate(envelope, trusted=trusted, digest=held.digest)
        except PublishError:
            continue
        if predicate.sku == sku and predicate.lock_sha256 == lock_sha256 and predicate.image_id == config:
            return True
    return False


def _held_by_a_publish(*, plan: PublishPlan, held: Manifest, client: RegistryClient, trusted: TrustedKeys) -> bool:
    try:
        return attested_for(client=client, repository=plan.repository, held=held, sku=plan.sku,
                            lock_sha256=plan.lock_sha256, trusted=trusted)
    except NetworkError as exc:
        raise PublishError(f"cannot tell whether {plan.repository}:{plan.version_tag} ({held.digest[:19]}) was "
                           f"published: its attestation cannot be read: {exc}; nothing was tagged") from exc


def _move_tag(*, plan: PublishPlan, tag: str, image: Manifest, client: RegistryClient) -> None:
    try:
        stored = client.put_manifest(plan.repository, tag, image.body, image.media_type)
    except NetworkError as exc:
        raise PublishError(f"moving {plan.repository}:{tag} to {image.digest} failed: {exc}") from exc
    if stored != image.digest:
        raise PublishError(f"{plan.repository}:{tag} was stored as {stored}, not {image.digest}")


def _drop_push_tag(*, plan: PublishPlan, client: RegistryClient, untag: Untag | None, on_event: OnEvent,
                   pushed: bool) -> tuple[str, ...]:
    """Remove the temporary tag from the registry; the tags that could not be removed."""
    try:
        if client.delete_tag(plan.repository, plan.push_tag):
            return ()
    except NetworkError:
        pass
    if untag is not None:
        try:
            untag(plan.repository, plan.push_tag)
            return ()
        except (OSError, PublishError):
            pass
    if pushed:
        on_event(f"the registry cannot delete tags: temporary tag {plan.repository}:{plan.push_tag} left behind")
        return (plan.push_tag,)
    return ()


# ---------------------------------------------------------------- a SKU, from its files (for the CLI and `run`)


def publish_target(registry: str | None, addr: str) -> tuple[RegistryTarget, Untag | None, str]:
    """The registry to publish to; for our default local registry also the on-disk untag and the `up` hint."""

    local = default_registry(addr=addr)
    target = parse_target(registry or local.addr)
    if target.host == local.addr and local.config_path.exists():
        return target, (lambda repo, tag: untag_on_disk(registry=local, repository=repo, tag=tag)), "run `skupin registry up`"
    hint = "run `skupin registry up`" if target.host == local.addr else ""
    return target, None, hint


MAX_VERDICT_BYTES = 64 * 1024**2


def find_verdict(*, sku: str, image_id: str, lock_sha256: str) -> tuple[Path, dict | None] | None:
    """The newest verdict under .skupin/gates/<sku>/ for this image and lock (else the newest at all, so
    the refusal can say why) with its parsed data (None when that file could not be read); None when the
    SKU was never gated. An older pass never hides a newer fail. Only regular files count (lstat: a link,
    a FIFO or a folder named verdict.json is skipped, links to folders are not followed), and each is
    read bounded in size and JSON depth, so nothing in that folder can hang or crash publish."""

    found = _verdict_files(state_dir() / "gates" / sku)
    newest: dict | None = None
    for i, path in enumerate(found):
        data = _load_object(path)
        if data is None:
            continue
        if i == 0:
            newest = data
        if data.get("image_id") == image_id and data.get("lock_hash") == lock_sha256:
            return path, data
    return (found[0], newest) if found else None


def _catalog_facts(sku: str) -> Expected:
    """What the catalog commits for `sku`: publishing always compares with a catalog (verify may go without one)."""
    expected = expected_for(sku)
    if expected.catalog is None:
        raise PublishError(f"{sku}: publishing needs a catalog (its lock, bundle and tolerance are attested); "
                           f"fix: {NO_CATALOG_FIX}")
    return expected


def _verdict_files(root: Path) -> list[Path]:
    """Every regular file named verdict.json under `root`, newest (lstat mtime) first; the probe's output folders
    (`probe/`, container-writable before the probe printed its outputs) are not searched."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if d != "probe"]
        if "verdict.json" not in files:
            continue
        path = Path(folder) / "verdict.json"
        try:
            info = path.lstat()
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found.append((info.st_mtime, str(path)))
    return [Path(p) for _, p in sorted(found, reverse=True)]


def _load_object(path: Path) -> dict | None:
    """The JSON object at `path` (a verdict, a build record: a regular file, read bounded), or None when it cannot be
    read or is not an object."""
    try:
        data = _read_bounded(path)
    except (OSError, ValueError, BundleError):  # BundleError: common.untrusted refused it
        return None
    return data if isinstance(data, dict) else None


def _read_bounded(path: Path) -> Any:

    return load_json(read_regular_file(path, max_bytes=MAX_VERDICT_BYTES), source=str(path))


def _read_verdict(path: Path, sku: str) -> dict:
    """The verdict at `path` (given on the command line: a link to it is followed), read bounded."""
    resolved = Path(path).resolve()
    if not resolved.exists():
        raise PublishError(f"no gate verdict at {path}; fix: skupin gate {sku}")
    try:
        data = _read_bounded(resolved)
    except (OSError, ValueError, BundleError) as exc:
        raise PublishError(f"{path}: unreadable verdict: {exc}") from exc
    if not isinstance(data, dict):
        raise PublishError(f"{path}: unreadable verdict: not a JSON object")
    return data


def publish_sku(*, sku: str, registry: str | None, addr: str, verdict_path: Path | None, image: str | None,
                docker: Docker, signing_key: Path | None = None, trusted: TrustedKeys | None = None,
                on_event: OnEvent = _quiet) -> PublishedImage:
    """`skupin publish`: the SKU's current lock, an image on this host and its verdict file (given, or the newest
    under .skupin/gates/ for this image and lock), each read once; then plan and publish."""
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.builder.render import render_manifest

    path = sku_path(sku)
    signer = find_signer(signing_key)  # before anything else: a missing key is the first thing to fix
    manifest = load_manifest(path)
    lock = read_lock(lock_path(path))
    dockerfile = render_manifest(manifest=manifest, lock=lock).sha256
    ref = image or sku_image_tag(manifest, lock=lock, dockerfile_sha256=dockerfile)
    info = _local_image(docker=docker, ref=ref, sku=manifest.name)
    _refuse_unless_built_here(info=info, ref=ref, sku=manifest.name, lock_sha256=lock.content_hash(),
                              dockerfile_sha256=dockerfile)
    found = (verdict_path, None) if verdict_path else find_verdict(sku=manifest.name, image_id=info.id,
                                                                   lock_sha256=lock.content_hash())
    if found is None:
        raise PublishError(f"{manifest.name} was never gated (no verdict under .skupin/gates/); fix: skupin gate {manifest.name}")
    vpath, verdict = found
    if verdict is None:  # given on the command line, or the newest verdict could not be read
        verdict = _read_verdict(vpath, manifest.name)
    trusted = trusted if trusted is not None else trusted_keys()
    envelope = verdict_envelope_path(vpath)
    keyid = check_verdict_envelope(_read_envelope(envelope), verdict, trusted=trusted, where=str(vpath))
    on_event(f"verdict {vpath}: signed by the gate run's key {keyid[:12]} ({envelope.name})")
    target, untag, hint = publish_target(registry, addr)
    plan = plan_publish(sku=manifest.name, engine_version=manifest.stack.engine.version, lock=lock,
                        dockerfile_sha256=dockerfile, image_id=info.id, verdict=verdict_facts(verdict), target=target,
                        expected=_catalog_facts(manifest.name), source=catalog_source(catalog()),
                        build=_recorded_build(sku=manifest.name, image_id=info.id))
    return _execute(plan=plan, docker=docker, signer=signer, trusted=trusted, untag=untag, registry_hint=hint,
                    on_event=on_event)


def publish(built: BuiltImage, verdict: GateVerdict, target: RegistryTarget, *, docker: Docker,
            untag: Untag | None = None, registry_hint: str = "", on_event: OnEvent = _quiet,
            signer: Signer | None = None, trusted: TrustedKeys | None = None,
            verdict_envelope: bytes | None = None) -> PublishedImage:
    """The publish stage: the image `build` made, allowed by the verdict `gate` returned for it; see the module doc.

    `verdict_envelope` is the gate run's signature over that verdict (`sign_verdict`, what `skupin run` writes as
    verdict.dsse.json beside verdict.json); without one from a trusted key over exactly this verdict nothing is
    pushed. The image's labels must name the lock and the Dockerfile it was built from.

    `untag` removes a temporary tag where the registry cannot (our local registry: `publish_target`).
    Without `signer`, the key `find_signer` finds, and on a fresh machine (no --signing-key, no
    $SKUPIN_SIGNING_KEY, no .skupin/keys/signing.key) a local key generated and trusted on this
    machine, said through `on_event` (what `skupin run` does).
    """
    signer = signer or find_signer(create=True, on_event=on_event)
    lock = built.stack.current_lock
    if lock is None:
        raise PublishError(f"{built.sku}: the stack it was built from has no current lock; fix: skupin lock {built.sku}")
    info = _local_image(docker=docker, ref=built.image_id, sku=built.sku)
    _refuse_unless_built_here(info=info, ref=built.image, sku=built.sku, lock_sha256=lock.content_hash(),
                              dockerfile_sha256=built.dockerfile_sha256)
    trusted = trusted if trusted is not None else trusted_keys()
    check_verdict_envelope(verdict_envelope, verdict_document(verdict), trusted=trusted,
                           where=f"of the gate run for {built.image_id[:19]}")
    plan = plan_publish(sku=built.sku, engine_version=built.stack.manifest.stack.engine.version, lock=lock,
                        dockerfile_sha256=built.dockerfile_sha256, image_id=info.id, verdict=facts_of(verdict),
                        target=target, expected=_catalog_facts(built.sku), source=catalog_source(catalog()),
                        build=build_pin(built) if built.image_id == info.id else None)
    return _execute(plan=plan, docker=docker, signer=signer, trusted=trusted, untag=untag, registry_hint=registry_hint,
                    on_event=on_event)


def build_pin(built: BuiltImage) -> BuildPin | None:
    """The signed record's account of how `built` was made; None for an image no rewrite made reproducible."""
    made = built.reproducible
    if made is None or made.image_id != built.image_id:
        return None
    return BuildPin(layers=made.format, push=push_format(), builder=built.builder or None)


def _recorded_build(*, sku: str, image_id: str) -> BuildPin | None:
    """The build pin of this host's build record of `sku` when it names `image_id` (else None: built elsewhere)."""
    path = state_dir() / "builds" / f"{sku}.json"
    record = _load_object(path) if path.is_file() else None
    made = record.get("reproducible") if record is not None else None
    if record is None or not isinstance(made, dict) or record.get("image_id") != image_id \
            or made.get("image_id") != image_id:
        return None
    if not isinstance(made.get("format"), str):
        return None
    return BuildPin(layers=made["format"], push=push_format(), builder=str(record.get("builder") or "") or None)


def _local_image(*, docker: Docker, ref: str, sku: str) -> ImageInfo:
    info = docker.inspect_image(ref)
    if info is None:
        raise PublishError(f"image {ref} is not on this engine; fix: skupin build {sku}")
    return info


def _execute(*, plan: PublishPlan, docker: Docker, signer: Signer, trusted: TrustedKeys | None, untag: Untag | None,
             registry_hint: str, on_event: OnEvent) -> PublishedImage:
    """Run a plan against its registry (one client for the whole publish)."""
    with RegistryClient(plan.target.url) as client:
        return publish_image(plan=plan, docker=docker, client=client, signer=signer, trusted=trusted, untag=untag,
                             on_event=on_event, registry_hint=registry_hint)
