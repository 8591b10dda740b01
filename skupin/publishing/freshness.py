"""Freshness of a verified record, in the model of TUF: how old it is, which skupin made it, revocation and rollback.

A signature says who made a record, not that it is still the one to trust: whoever can write to a registry can
re-point `verified` at an old attestation that was honestly signed years ago. After the policy
(skupin/publishing/policy.py) accepts a record, `freshness_problems` refuses it when

- it was published longer ago than the trust policy's `max_age_days`, or it was gated or published by a skupin older
  than `min_skupin` (records of older versions lack facts this verifier relies on);
- its image digest or its signing key is revoked;
- it is older than the `verified` record this machine has already accepted for the same repository (a rollback:
  the seen store, one small file per repository under the state folder's `seen/`).

The trust policy is `keys/policy.yaml` of the catalog that counts for trust (skupin/common/paths.py: operator_trust),
read bounded, not through a link, without YAML aliases; without one the defaults below apply. A version tag and a
digest name one image on purpose, so the rollback rule applies to the moving `verified` tag only; age, version and
revocation apply to every reference.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from packaging.version import InvalidVersion, Version
from pydantic import Field, ValidationError

from skupin.common.errors import PublishError
from skupin.common.files import write_atomic
from skupin.common.model import Frozen
from skupin.common.paths import state_dir, trust_problem
from skupin.common.untrusted import UntrustedInputError, load_json, load_yaml, read_regular_file
from skupin.publishing.attest import VerificationPredicate

POLICY_PATH = "keys/policy.yaml"  # relative to the catalog
MAX_POLICY_BYTES = 256 * 1024
MAX_SEEN_BYTES = 16 * 1024
DEFAULT_MAX_AGE_DAYS = 365.0
OLDEST_SKUPIN = "0.1.0"  # the first release whose records carry every field verify compares


class TrustPolicy(Frozen):
    """What a catalog says about how fresh a record must be, and what is revoked."""

    max_age_days: float | None = Field(DEFAULT_MAX_AGE_DAYS, gt=0, allow_inf_nan=False,
                                       description="Refuse records published longer ago; null: no limit")
    min_skupin: str = Field(OLDEST_SKUPIN, description="Refuse records gated or published by an older skupin")
    revoked_digests: tuple[Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")], ...] = Field(
        (), description="Image digests (sha256:<64 hex>) never to verify again")
    revoked_keys: tuple[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")], ...] = Field(
        (), description="Key ids (the 64 hex of sha256 over the public key; a prefix would revoke nothing) never to "
        "trust again")
    source: str = Field("defaults", description="Where this policy came from")


def load_policy(catalog: Path | None) -> TrustPolicy:
    """The catalog's keys/policy.yaml, or the defaults when there is no catalog or it has none. PublishError naming the
    file and field when it is unreadable or malformed (a policy that cannot be read is never silently the default)."""
    if catalog is None:
        return TrustPolicy()
    path = catalog / POLICY_PATH
    if not path.exists() and not path.is_symlink():
        return TrustPolicy()
    try:
        data = load_yaml(read_regular_file(path, max_bytes=MAX_POLICY_BYTES), source=str(path), max_bytes=MAX_POLICY_BYTES)
        policy = TrustPolicy.model_validate({**(data or {}), "source": str(path)})
        Version(policy.min_skupin)
    except UntrustedInputError as exc:
        raise PublishError(str(exc)) from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(top)"
        raise PublishError(f"{path}: {field}: {first['msg']}; fix: see docs/guide-operator.md, 'Freshness'") from exc
    except InvalidVersion as exc:
        raise PublishError(f"{path}: min_skupin: not a version ({exc}); fix: e.g. min_skupin: 0.1.0") from exc
    return policy


def _when(text: str | None) -> datetime | None:
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _older_than(version: str | None, floor: str) -> bool:
    try:
        return version is None or Version(version) < Version(floor)
    except InvalidVersion:
        return True


def freshness_problems(predicate: VerificationPredicate, *, digest: str, keyid: str | None, policy: TrustPolicy,
                       now: datetime | None = None) -> list[str]:
    """Every reason the (signed, policy-accepted) record is not fresh enough to trust (empty = fine)."""
    out: list[str] = []
    now = now or datetime.now(UTC)
    published = _when(predicate.published)
    if published is None:
        out.append(f"the record's publish time {predicate.published!r} is not a time")
    elif (published - now).total_seconds() > 300:  # clocks disagree by minutes, not by more
        out.append(f"the record claims to be published in the future ({predicate.published})")
    elif policy.max_age_days is not None and (now - published).total_seconds() > policy.max_age_days * 86400:
        out.append(f"the record was published {(now - published).days} days ago ({predicate.published}), more than "
                   f"the {policy.max_age_days:g} days the trust policy ({policy.source}) allows; fix: republish "
                   "after a fresh gate")
    for what, version in (("gated", predicate.gate_tool_version), ("published", predicate.tool_version)):
        if _older_than(version, policy.min_skupin):
            out.append(f"the record was {what} by skupin {version or '(unknown)'}, older than {policy.min_skupin} "
                       f"that the trust policy ({policy.source}) requires")
    if digest in policy.revoked_digests:
        out.append(f"the image {digest} is revoked by the trust policy ({policy.source})")
    if keyid is not None and keyid in policy.revoked_keys:
        out.append(f"the signing key {keyid[:12]} is revoked by the trust policy ({policy.source})")
    return out


class Seen(Frozen):
    """The newest `verified` record this machine accepted for one repository."""

    repository: str
    digest: str
    published: str


def _seen_path(repository: str, folder: Path | None) -> Path:
    name = hashlib.sha256(repository.encode()).hexdigest()[:32]
    return (folder or state_dir() / "seen") / f"{name}.json"


def _unsafe_store(path: Path) -> str | None:
    """Why the record of what was verified cannot be trusted: its folder, the state folder or the file is another
    user's, writable by others or a link (someone else could roll this machine back, or refuse the newest release)."""
    for place in (path.parent.parent, path.parent, path):
        if (why := trust_problem(place)) is not None:
            return why
    return None


def last_seen(repository: str, *, folder: Path | None = None) -> Seen | None:
    path = _seen_path(repository, folder)
    if (why := _unsafe_store(path)) is not None:
        raise PublishError(f"{why}: this machine's record of verified images cannot be trusted; fix: make the state "
                           "folder yours and not writable by others (or set SKUPIN_STATE to one that is)")
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data: Any = load_json(read_regular_file(path, max_bytes=MAX_SEEN_BYTES), source=str(path),
                              max_bytes=MAX_SEEN_BYTES, max_depth=4)
        seen = Seen.model_validate(data)
    except (UntrustedInputError, ValidationError) as exc:
        raise PublishError(f"{path}: this machine's record of the last verified image is unreadable ({exc}); fix: "
                           "remove it to trust the registry's current record afresh") from exc
    return seen if seen.repository == repository else None


def rollback_problem(predicate: VerificationPredicate, *, repository: str, digest: str,
                     folder: Path | None = None) -> str | None:
    """Why accepting this `verified` record would roll this machine back to an older one (None: it would not)."""
    seen = last_seen(repository, folder=folder)
    if seen is None or seen.digest == digest:
        return None
    mine, theirs = _when(predicate.published), _when(seen.published)
    if mine is not None and theirs is not None and mine < theirs:
        return (f"the record (published {predicate.published}) is older than the one this machine verified for "
                f"{repository} before ({seen.digest[:19]}, published {seen.published}): a rollback; fix: if the newer "
                f"image was withdrawn on purpose, remove {_seen_path(repository, folder)}")
    return None


def remember(predicate: VerificationPredicate, *, repository: str, digest: str, folder: Path | None = None) -> None:
    """Record an accepted `verified` record when it is the newest seen for `repository` (best effort: a read-only state
    folder leaves verification as it was)."""
    seen = last_seen(repository, folder=folder)
    mine = _when(predicate.published)
    if seen is not None and (mine is None or (_when(seen.published) or mine) >= mine):
        return
    path = _seen_path(repository, folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(Seen(repository=repository, digest=digest, published=predicate.published)
                                      .model_dump(mode="json"), sort_keys=True) + "\n")
    except OSError:
        pass
