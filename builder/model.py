"""The immutable base every typed object of the flow derives from: frozen, unknown fields rejected."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """A frozen pydantic model that refuses unknown fields (DESIGN.md: one typed object per stage)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
