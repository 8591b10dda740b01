"""The base families and accelerator vendors, declared once: each family's vendors and its Dockerfile template.

`Family` and `Vendor` are the one spelling of the names (the manifest's `base.family` and
`accelerator.vendor`, the compatibility data's `families` rows); ALL_FAMILIES says what each family
is for. A new family: its name in `Family`, its row here, its template
`builder/templates/<family>.Dockerfile.j2` and its compatibility rows in builder/data/compat.yaml
(tests/unit/test_families.py checks the four agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

Vendor = Literal["nvidia", "amd", "intel", "cpu"]
Family = Literal["cuda", "rocm", "xpu", "cpu"]


@dataclass(frozen=True, kw_only=True)
class FamilyInfo:
    """One base family: the accelerator vendors whose SKUs it builds."""

    name: Family
    vendors: tuple[Vendor, ...]

    @property
    def template(self) -> str:
        """Its child template under builder/templates/ (it extends base.Dockerfile.j2)."""
        return f"{self.name}.Dockerfile.j2"


ALL_FAMILIES: Final[dict[Family, FamilyInfo]] = {row.name: row for row in (
    FamilyInfo(name="cuda", vendors=("nvidia",)),
    FamilyInfo(name="rocm", vendors=("amd",)),
    FamilyInfo(name="xpu", vendors=("intel",)),
    FamilyInfo(name="cpu", vendors=("cpu",)),
)}
FAMILIES: Final[tuple[Family, ...]] = get_args(Family)
VENDORS: Final[tuple[Vendor, ...]] = get_args(Vendor)
