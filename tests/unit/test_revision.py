"""The catalog's git source signed into the attestation (skupin/common/revision.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from skupin.common.revision import catalog_source, public_url


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize(("url", "shown"), [
    ("https://x-access-token:ghs_secret@github.com/acme/catalog.git", "https://github.com/acme/catalog.git"),
    ("https://user@example.com:8443/acme/catalog?token=abc#frag", "https://example.com:8443/acme/catalog"),
    ("git@github.com:acme/catalog.git", "git@github.com:acme/catalog.git"),
    ("git::https://tok@host/o/r", ""),  # remote helpers: not cleaned with certainty, not kept
    ("persistent-https::https://tok@host/o/r", ""),
    ("https://u:p@host:abc/r", ""),  # a malformed port is not a crash
    ("https://u:p@h:99999/r", ""),
    ("https://[::1]:8080/r", "https://[::1]:8080/r"),
    ("file:///home/me/catalog", ""),  # a local path says nothing public
    ("/home/me/catalog", ""),
])
def test_a_remote_url_never_keeps_a_credential(url: str, shown: str) -> None:
    assert public_url(url) == shown


def test_the_source_is_the_checkouts_commit_and_says_when_it_had_changes(tmp_path: Path) -> None:
    assert catalog_source(tmp_path) is None  # not a git checkout: no source
    _git(tmp_path, "init", "-q")
    (tmp_path / "skus").mkdir()
    (tmp_path / "skus" / "a.yaml").write_text("a\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "one")
    _git(tmp_path, "remote", "add", "origin", "https://bot:secret@git.example/acme/catalog.git")
    clean = catalog_source(tmp_path)
    assert clean is not None and clean.revision == _git(tmp_path, "rev-parse", "HEAD")
    assert clean.url == "https://git.example/acme/catalog.git" and not clean.dirty
    (tmp_path / "verdict.json").write_text("{}")  # a CI job's downloaded artifact beside the catalog is not
    assert catalog_source(tmp_path) == clean
    (tmp_path / "skus" / "new.yaml").write_text("n\n")  # an untracked manifest is a change
    untracked = catalog_source(tmp_path)
    assert untracked is not None and untracked.dirty
    (tmp_path / "skus" / "new.yaml").unlink()
    (tmp_path / "skus" / "a.yaml").write_text("b\n")
    dirty = catalog_source(tmp_path)
    assert dirty is not None and dirty.dirty and dirty.revision == clean.revision


def test_an_untracked_catalog_inside_another_checkout_has_no_source(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("outer\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "outer")
    catalog = tmp_path / "vendor" / "catalog"
    (catalog / "skus").mkdir(parents=True)
    (catalog / "skus" / "a.yaml").write_text("a\n")
    assert catalog_source(catalog) is None  # the outer commit never contained it
