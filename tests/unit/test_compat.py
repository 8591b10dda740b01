"""Compatibility rules: the rows of compat-facts.md accepted and rejected, error lines by content."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version
from pydantic import ValidationError

from skupin.builder.catalog.compat import CompatData, check_compat, load_compat
from skupin.builder.catalog.manifest import SkuManifest, load_manifest

ROOT = Path(__file__).resolve().parents[2]
SKUS = ROOT / "skus"

# compat-facts.md: torch -> triton (Requires-Dist of torch's Linux x86_64 wheels on PyPI).
TORCH_TRITON = [
    ("2.4.0", "3.0.0", "12.1"),
    ("2.5.1", "3.1.0", "12.4"),
    ("2.6.0", "3.2.0", "12.4"),
    ("2.7.0", "3.3.0", "12.6"),
    ("2.7.1", "3.3.1", "12.6"),
    ("2.8.0", "3.4.0", "12.8"),
    ("2.9.0", "3.5.0", "12.8"),
    ("2.9.1", "3.5.1", "12.8"),
    ("2.10.0", "3.6.0", "12.8"),
    ("2.11.0", "3.6.0", "13.0.2"),
    ("2.13.0", "3.7.1", "13.0.3"),
    ("2.14.0", "3.8.0", "13.0.3"),  # ~=3.8.0
]
# A triton that is wrong for each torch above (the neighbour release).
WRONG_TRITON = {"3.0.0": "3.1.0", "3.1.0": "3.0.0", "3.2.0": "3.3.0", "3.3.0": "3.3.1", "3.3.1": "3.3.0",
                "3.4.0": "3.5.0", "3.5.0": "3.5.1", "3.5.1": "3.5.0", "3.6.0": "3.7.1", "3.7.1": "3.6.0",
                "3.8.0": "3.7.1"}

# compat-facts.md: vLLM -> torch (Requires-Dist of vllm on PyPI).
VLLM_TORCH = [
    ("0.8.5", "2.6.0"), ("0.9.2", "2.7.0"), ("0.10.0", "2.7.1"), ("0.10.1", "2.7.1"), ("0.10.1.1", "2.7.1"),
    ("0.10.2", "2.8.0"), ("0.11.0", "2.8.0"), ("0.11.2", "2.9.0"), ("0.12.0", "2.9.0"), ("0.13.0", "2.9.0"),
    ("0.14.0", "2.9.1"), ("0.15.0", "2.9.1"), ("0.16.0", "2.9.1"), ("0.22.0", "2.11.0"), ("0.25.0", "2.11.0"),
    ("0.28.0", "2.13.0"), ("0.30.0", "2.13.0"), ("0.33.0", "2.14.0"),
]

# compat-facts.md: CUDA toolkit -> minimum Linux driver (CUDA release notes, table 3).
CUDA_DRIVER = [
    ("12.0", "525.60.13"), ("12.1", "530.30.02"), ("12.2", "535.54.03"), ("12.3", "545.23.06"),
    ("12.4", "550.54.14"), ("12.5", "555.42.02"), ("12.6", "560.28.03"), ("12.8", "570.26"),
    ("13.0", "580.65.06"), ("13.2", "595.45.04"),
]

# compat-facts.md: torch minor -> ROCm series of stable ROCm wheels.
TORCH_ROCM = [("2.4", "6.1"), ("2.5", "6.2"), ("2.6", "6.2"), ("2.7", "6.3"), ("2.8", "6.4"), ("2.9", "6.4"),
              ("2.10", "7.1"), ("2.11", "7.2")]

FILE = "skus/test.yaml"


@pytest.fixture(scope="module")
def h200() -> SkuManifest:
    return load_manifest(SKUS / "nvidia-h200-vllm.yaml")


@pytest.fixture(scope="module")
def mi300x() -> SkuManifest:
    return load_manifest(SKUS / "amd-mi300x-vllm.yaml")


@pytest.fixture(scope="module")
def cpu() -> SkuManifest:
    return load_manifest(SKUS / "cpu-x86_64.yaml")


def with_pins(manifest: SkuManifest, **pins: dict) -> SkuManifest:
    """A copy of `manifest` whose pins take the given field updates."""
    stack = manifest.stack
    new = {name: getattr(stack, name).model_copy(update=update) for name, update in pins.items()}
    return manifest.model_copy(update={"stack": stack.model_copy(update=new)})


def no_engine(manifest: SkuManifest) -> SkuManifest:
    return with_pins(manifest, engine={"name": "none", "version": "none", "reason": "test"})


def lines(manifest: SkuManifest) -> list[str]:
    return [str(p) for p in check_compat(manifest=manifest, file=FILE)]


def fields(manifest: SkuManifest) -> list[str]:
    return [p.field for p in check_compat(manifest=manifest, file=FILE)]


# ---------------------------------------------------------------- the data itself


def test_load_compat_is_frozen_and_cached():
    data = load_compat()
    assert isinstance(data, CompatData)
    assert load_compat() is data
    with pytest.raises(ValidationError):
        data.families = ()  # type: ignore[misc]


def test_every_row_names_source_and_date():
    data = load_compat()
    for table in ("families", "torch_compiler", "torch_rocm", "engine_torch", "cuda_driver", "variants"):
        rows = getattr(data, table)
        assert rows, table
        for row in rows:
            assert row.source.strip() and row.date.year >= 2025, (table, row)


@pytest.mark.parametrize("sku", sorted(p.stem for p in SKUS.glob("*.yaml")))
def test_every_shipped_sku_is_compatible(sku):
    manifest = load_manifest(SKUS / f"{sku}.yaml")
    assert check_compat(manifest=manifest, file=f"skus/{sku}.yaml") == []


# ---------------------------------------------------------------- torch <-> triton


@pytest.mark.parametrize(("torch", "triton", "runtime"), TORCH_TRITON)
def test_torch_triton_row_accepted(h200, torch, triton, runtime):
    m = no_engine(with_pins(h200, framework={"version": torch}, compiler={"version": triton}))
    assert "stack.compiler.version" not in fields(m)


@pytest.mark.parametrize(("torch", "triton", "runtime"), TORCH_TRITON)
def test_torch_triton_row_rejected_with_wrong_triton(h200, torch, triton, runtime):
    wrong = WRONG_TRITON[triton]
    m = no_engine(with_pins(h200, framework={"version": torch}, compiler={"version": wrong}))
    found = [x for x in lines(m) if ": stack.compiler.version: " in x]
    assert len(found) == 1, lines(m)
    assert f"triton {wrong} does not match torch {torch}" in found[0]
    assert f"fix: set stack.compiler.version: {triton}" in found[0]
    assert "expected" in found[0] and triton in found[0].split("expected", 1)[1]


@pytest.mark.parametrize(("torch", "triton", "runtime"), TORCH_TRITON)
def test_torch_pypi_wheel_cuda_runtime_matches_data(torch, triton, runtime):
    row = load_compat().torch_row(Version(torch), "cuda")
    assert row is not None and row.cuda_runtime == runtime


def test_example_line_from_the_issue(h200):
    m = with_pins(h200, compiler={"version": "3.6.0"})
    assert lines(m) == [
        f"{FILE}: stack.compiler.version: triton 3.6.0 does not match torch 2.13.0; expected 3.7.1; "
        "fix: set stack.compiler.version: 3.7.1"
    ]


def test_rocm_needs_pytorch_triton_rocm(mi300x):
    m = with_pins(mi300x, compiler={"package": "triton"})
    (line,) = lines(m)
    assert "stack.compiler.package:" in line and "expected pytorch-triton-rocm" in line


def test_rocm_triton_version_checked(mi300x):
    m = with_pins(mi300x, compiler={"version": "3.7.1"})
    (line,) = lines(m)
    assert "stack.compiler.version: pytorch-triton-rocm 3.7.1 does not match torch 2.11.0; expected 3.6.0" in line


def test_xpu_triton_version_checked():
    m = with_pins(load_manifest(SKUS / "intel-max1550-vllm.yaml"), compiler={"version": "3.7.1"})
    (line,) = lines(m)
    assert "pytorch-triton-xpu 3.7.1 does not match torch 2.14.0; expected 3.8.0" in line


def test_unknown_torch_is_a_problem_not_accepted(h200):
    m = no_engine(with_pins(h200, framework={"version": "2.13.7"}))
    (line,) = lines(m)
    assert "stack.framework.version: torch 2.13.7 (cuda) is not in the compatibility data" in line
    assert "skupin compat refresh" in line


# ---------------------------------------------------------------- engine <-> torch


@pytest.mark.parametrize(("vllm", "torch"), VLLM_TORCH)
def test_vllm_torch_row_accepted(h200, vllm, torch):
    m = with_pins(h200, engine={"version": vllm}, framework={"version": torch})
    assert "stack.framework.version" not in fields(m) and "stack.engine.version" not in fields(m)


@pytest.mark.parametrize(("vllm", "torch"), VLLM_TORCH)
def test_vllm_torch_row_rejected_with_other_torch(h200, vllm, torch):
    other = "2.13.0" if torch != "2.13.0" else "2.14.0"
    m = with_pins(h200, engine={"version": vllm}, framework={"version": other})
    found = [x for x in lines(m) if f"vllm {vllm} requires torch" in x]
    assert len(found) == 1, lines(m)
    assert ": stack.framework.version: " in found[0]
    assert f"expected torch {torch}" in found[0]
    assert f"fix: set stack.framework.version: {torch}" in found[0]


def test_engine_mismatch_suggests_engine_for_current_torch(h200):
    m = with_pins(h200, engine={"version": "0.25.0"})
    (line,) = lines(m)
    assert "keep torch and set stack.engine.version: 0.32.0" in line


@pytest.mark.parametrize(("sglang", "torch"), [("0.5.20", "2.13.0"), ("0.5.23", "2.14.1")])
def test_sglang_torch(h200, sglang, torch):
    ok = with_pins(h200, engine={"name": "sglang", "version": sglang}, framework={"version": torch},
                   compiler={"version": "3.7.1" if torch == "2.13.0" else "3.8.0"})
    assert lines(ok) == []
    bad = with_pins(ok, framework={"version": "2.11.0"}, compiler={"version": "3.6.0"})
    (line,) = lines(bad)
    assert f"sglang {sglang} requires torch ==" in line and f"expected torch {torch}" in line


def test_transformers_needs_its_minimum_torch(cpu):
    assert lines(cpu) == []
    old = with_pins(cpu, framework={"version": "2.5.1+cpu"})
    (line,) = lines(old)
    assert "transformers 5.24.0 requires torch >=2.6" in line and "expected torch >=2.6" in line


def test_unknown_engine_release_is_a_problem(h200):
    (line,) = lines(with_pins(h200, engine={"version": "0.99.0"}))
    assert "stack.engine.version: vllm 0.99.0 is not in the compatibility data" in line


# ---------------------------------------------------------------- CUDA runtime <-> minimum driver


def cuda_variant(series: str) -> str:
    major, minor = series.split(".")
    return f"cu{major}{minor}"


@pytest.mark.parametrize(("cuda", "minimum"), CUDA_DRIVER)
def test_cuda_driver_row_accepted_at_minimum(h200, cuda, minimum):
    data = _with_variant(cuda)
    m = no_engine(with_pins(h200, framework={"version": f"2.13.0+{cuda_variant(cuda)}", "variant": cuda_variant(cuda)},
                            driver={"version": minimum}))
    assert check_compat(manifest=m, file=FILE, compat=data) == []


@pytest.mark.parametrize(("cuda", "minimum"), CUDA_DRIVER)
def test_cuda_driver_row_rejected_one_below(h200, cuda, minimum):
    data = _with_variant(cuda)
    below = _one_below(minimum)
    m = no_engine(with_pins(h200, framework={"version": f"2.13.0+{cuda_variant(cuda)}", "variant": cuda_variant(cuda)},
                            driver={"version": below}))
    found = [str(p) for p in check_compat(manifest=m, file=FILE, compat=data)]
    assert len(found) == 1, found
    assert f": stack.driver.version: CUDA {cuda} " in found[0]
    assert f"expected >= {minimum}" in found[0] and f"not {below}" in found[0]


def _one_below(version: str) -> str:
    parts = [int(x) for x in version.split(".")]
    i = len(parts) - 1
    while parts[i] == 0:
        i -= 1
    parts[i] -= 1
    return ".".join(str(x) for x in parts)


def _with_variant(cuda: str) -> CompatData:
    """The shipped data plus a cuXY variant row for every CUDA series (the data lists only wheel tags)."""
    data = load_compat()
    tag = cuda_variant(cuda)
    if data.variant(tag) is not None:
        return data
    template = data.variant("cu130")
    row = template.model_copy(update={"variant": tag, "series": cuda})
    return data.model_copy(update={"variants": data.variants + (row,)})


def test_shipped_h200_driver_below_cuda13_minimum(h200):
    (line,) = lines(with_pins(h200, driver={"version": "570.195.03"}))
    assert "stack.driver.version: CUDA 13.0 (torch variant cu130) needs driver >= 580.65.06" in line


def test_pypi_wheel_cuda_must_match_variant(h200):
    (line,) = lines(with_pins(h200, framework={"variant": "cu128"}))
    assert "stack.framework.variant:" in line and "CUDA 13.0.3 (cu130)" in line and "expected cu130" in line


# ---------------------------------------------------------------- variants, families, labels


@pytest.mark.parametrize(("torch", "series"), TORCH_ROCM)
def test_torch_rocm_series(torch, series):
    assert series in load_compat().rocm_series(Version(f"{torch}.0"))


def test_rocm_variant_needs_rocm_driver_of_its_series(mi300x):
    (line,) = lines(with_pins(mi300x, driver={"version": "7.1.1"}))
    assert "stack.driver.version: rocm 7.1.1 is not in series 7.2" in line and "expected 7.2.x" in line


def test_rocm_variant_must_be_torchs_stable_series(mi300x):
    m = with_pins(mi300x, framework={"version": "2.11.0+rocm7.1", "variant": "rocm7.1"}, driver={"version": "7.1.1"})
    (line,) = lines(m)
    assert "stack.framework.variant: torch 2.11 ships stable ROCm wheels for 7.2" in line and "expected rocm7.2" in line


def test_cu130_needs_nvidia_driver(h200):
    (line,) = lines(with_pins(h200, driver={"name": "rocm", "version": "7.2.1"}))
    assert "stack.driver.name: variant cu130 needs driver pin 'nvidia'" in line and "expected nvidia" in line


def test_cpu_variant_needs_driver_none(cpu):
    m = with_pins(cpu, driver={"name": "nvidia", "version": "580.95.05", "reason": None})
    (line,) = lines(m)
    assert "stack.driver.name:" in line and "expected none" in line


def test_variant_of_another_family(h200):
    m = with_pins(h200, framework={"variant": "rocm7.2"})
    assert "stack.framework.variant" in fields(m)
    assert any("built for family rocm, not base.family cuda" in x for x in lines(m))


def test_local_label_must_match_variant(cpu):
    (line,) = lines(with_pins(cpu, framework={"version": "2.13.0+cu130"}))
    assert "stack.framework.version: local label +cu130 of torch 2.13.0+cu130 does not match variant cpu" in line
    assert "expected +cpu" in line


def test_family_vendor(h200):
    m = h200.model_copy(update={"accelerator": h200.accelerator.model_copy(update={"vendor": "amd"})})
    (line,) = lines(m)
    assert "accelerator.vendor: base.family cuda is for vendor nvidia, not amd; expected nvidia" in line


def test_unknown_variant_is_a_problem(h200):
    (line,) = lines(with_pins(h200, framework={"variant": "cu999"}))
    assert "stack.framework.variant: variant 'cu999' is not in the compatibility data" in line


def test_every_problem_reported_at_once(h200):
    m = with_pins(h200, compiler={"version": "3.6.0"}, driver={"version": "570.26"}, engine={"version": "0.25.0"})
    assert sorted(fields(m)) == ["stack.compiler.version", "stack.driver.version", "stack.framework.version"]
