"""The catalog's git source signed into the attestation (common/revision.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.revision import catalog_source, public_url


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize(("url", "shown"), [
    ("https://x-access-token:ghs_secret@github.com/acme/catalog.git", "https://github.com/acme/catalog.git"),
    ("https://user@example.com:8443/acme/catalog?token=abc#frag", "https://example.com:8443/acme/catalog"),
    ("git@github.com:acme/catalog.git", "git@github.com:acme/catalog.git"),
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
    (tmp_path / "skus" / "a.yaml").write_text("b\n")
    dirty = catalog_source(tmp_path)
    assert dirty is not None and dirty.dirty and dirty.revision == clean.revision
