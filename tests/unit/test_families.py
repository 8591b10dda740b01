"""Families declared once (builder/catalog/families.py: ALL_FAMILIES): the names, the manifest, the templates and the
data agree, and what the code asks of a family comes from its row."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from skupin.builder.catalog.compat import check_compat, load_compat
from skupin.builder.catalog.families import ALL_FAMILIES, FAMILIES, VENDORS, Family, Vendor
from skupin.builder.catalog.manifest import SkuManifest, load_manifest, manifest_schema
from skupin.common.errors import CompatError

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "templates"


def test_the_table_has_one_row_per_family_and_serves_every_vendor() -> None:
    assert tuple(ALL_FAMILIES) == FAMILIES and {"cuda", "rocm", "xpu", "cpu"} <= set(FAMILIES)
    assert all(row.name == name for name, row in ALL_FAMILIES.items())
    assert {v for row in ALL_FAMILIES.values() for v in row.vendors} == set(VENDORS)
    assert get_args(Family) == FAMILIES and get_args(Vendor) == VENDORS  # the names are the registry's, nowhere else


def test_the_rows_say_what_the_checks_ask_of_a_family() -> None:
    assert {name: ALL_FAMILIES[name].driver_check for name in ("cuda", "rocm", "xpu", "cpu")} == \
        {"cuda": "minimum", "rocm": "series", "xpu": "none", "cpu": "none"}
    assert [name for name in ("cuda", "rocm", "xpu", "cpu") if ALL_FAMILIES[name].builds_sdist] == ["cpu"]


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


def test_an_engine_sdist_is_refused_on_a_family_whose_template_cannot_build_it() -> None:
    sku = load_manifest(REPO / "skus/cpu-x86_64-llamacpp.yaml")
    data = sku.model_dump(mode="json", by_alias=True, exclude_unset=True)
    data["base"]["family"] = "cuda"
    with pytest.raises(ValueError, match=r"kind sdist is built by the (\w+ or )*cpu( or \w+)* family's template only, "
                                         r"not cuda's \(.*templates/cpu.Dockerfile.j2"):
        SkuManifest.model_validate(data)


def test_each_family_names_its_torch_device_and_the_gpu_families_need_an_accelerator() -> None:
    from skupin.builder.catalog.families import ALL_FAMILIES

    assert all(row.torch_device for row in ALL_FAMILIES.values())
    assert not ALL_FAMILIES["cpu"].accelerated
    assert all(ALL_FAMILIES[name].accelerated for name in ("cuda", "rocm", "xpu"))  # a GPU runner and a host driver
