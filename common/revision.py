"""Where a catalog comes from: its git repository's URL and commit, for the attestation's `source` field.

Read with `git` (bounded: a few seconds, small outputs). A catalog that is not a git checkout, or a host without
git, has no source (None), and the attestation says so by leaving the field out. Credentials in a remote URL
(`https://user:token@host/...`) are never kept.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from common.model import Frozen

_COMMIT = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")


class SourcePin(Frozen):
    """The catalog a publish ran from: repository URL (credentials stripped; "" when it has no remote), commit, and
    whether its checkout had uncommitted changes (then the commit alone does not say what was published)."""

    url: str
    revision: str
    dirty: bool


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout[:64 * 1024].decode("utf-8", "replace").strip()


def public_url(url: str) -> str:
    """`url` without user, password or token (scp-like `git@host:owner/repo` kept: it carries no secret)."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def catalog_source(root: Path) -> SourcePin | None:
    """The catalog's git source, or None when `root` is not inside a git checkout (or git is missing)."""
    revision = _git(root, "rev-parse", "HEAD")
    if revision is None or not _COMMIT.match(revision):
        return None
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".")
    url = _git(root, "config", "--get", "remote.origin.url") or ""
    return SourcePin(url=public_url(url), revision=revision, dirty=bool(status))
