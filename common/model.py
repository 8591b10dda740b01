"""The immutable base every typed object of the flow derives from: frozen, unknown fields rejected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict


def canonical_json(data: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace, ASCII): what content hashes and records are made of."""
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


class Frozen(BaseModel):
    """A frozen pydantic model that refuses unknown fields (DESIGN.md: one typed object per stage)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def write_json(self, path: Path) -> Path:
        """Write as stable, diff-friendly JSON (sorted keys, indent 2), replacing `path` atomically."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path
