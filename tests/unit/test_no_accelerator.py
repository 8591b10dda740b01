"""A GPU image on a host without its accelerator: the checks that need none run, the import smoke test among them, and
the run ends "could not run: no <class> accelerator here", never pass (gates/host.py, gates/judge/smoke.py,
skupin_probe_smoke.py, gates/gate.py)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import skupin.gates.gate as gate
from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.gates.gate import GateInputs, PinsResult, _check_boot, _check_smoke, smoke_spec
from skupin.gates.host import HostAccelerator, host_accelerator
from skupin.gates.judge.smoke import classify, judge_smoke
from skupin.gates.judge.verdict import CheckResult, decide
from skupin.imagetools.probe import skupin_probe_smoke
from tests.paths import SKUS

PASSED = CheckResult(name="pins", status="pass", reason="test")
CUDA_HOST = ALL_FAMILIES["cuda"].host_libraries


def _inputs(sku: str, accelerator: HostAccelerator | None) -> GateInputs:
    manifest = load_manifest(SKUS / f"{sku}.yaml")
    stack = ResolvedStack(manifest=manifest, manifest_path=SKUS / f"{sku}.yaml")
    return GateInputs(stack=stack, image="img", docker=None, out=Path("."),  # type: ignore[arg-type]
                      on_event=lambda _: None, tolerances_path=Path("."), reference=None, baseline=None, serve_perf=None,
                      scratch=Path("."), accelerator=accelerator)


# ---------------------------------------------------------------- the host


def test_an_nvidia_accelerator_is_present_only_where_the_driver_answers() -> None:
    absent = host_accelerator("cuda", driver=lambda: {})
    assert not absent.present and "no NVIDIA driver" in absent.evidence
    here = host_accelerator("cuda", driver=lambda: {"version": "580.95.05", "source": "nvidia-smi"})
    assert here.present and "580.95.05" in here.evidence and here.driver["version"] == "580.95.05"


def test_rocm_needs_the_kfd_device_and_xpu_an_intel_render_node(tmp_path: Path) -> None:
    assert not host_accelerator("rocm", root=tmp_path, driver=lambda: {}).present
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kfd").touch()
    assert host_accelerator("rocm", root=tmp_path, driver=lambda: {}).present
    node = tmp_path / "sys" / "class" / "drm" / "renderD128" / "device"
    node.mkdir(parents=True)
    (node / "vendor").write_text("0x1002\n")  # an AMD render node is not an Intel GPU
    assert not host_accelerator("xpu", root=tmp_path).present
    (node / "vendor").write_text("0x8086\n")
    assert host_accelerator("xpu", root=tmp_path).present


def test_a_cpu_family_always_has_its_device() -> None:
    assert host_accelerator("cpu", driver=lambda: {}).present


# ---------------------------------------------------------------- the gate's flow


def test_a_gpu_image_is_not_booted_on_a_host_without_its_accelerator() -> None:
    absent = HostAccelerator(family="cuda", present=False, evidence="no NVIDIA driver answers")
    boot = _check_boot(_inputs("nvidia-h200-vllm", absent), PinsResult(PASSED, image_id="sha256:" + "1" * 64))
    assert boot.check.status == "error"
    assert boot.check.reason.startswith("could not run: no nvidia-hopper accelerator here (no NVIDIA driver answers)")
    checks = (CheckResult(name="reference", status="pass", reason=""), PASSED,
              CheckResult(name="binaries", status="pass", reason=""), CheckResult(name="smoke", status="pass", reason=""),
              boot.check)
    decision, reason = decide(checks)
    assert decision == "could_not_run" and reason.startswith("boot: could not run: no nvidia-hopper accelerator here")


def test_without_the_accelerator_pins_does_not_ask_for_the_host_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a build runner the image's files are still checked; the host driver's series is not (it has none)."""
    from skupin.builder.catalog.lockfile import read_lock
    from skupin.dockerd import ImageInfo

    seen: dict = {}
    monkeypatch.setattr(gate, "render", lambda _stack: type("R", (), {"text": ""})())
    monkeypatch.setattr(gate, "inspect_image", lambda **kw: ("report", None))
    monkeypatch.setattr(gate, "judge_pins", lambda **kw: seen.update(kw) or PASSED)
    image = ImageInfo(id="sha256:" + "2" * 64, tags=(), repo_digests=(), labels={}, size=0, layers=(), created="")
    inputs = _inputs("nvidia-h200-vllm", HostAccelerator(family="cuda", present=False, evidence="none"))
    inputs = replace(inputs, stack=inputs.stack.model_copy(update={
        "lock": read_lock(SKUS / "nvidia-h200-vllm.lock.json"), "lock_state": "ok"}))
    gate._check_pinned_files(inputs, image, since=0.0)
    assert seen["gpu_host"] is False and seen["host_driver"] is None
    here = replace(inputs, accelerator=HostAccelerator(family="cuda", present=True, evidence="x",
                                                       driver={"version": "580.95.05"}))
    gate._check_pinned_files(here, image, since=0.0)
    assert seen["gpu_host"] is True and seen["host_driver"] == {"version": "580.95.05"}


def test_the_smoke_container_gets_no_accelerator_and_the_sandbox() -> None:
    manifest = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    assert manifest.runtime.gpus == "all"
    spec = smoke_spec(manifest=manifest, image="sha256:" + "3" * 64, out=Path("/tmp/x"))
    assert spec.gpus is False and spec.devices == () and spec.group_add == ()
    assert spec.network == "none" and spec.read_only and spec.cap_drop == ("ALL",)
    assert spec.command[spec.command.index("--checks") + 1] == "env,smoke"
    assert spec.command[spec.command.index("--engine") + 1] == "vllm"
    assert "--model" not in spec.command


def test_a_cpu_image_skips_the_smoke_test_its_boot_is_one() -> None:
    result = _check_smoke(_inputs("cpu-x86_64", None), PinsResult(PASSED, image_id="sha256:" + "4" * 64))
    assert result.check.status == "skipped"


def test_the_smoke_check_sits_between_the_static_checks_and_boot() -> None:
    names = list(gate.CHECK_NAMES)
    assert names.index("pins") < names.index("smoke") < names.index("boot")


# ---------------------------------------------------------------- the judge


def test_a_library_that_needs_only_the_host_driver_is_deferred_anything_else_is_broken() -> None:
    missing_driver = "OSError: libcuda.so.1: cannot open shared object file: No such file or directory"
    assert classify("ok", CUDA_HOST) == ("ok", "")
    assert classify(missing_driver, CUDA_HOST) == ("host", "libcuda.so.1")
    assert classify(missing_driver, ()) == ("broken", "")  # a CPU family's host brings nothing
    assert classify("OSError: libcublasLt.so.13: cannot open shared object file", CUDA_HOST)[0] == "broken"
    assert classify("ImportError: undefined symbol: _ZN3c104cuda9SetDeviceEi", CUDA_HOST)[0] == "broken"


def _report(**items: object) -> dict:
    base = {"imports": {"torch": "ok", "vllm": "ok"}, "extensions": {}, "libraries": {}, "accelerator_visible": False}
    return {**base, **items}


def test_the_smoke_judge_passes_deferred_items_and_fails_naming_the_first_broken_one() -> None:
    deferred = _report(extensions={"vllm.cumem_allocator": "ImportError: libcuda.so.1: cannot open shared object file"},
                       libraries={"/v/nvidia/cu13/lib/libcudart.so.13": "ok"})
    ok = judge_smoke(deferred, host_libraries=CUDA_HOST, family="cuda")
    assert ok.status == "pass" and ok.details["needs_host_driver"] == {"vllm.cumem_allocator": "libcuda.so.1"}
    assert "libcuda.so.1" in ok.reason
    broken = judge_smoke(_report(extensions={"vllm._C": "ImportError: undefined symbol: _ZN3c10"}),
                         host_libraries=CUDA_HOST, family="cuda")
    assert broken.status == "fail" and "extension vllm._C: ImportError: undefined symbol" in broken.reason


def test_torch_or_the_engine_failing_to_import_is_broken_whatever_the_message() -> None:
    result = judge_smoke(_report(imports={"torch": "ok", "vllm": "ImportError: libcuda.so.1: cannot open shared "
                                                                 "object file"}),
                         host_libraries=CUDA_HOST, family="cuda")
    assert result.status == "fail" and result.reason.endswith("import vllm: ImportError: libcuda.so.1: cannot open "
                                                              "shared object file")


def test_a_truncated_or_malformed_smoke_report_never_passes() -> None:
    assert judge_smoke(_report(truncated=True), host_libraries=CUDA_HOST, family="cuda").status == "error"
    assert judge_smoke({"imports": []}, host_libraries=CUDA_HOST, family="cuda").status == "error"


# ---------------------------------------------------------------- the in-image tool


def _libz() -> Path:
    for folder in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        found = Path(folder) / "libz.so.1"
        if found.exists():
            return found.resolve()
    pytest.skip("no libz.so.1 on this host")


def test_the_smoke_tool_loads_extensions_and_runtime_libraries_and_reports_each(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site-packages"
    engine = site / "smokeengine"
    engine.mkdir(parents=True)
    (engine / "__init__.py").write_text("")
    suffix = skupin_probe_smoke.EXTENSION_SUFFIXES[0]
    (engine / f"_C{suffix}").write_bytes(b"not an ELF file")
    lib = site / "nvidia" / "fake" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(_libz(), lib / "libgood.so.1")
    (lib / "libbad.so.2").write_bytes(b"\x7fELF garbage")
    (lib / "liblink.so").symlink_to(lib / "libgood.so.1")  # links are not loaded twice, nor followed
    (lib / "README.txt").write_text("not a library")
    monkeypatch.syspath_prepend(str(site))
    try:
        report = skupin_probe_smoke.smoke("smokeengine", site_packages=[str(site)])
    finally:
        sys.modules.pop("smokeengine", None)
    assert report["imports"]["smokeengine"] == "ok"
    assert report["extensions"]["smokeengine._C"].startswith("ImportError")
    libs = {Path(p).name: v for p, v in report["libraries"].items()}
    assert libs["libgood.so.1"] == "ok" and libs["libbad.so.2"].startswith("OSError")
    assert set(libs) == {"libgood.so.1", "libbad.so.2"}
    assert report["truncated"] is False


def test_the_smoke_tool_stops_at_its_item_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "site-packages" / "torch" / "lib"
    lib.mkdir(parents=True)
    for i in range(5):
        (lib / f"lib{i}.so").write_bytes(b"x")
    monkeypatch.setattr(skupin_probe_smoke, "MAX_ITEMS", 3)
    report = skupin_probe_smoke.smoke("json", site_packages=[str(tmp_path / "site-packages")])
    assert len(report["libraries"]) == 3 and report["truncated"] is True


# ---------------------------------------------------------------- --pre-gate


def test_a_pre_gate_runs_every_check_before_boot_then_stops_never_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from skupin.gates.gate import GateCheck, Judged, PinsResult, Results, _run_checks, pre_gate_passed

    ran: list[str] = []

    def fake(name: str, status: str = "pass") -> Callable[[GateInputs], Judged | PinsResult]:
        def run(inputs: GateInputs) -> Judged | PinsResult:
            ran.append(name)
            result = CheckResult(name=name, status=status, reason=name)
            return PinsResult(result) if name == "pins" else Judged(result)
        return run

    def checks(smoke: str) -> tuple[GateCheck, ...]:
        return tuple(GateCheck(n, fake(n, smoke if n == "smoke" else "pass")) for n in gate.CHECK_NAMES)

    monkeypatch.setattr(gate, "CHECKS", checks("pass"))
    inputs = replace(_inputs("nvidia-h200-vllm", HostAccelerator(family="cuda", present=True, evidence="x")),
                     pre_gate=True)
    results = _run_checks(inputs)
    assert ran == list(gate.CHECK_NAMES[:gate.CHECK_NAMES.index("boot")])
    stop = results.checks[-1]
    assert (stop.name, stop.status) == ("boot", "error") and stop.reason == gate.PRE_GATE_REASON
    assert decide(results.checks)[0] == "could_not_run"

    def verdict_of(res: Results) -> Any:
        from types import SimpleNamespace
        return SimpleNamespace(checks=res.checks)

    assert pre_gate_passed(verdict_of(results))
    ran.clear()
    monkeypatch.setattr(gate, "CHECKS", checks("fail"))
    failed = _run_checks(inputs)
    assert failed.checks[-1].name == "smoke" and not pre_gate_passed(verdict_of(failed))
    whole = _run_checks(replace(inputs, pre_gate=False))
    assert not pre_gate_passed(verdict_of(whole))


def test_a_runtime_library_missing_only_a_declared_optional_plugin_dependency_is_no_fail() -> None:
    """The binaries check's declarations hold for the smoke test too: cuFile's RDMA plugin may miss rdma-core (the
    nvidia-h200-vllm-debian image's smoke test failed on it before); an undeclared library still fails."""
    from skupin.common.paths import PACKAGE_ROOT
    from skupin.gates.integrity.binaries import load_rules

    rules = load_rules(PACKAGE_ROOT / "gates/data/binaries.yaml")
    site = "/opt/skupin/venv/lib/python3.11/site-packages"
    missing = "OSError: libmlx5.so.1: cannot open shared object file: No such file or directory"
    report = _report(libraries={f"{site}/nvidia/cu13/lib/libcufile_rdma.so.1": missing})
    result = judge_smoke(report, host_libraries=CUDA_HOST, family="cuda", rules=rules)
    assert result.status == "pass" and result.details["counts"]["declared"] == 1, result.reason
    assert "rdma" in result.details["declared_optional"][f"{site}/nvidia/cu13/lib/libcufile_rdma.so.1"]
    other = _report(libraries={f"{site}/nvidia/cu13/lib/libcublas.so.13": missing})
    assert judge_smoke(other, host_libraries=CUDA_HOST, family="cuda", rules=rules).status == "fail"
    assert judge_smoke(report, host_libraries=CUDA_HOST, family="cuda").status == "fail"  # no rules given


def test_the_smoke_pass_names_what_was_imported_not_torch_for_an_engine_without_it() -> None:
    """llama.cpp runs without torch: its pass says what the probe imported (llama_cpp), never 'torch'."""
    from skupin.gates.judge.smoke import judge_smoke

    passed = judge_smoke({"imports": {"llama_cpp": "ok"}, "extensions": {}, "libraries": {}},
                         host_libraries=("libcuda.so.1",), family="cuda", expected=("llama_cpp",))
    assert passed.status == "pass" and "attached: llama_cpp import," in passed.reason and "torch" not in passed.reason
