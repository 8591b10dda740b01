"""Freshness in the model of TUF (issue 30): age, the skupin that made a record, revocation, rollback of `verified`,
and the trust policy read bounded (no YAML alias bombs, no links)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from skupin.common.errors import PublishError
from skupin.common.untrusted import UntrustedInputError, load_yaml
from skupin.publishing.attest import ReferencePin, VerificationPredicate
from skupin.publishing.freshness import (
    TrustPolicy,
    freshness_problems,
    last_seen,
    load_policy,
    remember,
    rollback_problem,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DIGEST = "sha256:" + "a" * 64
KEY = "9" * 64


def record(*, published: datetime = NOW - timedelta(days=2), gate: str | None = "0.1.0", tool: str = "0.1.0",
           ) -> VerificationPredicate:
    return VerificationPredicate(sku="cpu-x86_64", repository="cpu-x86_64", image_id="sha256:" + "b" * 64,
                                 lock_sha256="c" * 64, lock={}, reference=ReferencePin(sha256="d" * 64), tolerance=None,
                                 decision="pass", reason="passed", checks=(), verdict_sha256="e" * 64,
                                 gate_created=published.isoformat(), gate_tool_version=gate, tool_version=tool,
                                 published=published.isoformat())


def test_a_fresh_record_of_this_skupin_passes() -> None:
    assert freshness_problems(record(), digest=DIGEST, keyid=KEY, policy=TrustPolicy(), now=NOW) == []


def test_an_old_record_made_by_an_old_skupin_is_refused_for_both() -> None:
    old = record(published=datetime(2020, 3, 1, tzinfo=UTC), gate="0.0.1", tool="0.0.1")
    problems = freshness_problems(old, digest=DIGEST, keyid=KEY, policy=TrustPolicy(), now=NOW)
    assert any("days ago" in p and "365 days" in p for p in problems)
    assert any("gated by skupin 0.0.1, older than 0.1.0" in p for p in problems)
    assert any("published by skupin 0.0.1" in p for p in problems)


def test_the_policy_sets_the_age_and_the_version_floor() -> None:
    week_old = record(published=NOW - timedelta(days=8))
    assert freshness_problems(week_old, digest=DIGEST, keyid=KEY, policy=TrustPolicy(max_age_days=7), now=NOW)
    assert not freshness_problems(week_old, digest=DIGEST, keyid=KEY, policy=TrustPolicy(max_age_days=None), now=NOW)
    assert freshness_problems(record(), digest=DIGEST, keyid=KEY, policy=TrustPolicy(min_skupin="0.2"), now=NOW)
    assert freshness_problems(record(gate=None), digest=DIGEST, keyid=KEY, policy=TrustPolicy(), now=NOW)


def test_a_record_from_the_future_is_refused() -> None:
    ahead = record(published=NOW + timedelta(days=30))
    assert any("future" in p for p in freshness_problems(ahead, digest=DIGEST, keyid=KEY, policy=TrustPolicy(), now=NOW))


def test_revoked_digests_and_keys_are_refused() -> None:
    policy = TrustPolicy(revoked_digests=(DIGEST,), revoked_keys=(KEY,))
    problems = freshness_problems(record(), digest=DIGEST, keyid=KEY, policy=policy, now=NOW)
    assert any("image sha256:aaaa" in p and "revoked" in p for p in problems)
    assert any("signing key 999999999999" in p and "revoked" in p for p in problems)


def test_verified_never_rolls_back_to_an_older_record(tmp_path: Path) -> None:
    repo = "127.0.0.1:5000/cpu-x86_64"
    newer, older = record(published=NOW - timedelta(days=1)), record(published=NOW - timedelta(days=40))
    assert rollback_problem(newer, repository=repo, digest=DIGEST, folder=tmp_path) is None
    remember(newer, repository=repo, digest=DIGEST, folder=tmp_path)
    other = "sha256:" + "f" * 64
    why = rollback_problem(older, repository=repo, digest=other, folder=tmp_path)
    assert why and "rollback" in why and "remove" in why
    assert rollback_problem(newer, repository=repo, digest=DIGEST, folder=tmp_path) is None  # the same record again
    remember(older, repository=repo, digest=other, folder=tmp_path)  # an older one never replaces the newest seen
    seen = last_seen(repo, folder=tmp_path)
    assert seen is not None and seen.digest == DIGEST
    assert rollback_problem(older, repository="127.0.0.1:5000/other", digest=other, folder=tmp_path) is None


def test_a_seen_record_that_is_a_link_is_refused(tmp_path: Path) -> None:
    repo = "r/x"
    remember(record(), repository=repo, digest=DIGEST, folder=tmp_path)
    (seen,) = tmp_path.iterdir()
    seen.unlink()
    seen.symlink_to("/dev/zero")
    with pytest.raises(PublishError, match="is a link: this machine's record of verified images cannot be trusted"):
        last_seen(repo, folder=tmp_path)


def _catalog(tmp_path: Path, text: str) -> Path:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "policy.yaml").write_text(text)
    return tmp_path


def test_the_catalogs_policy_is_read(tmp_path: Path) -> None:
    policy = load_policy(_catalog(tmp_path, f"max_age_days: 30\nmin_skupin: '0.1.0'\nrevoked_digests: ['{DIGEST}']\n"))
    assert policy.max_age_days == 30 and policy.revoked_digests == (DIGEST,) and policy.source.endswith("policy.yaml")
    assert load_policy(None) == TrustPolicy() and load_policy(tmp_path / "elsewhere") == TrustPolicy()


@pytest.mark.parametrize(("text", "match"), [
    ("max_age_days: -3\n", "max_age_days"),
    ("max_age_dayz: 3\n", "max_age_dayz"),
    ("min_skupin: 'not a version'\n", "min_skupin"),
    ("a: &x [1, 2]\nb: *x\n", "aliases are refused"),
])
def test_a_malformed_policy_is_an_error_naming_the_field(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(PublishError, match=match):
        load_policy(_catalog(tmp_path, text))


def test_a_policy_that_links_elsewhere_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "policy.yaml").symlink_to("/dev/zero")
    with pytest.raises(PublishError, match="policy.yaml"):
        load_policy(tmp_path)


def test_a_yaml_alias_bomb_is_refused_before_it_expands() -> None:
    bomb = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                                                    for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    assert len(bomb) < 1000
    with pytest.raises(UntrustedInputError, match="aliases"):  # refused on the event stream: nothing was built
        load_yaml(bomb, source="bomb.yaml", max_bytes=4096)


def test_yaml_depth_and_size_are_bounded() -> None:
    with pytest.raises(UntrustedInputError, match="nested"):
        load_yaml("[" * 100 + "]" * 100, source="deep.yaml", max_bytes=4096)
    with pytest.raises(UntrustedInputError, match="exceed"):
        load_yaml("a: 1\n" * 1000, source="big.yaml", max_bytes=100)
    assert load_yaml("a: [1, {b: 2}]\n", source="ok.yaml", max_bytes=100) == {"a": [1, {"b": 2}]}


def test_a_prefix_of_a_key_id_is_refused_rather_than_revoking_nothing(tmp_path: Path) -> None:
    with pytest.raises(PublishError, match="revoked_keys"):
        load_policy(_catalog(tmp_path, "revoked_keys: ['9a1b2c3d4e5f']\n"))


def test_a_seen_store_others_can_write_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "state" / "seen"
    remember(record(), repository="r/x", digest=DIGEST, folder=store)
    store.chmod(0o777)
    with pytest.raises(PublishError, match="cannot be trusted"):
        last_seen("r/x", folder=store)


@pytest.mark.parametrize("text", ["junk: 2001-13-45\n", "a: " + "1" * 5000 + "\n"])
def test_a_value_yaml_cannot_build_is_malformed_input_not_a_traceback(text: str) -> None:
    with pytest.raises(UntrustedInputError, match="not valid YAML"):
        load_yaml(text, source="x.yaml", max_bytes=1 << 16)
