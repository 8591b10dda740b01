"""Operator trust never comes from an unowned folder (issue 30): a catalog planted in a shared parent is passed over by
verify/pull/inspect, key files are read bounded and never through a link or a FIFO, and every answer names its anchors."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from skupin.common import paths
from skupin.common.errors import ImageRefError, NetworkError, PublishError
from skupin.publishing import attest
from skupin.publishing.verify import verify_reference

SIGNER = attest.Signer(attest.ec.generate_private_key(attest.ec.SECP256R1()))
STRANGER = 4242  # a uid that is neither root nor the test's user
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to give files to another user")


def _catalog(folder: Path, *, owner: int | None = None, mode: int = 0o755) -> Path:
    (folder / "skus").mkdir(parents=True)
    (folder / "keys" / "trusted").mkdir(parents=True)
    (folder / "keys" / "trusted" / "planted.pub").write_bytes(SIGNER.public_pem())
    for path in (folder, folder / "skus", folder / "keys", folder / "keys" / "trusted"):
        path.chmod(mode)
        if owner is not None:
            os.chown(path, owner, owner)
    return folder


@pytest.fixture
def operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An operator in a fresh folder below a world-writable, sticky shared parent (as /tmp is), with their own cache."""
    for var in (paths.ROOT_ENV, paths.STATE_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    monkeypatch.setattr(paths, "_root", None)
    monkeypatch.setattr(paths, "_passed_over", {})
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    work = shared / "op"
    work.mkdir()
    monkeypatch.chdir(work)
    return shared


@as_root
def test_a_catalog_planted_by_another_user_in_a_shared_parent_is_passed_over(operator: Path) -> None:
    _catalog(operator, owner=STRANGER)
    assert paths.find_catalog() == operator.resolve()  # build-side commands still see it (they act, not trust)
    with paths.operator_trust():
        assert paths.find_catalog() is None
        assert all(not str(d).startswith(str(operator.resolve() / "keys")) for d in attest.trusted_dirs())
        assert len(attest.trusted_keys()) == 0  # the planted key is not trusted
    assert "owned by uid 4242" in paths.passed_over()[str(operator.resolve())]


def test_a_catalog_others_can_write_is_passed_over_even_when_root_owns_it(operator: Path) -> None:
    _catalog(operator, mode=0o777)
    with paths.operator_trust():
        assert paths.find_catalog() is None
    assert "can be written by others" in paths.passed_over()[str(operator.resolve())]


def test_one_writable_trust_folder_is_enough_to_pass_the_catalog_over(operator: Path) -> None:
    cat = _catalog(operator)
    (cat / "keys" / "trusted").chmod(0o777)
    with paths.operator_trust():
        assert paths.find_catalog() is None
    assert "keys/trusted can be written" in paths.passed_over()[str(cat.resolve())]


@as_root
def test_a_catalog_named_with_root_counts_whoever_owns_it(operator: Path) -> None:
    cat = _catalog(operator, owner=STRANGER)
    paths.use_root(cat)
    try:
        with paths.operator_trust():
            assert paths.find_catalog() == cat.resolve()
    finally:
        paths.use_root(None)


def test_an_owned_catalog_is_trusted_and_its_keys_are_read(operator: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    own = _catalog(tmp_path / "mine")
    monkeypatch.chdir(own)
    with paths.operator_trust():
        assert paths.find_catalog() == own.resolve()
        assert len(attest.trusted_keys()) == 1
    assert paths.passed_over() == {}


def test_a_trusted_key_that_links_to_dev_zero_is_refused_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cat = _catalog(tmp_path / "cat")
    (cat / "keys" / "trusted" / "zero.pub").symlink_to("/dev/zero")
    monkeypatch.chdir(cat)
    monkeypatch.setattr(paths, "_root", None)
    monkeypatch.delenv(paths.ROOT_ENV, raising=False)
    with pytest.raises(PublishError, match="zero.pub is a link"):
        attest.trusted_keys()


def test_a_fifo_as_a_key_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "key.pub"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            attest.trusted_keys([fifo])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading a FIFO as a key blocked"
    assert isinstance(outcome[0], PublishError) and "not a regular file" in str(outcome[0])


def test_a_huge_key_file_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    big = tmp_path / "big.pub"
    with big.open("wb") as handle:
        handle.truncate(attest.MAX_KEY_BYTES + 1)
    with pytest.raises(PublishError, match="exceed the limit"):
        attest.trusted_keys([big])


def test_a_key_named_with_key_may_be_a_link_the_operator_chose(tmp_path: Path) -> None:
    real = tmp_path / "real.pub"
    real.write_bytes(SIGNER.public_pem())
    (tmp_path / "link.pub").symlink_to(real)
    assert len(attest.trusted_keys([tmp_path / "link.pub"])) == 1


class _Unreachable:
    """A registry client whose registry does not answer (no request is sent)."""

    def __init__(self, host: str) -> None:
        self.host = host

    def resolve(self, repo: str, ref: str) -> str:
        raise NetworkError(f"registry {self.host}: GET /v2/{repo}/manifests/{ref} failed: connection refused")

    def close(self) -> None:
        pass


@as_root
def test_every_verify_answer_names_its_trust_anchors(operator: Path, tmp_path: Path) -> None:
    _catalog(operator, owner=STRANGER)
    key = tmp_path / "operator.pub"
    key.write_bytes(SIGNER.public_pem())
    with pytest.raises(ImageRefError, match="give a tag or a digest"):  # bad input (exit 2), before any request
        verify_reference(ref="127.0.0.1:9/cpu-x86_64", trusted=[key])
    answer = verify_reference(ref="127.0.0.1:9/cpu-x86_64:verified", trusted=[key], client_for=_Unreachable)
    assert not answer.ok and answer.unreachable and "cannot resolve it" in answer.reason
    assert answer.trust[0] == f"key {SIGNER.keyid[:12]} ({key})"
    assert "no catalog (signature, subject, SKU and gate only)" in answer.trust
    assert any(a.startswith(f"catalog {operator.resolve()} passed over: ") and "--root" in a for a in answer.trust)
    assert answer.trust_line().startswith("trust anchors: key ")


def test_a_key_others_can_write_is_refused_for_publish_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cat = _catalog(tmp_path / "cat")
    (cat / "keys" / "trusted" / "planted.pub").chmod(0o666)
    monkeypatch.chdir(cat)
    monkeypatch.setattr(paths, "_root", None)
    monkeypatch.delenv(paths.ROOT_ENV, raising=False)
    with pytest.raises(PublishError, match="planted.pub can be written by others"):
        attest.trusted_keys()  # outside operator_trust: publish and the verdict envelope check read keys this way


def test_a_reference_bundle_whose_sums_link_to_dev_zero_is_refused(tmp_path: Path) -> None:
    from skupin.common.errors import BundleError
    from skupin.gates.refdata.bundle import bundle_sha256

    (tmp_path / "SHA256SUMS").symlink_to("/dev/zero")
    with pytest.raises(BundleError, match="SHA256SUMS"):
        bundle_sha256(tmp_path)
