"""Where a catalog comes from: its git repository's URL and commit, for the attestation's `source` field.

Read with `git` (no shell, 10 s per call, `--no-optional-locks` so a concurrent git is never blocked). The catalog
must be the top of its own checkout or inside it and tracked there; a catalog that is not (no git, not a checkout,
an untracked folder inside some other repository) has no source (None), and the attestation says so by leaving the
field out. `dirty` is true when a tracked file under the catalog differs from the commit, or an untracked file sits
in one of its input folders (CATALOG_INPUTS: a new manifest, lock or template).
Only a plain, credential-free URL is kept: user, password or token parts are dropped, and a URL that cannot be
cleaned with certainty (remote helpers `x::url`, local paths, `file://`, malformed ports) is recorded as "".
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from skupin.common.model import Frozen

_COMMIT = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
_SCP = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[A-Za-z0-9._/~-]+$")  # git@host:owner/repo(.git)
_MAX_OUTPUT = 64 * 1024
CATALOG_INPUTS = ("skus", "templates", "gates", "keys")  # the catalog folders an image or its gate reads


class SourcePin(Frozen):
    """The catalog a publish ran from: repository URL (credentials stripped; "" when it has none that can be shown),
    commit, and whether the catalog had changes against it (then the commit alone does not say what was published)."""

    url: str
    revision: str
    dirty: bool


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 or len(proc.stdout) > _MAX_OUTPUT:
        return None
    return proc.stdout.decode("utf-8", "replace").strip()


def public_url(url: str) -> str:
    """`url` as it may be signed and shown: scheme, host, port and path of an http(s), ssh or git URL, or a scp-like
    `user@host:path` (the user there is an ssh login, not a secret); "" for anything else."""
    if _SCP.match(url):
        return url
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*::", url):  # a remote helper's `transport::address`
        return ""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return ""
    if parts.scheme not in ("https", "http", "ssh", "git") or not parts.hostname:
        return ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return urlunsplit((parts.scheme, f"{host}:{port}" if port else host, parts.path, "", ""))


def catalog_source(root: Path) -> SourcePin | None:
    """The catalog's git source, or None when `root` is not tracked in a git checkout (or git is missing)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    revision = _git(root, "rev-parse", "HEAD")
    if top is None or revision is None or not _COMMIT.match(revision):
        return None
    try:
        inside = Path(root).resolve().is_relative_to(Path(top).resolve())
    except OSError:
        return None
    tracked = _git(root, "ls-files", "--", ".")
    if not inside or not tracked:  # an untracked folder inside another checkout is not that checkout's content
        return None
    changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".")  # tracked files, anywhere
    # untracked files count where they are catalog inputs (a new manifest or lock, a template), not elsewhere:
    # a CI job's downloaded verdict and build records sit in the same folder
    added = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *CATALOG_INPUTS)
    url = _git(root, "config", "--get", "remote.origin.url") or ""
    dirty = changed is None or added is None or bool(changed) or bool(added)
    return SourcePin(url=public_url(url), revision=revision, dirty=dirty)
