"""Check a published image for operators: tag -> digest -> verification record -> passed, same digest, current lock.

`verify_reference` never raises for "not verified": it returns a `Verification` whose `line()` is
the one-line answer (`verified: REF -> name@sha256:... (...)` or `NOT verified: why`).
`pull_verified` resolves `<sku>:verified`, verifies that digest and pulls it by digest (never by a
tag that may have moved since).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field

from builder.lockfile import Lock, lock_path, read_lock
from clients.oci import RegistryClient, parse_image_ref
from common.errors import NetworkError, PublishError, SkupinError
from common.model import Frozen
from common.paths import sku_path
from publishing.publish import VERIFIED_TAG, RegistryTarget, read_record, verdict_facts

CurrentLock = Callable[[str], str]  # sku -> content hash of its committed lock (raises SkupinError when none)
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
    reason: str = ""
    image_id: str | None = Field(None, exclude=True)  # the record's image id; not part of `verify --json`

    def line(self) -> str:
        if self.ok:
            return (f"verified: {self.ref} -> {self.reference} ({self.sku}, lock {str(self.lock_sha256)[:12]}, "
                    f"gate passed {self.gate_date or 'at an unknown date'})")
        return f"NOT verified: {self.ref}: {self.reason}"


def committed_lock_hash(sku: str) -> str:
    """The content hash of skus/<sku>.lock.json (the SKU's current lock)."""

    return read_lock(lock_path(sku_path(sku))).content_hash()


def _default_client(host: str) -> RegistryClient:
    return RegistryClient(host)


def verify_reference(*, ref: str, current_lock: CurrentLock = committed_lock_hash,
                     client_for: ClientFor = _default_client) -> Verification:
    """Resolve `ref` (host/repo:tag or host/repo@sha256:...) and check its record; see the module doc."""
    name = parse_image_ref(ref)
    no = lambda why, **kw: Verification(ok=False, ref=ref, reason=why, **kw)  # noqa: E731
    if not name.tag and not name.digest:
        return no("give a tag or a digest (host/repo:tag)")
    client = client_for(name.registry)
    try:
        try:
            digest = client.resolve(name.repository, name.digest or name.tag or VERIFIED_TAG)
        except NetworkError as exc:
            return no(f"cannot resolve it: {exc}")
        if name.digest and digest != name.digest:
            return no(f"the registry serves {digest} for {name.digest}")
        pinned = f"{name.registry}/{name.repository}@{digest}"
        try:
            record = read_record(client=client, repository=name.repository, digest=digest)
        except PublishError as exc:
            return no(str(exc), digest=digest, reference=pinned)
        return _judge(ref=ref, pinned=pinned, digest=digest, record=record, client=client, repository=name.repository,
                      current_lock=current_lock)
    finally:
        client.close()


def _judge(*, ref, pinned, digest, record, client, repository, current_lock) -> Verification:
    base = dict(ref=ref, reference=pinned, digest=digest, sku=record.sku, lock_sha256=record.lock_sha256,
                gate_date=record.gate_date, image_id=record.image_id)
    no = lambda why: Verification(ok=False, reason=why, **base)  # noqa: E731
    if record.image_digest != digest:
        return no(f"the record is for {record.image_digest}, not {digest}")
    try:
        facts = verdict_facts(record.verdict)
    except PublishError as exc:
        return no(f"the record's verdict is unreadable: {exc}")
    if record.gate_decision != "pass" or facts.decision != "pass":
        return no(f"the gate did not pass ({facts.decision}: {facts.reason})")
    if facts.image_id != record.image_id or facts.lock_hash != record.lock_sha256:
        return no("the record's verdict names another image or lock than the record")
    try:
        if Lock.model_validate(record.lock).content_hash() != record.lock_sha256:
            return no("the record's lock does not hash to its lock_sha256")
    except ValueError as exc:
        return no(f"the record's lock is malformed: {str(exc)[:200]}")
    try:
        image = client.get_manifest(repository, digest)
    except NetworkError as exc:
        return no(f"cannot read the image manifest: {exc}")
    config = (image.json().get("config") or {}).get("digest")
    if config != record.image_id:
        return no(f"the image's config is {config}, the gate ran {record.image_id}")
    try:
        current = current_lock(record.sku)
    except SkupinError as exc:
        return no(f"cannot read the current lock of {record.sku}: {exc}")
    if current != record.lock_sha256:
        return no(f"gated with lock {record.lock_sha256[:12]}, the current lock of {record.sku} is {current[:12]}")
    return Verification(ok=True, **base)


def pull_verified(*, sku: str, target: RegistryTarget, docker, current_lock: CurrentLock = committed_lock_hash,
                  client_for: ClientFor = _default_client) -> tuple[Verification, str]:
    """Verify `<sku>:verified` and pull its digest; (verification, local image id). PublishError when not verified."""
    ref = target.reference(sku, tag=VERIFIED_TAG)
    result = verify_reference(ref=ref, current_lock=current_lock, client_for=lambda _host: client_for(target.url))
    if not result.ok or result.reference is None:
        raise PublishError(result.line())
    image_id = docker.pull(result.reference)
    if image_id != result.image_id:
        raise PublishError(f"pulled {result.reference} but the engine has image {image_id}, "
                           f"the record says {result.image_id}")
    return result, image_id


def verified_image_id(*, sku: str, target: RegistryTarget, timeout: float = 3.0) -> str | None:
    """The image id the record of `<sku>:verified` names (the SKU's currently verified image), or None.

    Any lock: this is the baseline a new build is compared with, typically gated under the lock
    before a point release. None when the registry does not answer or holds no such tag or record.
    """
    try:
        with RegistryClient(target.url, retries=0, timeout=timeout) as client:
            repository = target.repository(sku)
            digest = client.resolve(repository, VERIFIED_TAG)
            return read_record(client=client, repository=repository, digest=digest).image_id
    except SkupinError:
        return None
