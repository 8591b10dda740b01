"""Families and vendors declared once (builder/families.py): the manifest, the templates and the data agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.compat import check_compat, load_compat
from builder.families import ALL_FAMILIES, FAMILIES, VENDORS
from builder.manifest import SkuManifest, load_manifest, manifest_schema
from common.errors import CompatError

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "builder" / "templates"


def test_the_table_has_one_row_per_family_and_serves_every_vendor() -> None:
    assert tuple(ALL_FAMILIES) == FAMILIES == ("cuda", "rocm", "xpu", "cpu")
    assert all(row.name == name for name, row in ALL_FAMILIES.items())
    assert {v for row in ALL_FAMILIES.values() for v in row.vendors} == set(VENDORS)


def test_every_family_has_its_template_and_every_template_a_family() -> None:
    children = {p.name for p in TEMPLATES.glob("*.Dockerfile.j2")} - {"base.Dockerfile.j2"}
    assert children == {row.template for row in ALL_FAMILIES.values()}


def test_the_manifest_schema_spells_the_names_from_the_table() -> None:
    defs = manifest_schema()["$defs"]
    assert tuple(defs["Base"]["properties"]["family"]["enum"]) == FAMILIES
    assert tuple(defs["Accelerator"]["properties"]["vendor"]["enum"]) == VENDORS


def test_the_compatibility_data_has_one_row_per_family(tmp_path: Path) -> None:
    assert sorted(row.family for row in load_compat().families) == sorted(FAMILIES)
    broken = tmp_path / "compat.yaml"
    text = (REPO / "builder/data/compat.yaml").read_text(encoding="utf-8")
    broken.write_text("\n".join(line for line in text.splitlines() if not line.startswith("  - {family: xpu,")) + "\n")
    with pytest.raises(CompatError, match="each family needs exactly one row; not so for xpu"):
        load_compat(broken)


def test_a_vendor_outside_its_family_is_named_with_the_family_table() -> None:
    mi300x: SkuManifest = load_manifest(REPO / "skus/amd-mi300x-vllm.yaml")
    wrong = mi300x.model_copy(update={"accelerator": mi300x.accelerator.model_copy(update={"vendor": "intel"})})
    lines = [str(p) for p in check_compat(manifest=wrong, file="skus/x.yaml")]
    assert "skus/x.yaml: accelerator.vendor: base.family rocm is for vendor amd, not intel; expected amd; " \
           "fix: set accelerator.vendor: amd or choose the base family of intel" in lines
