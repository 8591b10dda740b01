"""The resolved stack: a checked manifest, its path, and the lock next to it with that lock's state."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from skupin.builder.catalog.lockfile import Lock
from skupin.builder.catalog.manifest import SkuManifest
from skupin.common.model import Frozen

LockState = Literal["ok", "unlocked", "stale"]


class ResolvedStack(Frozen):
    """A manifest that passed check (grammar and pin compatibility), its path, and its lock.

    `lock` is kept when it is stale too, so callers can say what moved; `current_lock` is the lock
    only while it matches the manifest: the one a render or a build may use.
    """

    manifest: SkuManifest
    manifest_path: Path
    lock: Lock | None = None
    lock_state: LockState = "unlocked"
    lock_note: str = ""

    @property
    def current_lock(self) -> Lock | None:
        """The lock when it is current (state ok), else None."""
        return self.lock if self.lock_state == "ok" else None
