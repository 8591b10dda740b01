"""`skupin check` refuses what the gate or the build cannot use, every problem at once, each with its file, its dotted
field, a fix and a did-you-mean where the value is one of a known set (issue 34): an arch the vendor has not, an arch
the pinned CUDA no longer compiles for, a hardware class of another vendor, a tolerance class the gate does not look
up, a CPU arch of another platform, a reference bundle that is missing, does not verify or records another model or
dtype, a float32 pass without its bundle, a model that is no fixture; pydantic's own errors get a fix too; warnings
reach `--json`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from skupin.builder.catalog.compat import load_compat
from skupin.cli import main
from skupin.common import paths
from tests.paths import REPO, SKUS

H200 = SKUS / "nvidia-h200-vllm.yaml"
CPU = SKUS / "cpu-x86_64.yaml"
BF16 = "gates/references/tiny-llama/h200-bfloat16"


def variant(tmp_path: Path, source: Path, edits: dict[str, Any], name: str = "bad") -> Path:
    """A copy of manifest `source` named `name` with `edits` ({"gate.dtype": "bf16"}) applied, in tmp_path/skus/."""
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    data["name"] = name
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value
    path = tmp_path / "skus" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def check(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """(exit code, the manifest's JSON record) of `skupin check --no-lock --json PATH`."""
    code = main(["check", "--no-lock", "--json", *args, str(path)])
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == code
    (manifest,) = report["manifests"]
    return code, manifest


def by_field(manifest: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {p["field"]: p for p in manifest["problems"]}


def test_every_shipped_manifest_passes(capsys):
    assert main(["check", "--no-lock", str(SKUS)]) == 0
    assert "have problems" not in capsys.readouterr().out


# ---------------------------------------------------------------- the accelerator


def test_an_arch_of_another_vendor_names_the_field_and_the_vendor(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"accelerator.arch": "gfx942"}))
    assert code == 2
    problem = by_field(m)["accelerator.arch"]
    assert "'gfx942' is an arch of vendor amd, not nvidia" in problem["message"]
    assert "accelerator.vendor: amd" in problem["fix"]
    assert problem["file"].endswith("bad.yaml")


def test_an_arch_no_vendor_has_gets_a_did_you_mean(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"accelerator.arch": "sm_999"}))
    assert code == 2
    assert by_field(m)["accelerator.arch"]["fix"] == "did you mean 'sm_90'?"


def test_an_arch_cuda_13_no_longer_compiles_for_is_incompatible(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"accelerator.arch": "sm_70", "accelerator.hardware_class":
                                                     "nvidia-volta", "gate.tolerance_class": "nvidia-volta"}))
    assert code == 3
    problem = by_field(m)["accelerator.arch"]
    assert "sm_70 is not compiled for by CUDA 13.0 (torch variant cu130)" in problem["message"]
    assert "stack.framework.variant: cu128" in problem["fix"]


def test_the_arch_data_says_cuda_13_dropped_compute_capability_below_7_5():
    """NVIDIA: CUDA 13.0 removes offline compilation for compute capability 5.x, 6.x, 7.0 and 7.2 (builder/data)."""
    rows = {r.arch: r for r in load_compat().arches if r.vendor == "nvidia"}
    for arch, row in rows.items():
        capability = int(arch.removeprefix("sm_"))
        assert row.cuda is not None, arch
        supported = SpecifierSet(row.cuda).contains(Version("13.0"))
        assert supported == (capability >= 75 and arch != "sm_101"), arch  # Thor's sm_101 is sm_110 from CUDA 13
    assert {"sm_50", "sm_60", "sm_70", "sm_72", "sm_75", "sm_90", "sm_100"} <= set(rows)


def test_a_hardware_class_of_another_vendor_is_refused(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"accelerator.hardware_class": "amd-cdna3",
                                                     "gate.tolerance_class": "amd-cdna3"}))
    assert code == 2
    problem = by_field(m)["accelerator.hardware_class"]
    assert "'amd-cdna3' is not a class of vendor nvidia" in problem["message"]
    assert problem["fix"] == "set accelerator.hardware_class: nvidia-hopper"


def test_a_tolerance_class_the_gate_does_not_look_up_is_refused(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"gate.tolerance_class": "nvidia-hoper"}))
    assert code == 2
    assert by_field(m)["gate.tolerance_class"]["fix"] == "set gate.tolerance_class: nvidia-hopper"


def test_a_cpu_arch_of_another_platform_is_refused(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, CPU, {"base.platform": "linux/arm64"}))
    assert code == 2
    problem = by_field(m)["accelerator.arch"]
    assert "x86_64 runs linux/amd64 images, not base.platform linux/arm64" in problem["message"]
    assert "accelerator.arch: aarch64" in problem["fix"]


# ---------------------------------------------------------------- the gate's model and bundles


def test_a_model_that_is_no_fixture_gets_a_did_you_mean(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, CPU, {"gate.model": "tiny-lama"}))
    assert code == 2
    problem = by_field(m)["gate.model"]
    assert "'tiny-lama' is no model fixture" in problem["message"] and problem["fix"] == "did you mean 'tiny-llama'?"


def test_a_missing_reference_folder_gets_a_did_you_mean(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"gate.reference": "gates/references/tiny-llama/h200-bfloat61"}))
    assert code == 2
    problem = by_field(m)["gate.reference"]
    assert "does not exist" in problem["message"] and problem["fix"] == f"did you mean '{BF16}'?"


def test_a_reference_outside_the_catalog_is_refused(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"gate.reference": "gates/../../etc/h200-bfloat16"}))
    assert code == 2
    assert "leaves the catalog" in by_field(m)["gate.reference"]["message"]


def test_a_bundle_of_another_model_names_gate_model(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, CPU, {"gate.model": "tiny-moe"}))
    assert code == 2
    problem = by_field(m)["gate.model"]
    assert "records model 'tiny-llama', not 'tiny-moe'" in problem["message"]
    assert "gates/references/tiny-moe/h200-float32" in problem["fix"]


def test_a_bundle_of_another_dtype_names_gate_dtype(tmp_path, capsys):
    code, m = check(capsys, variant(tmp_path, H200, {"gate.reference": "gates/references/tiny-llama/h200-float32"}))
    assert code == 2
    problem = by_field(m)["gate.dtype"]
    assert "records dtype 'float32', not 'bfloat16'" in problem["message"] and BF16 in problem["fix"]


@pytest.fixture
def catalog(tmp_path):
    """A catalog of its own (skus/, gates/references/), pinned as --root would, released afterwards."""
    (tmp_path / "skus").mkdir()
    paths.use_root(tmp_path)
    try:
        yield tmp_path
    finally:
        paths.use_root(None)


def test_a_bundle_that_does_not_verify_is_refused(catalog, capsys):
    shutil.copytree(REPO / "gates/references/tiny-llama/h200-float32", catalog / "gates/references/tiny-llama/h200-float32")
    with open(catalog / "gates/references/tiny-llama/h200-float32/probe.json", "a", encoding="utf-8") as fh:
        fh.write(" ")
    code, m = check(capsys, variant(catalog, CPU, {}))
    assert code == 2
    problem = by_field(m)["gate.reference"]
    assert "does not verify" in problem["message"] and "does not match SHA256SUMS" in problem["message"]


def test_a_float32_pass_without_its_bundle_is_refused(catalog, capsys):
    shutil.copytree(REPO / BF16, catalog / "gates/references/tiny-llama/mine-bfloat16")
    code, m = check(capsys, variant(catalog, H200, {"gate.reference": "gates/references/tiny-llama/mine-bfloat16"}))
    assert code == 2
    problem = by_field(m)["gate.reference"]
    assert problem["message"].startswith("the float32 pass's bundle gates/references/tiny-llama/mine-float32 does not "
                                         "exist")


# ---------------------------------------------------------------- every problem at once, pydantic's too, warnings


def test_every_problem_at_once(tmp_path, capsys):
    path = variant(tmp_path, H200, {"accelerator.arch": "gfx942", "gate.tolerance_class": "nvidia-hoper",
                                    "gate.model": "tiny-lama", "gate.reference": "gates/references/nope/h200-bfloat16"})
    code, m = check(capsys, path)
    assert code == 2
    assert {"accelerator.arch", "gate.tolerance_class", "gate.model", "gate.reference"} <= set(by_field(m))
    assert all(p["fix"] for p in m["problems"])
    assert main(["check", "--no-lock", str(path)]) == 2
    out = capsys.readouterr().out
    assert "bad.yaml: gate.model: 'tiny-lama' is no model fixture" in out and "; fix: did you mean 'tiny-llama'?" in out


@pytest.mark.parametrize(("field", "value", "fix"), [
    ("gate.dtype", "bf16", "did you mean 'bfloat16'?"),
    ("accelerator.vendor", "nvdia", "did you mean 'nvidia'?"),
    ("base.platform", "linux/amd46", "did you mean 'linux/amd64'?"),
    ("stack.engine.source.kind", "indx", "did you mean 'index'?"),
    ("gate.checks", ["boot", "kernel"], "did you mean 'kernels'?"),
    ("gate.batch_size", 0, "set gate.batch_size to a value >= 1"),
    ("base.python", "3", "write base.python to match"),
    ("accelerator.count", "many", "write a whole number"),
])
def test_pydantic_errors_carry_a_fix_and_a_did_you_mean(tmp_path, capsys, field, value, fix):
    code, m = check(capsys, variant(tmp_path, H200, {field: value}))
    assert code == 2
    problems = [p for p in m["problems"] if p["field"].startswith(field)]
    assert problems and problems[0]["fix"].startswith(fix), m["problems"]
    assert "Input should be" not in problems[0]["message"] and "String should match" not in problems[0]["message"]


def test_every_pydantic_problem_has_a_fix(tmp_path, capsys):
    path = variant(tmp_path, H200, {"gate.dtype": "fp8", "gate.deadline_s": 5.5, "cost.hourly_usd": -1,
                                    "runtime.shm_size": "lots", "gate.memory": None, "stack.engine.source": {}})
    code, m = check(capsys, path)
    assert code == 2 and len(m["problems"]) >= 5
    assert all(p["fix"] for p in m["problems"]), m["problems"]


def test_warnings_reach_json_and_leave_exit_0(monkeypatch, tmp_path, capsys):
    import skupin.gates.judge.tolerance as tolerance
    from skupin.gates.judge.tolerance import Tolerances, write_tolerances

    empty = tmp_path / "tolerances.yaml"
    write_tolerances(Tolerances(), empty)
    monkeypatch.setattr(tolerance, "catalog_tolerances", lambda: empty)
    code, m = check(capsys, CPU)
    assert code == 0 and m["problems"] == []
    (warning,) = m["warnings"]
    assert warning["field"] == "gate.tolerance_class"
    assert "no calibrated tolerance for cpu-x86_64/float32/tiny-llama" in warning["message"]
    assert warning["fix"].startswith("skupin calibrate cpu-x86_64")
