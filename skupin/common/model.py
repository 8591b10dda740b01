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

    def json_data(self) -> dict[str, Any]:
        """The JSON form written to files and embedded in records (a model may leave out what it has not set)."""
        return self.model_dump(mode="json")

    def write_json(self, path: Path) -> Path:
        """Write `json_data()` as stable, diff-friendly JSON (sorted keys, indent 2), replacing `path` atomically."""
        from skupin.common.files import write_atomic

        return write_atomic(path, json.dumps(self.json_data(), indent=2, sort_keys=True) + "\n")
