"""Which accelerator archs an ELF file's device code runs on: CUDA fatbins and HIP offload bundles, headers only.

**CUDA.** nvcc puts a shared object's device code in the section ``.nv_fatbin``: one or more fatbin containers
back to back (one per translation unit; ``.nvFatBinSegment`` holds the runtime's wrappers, magic 0x466243B1,
that point into it, and ``__nv_relfatbin`` holds relocatable device code kept for a later device link, which the
runtime never loads: neither is read for coverage). A container is a 16-byte header (magic 0xBA55ED50, u16
version 1, u16 header size 16, u64 size of the entries that follow) and entries, each a header (u16 kind: 1 PTX,
2 ELF cubin; u32 header size, 64, 80 or 112 bytes; u64 payload size; u32 arch at byte 28, e.g. 90 for sm_90;
u64 flags at byte 40) and its payload, which is skipped by its size: libtorch_cuda's gigabyte of cubins is never
read, only their headers. The layout is what the public re-implementations of cuobjdump read (n-eiling's
cuda-fatbin-decompression, jiegec's fatbinary crate) and what nvopen-tools' format notes describe for CUDA 11-13.
Flags: 0x1 64-bit, 0x10 Linux, 0x1000/0x2000/0x8000 a compressed payload (LZ4-like, then zstd from CUDA 12.8); the
arch suffix is not in the arch number but in the flags: 0x100000 marks an arch-specific ``a`` entry and 0x200000
a family-specific ``f`` one. Those two bits are read off real binaries (vLLM 0.32.0's cu130 wheel: FlashAttention
3, Hopper-only and built for sm_90a, has every entry flagged 0x100000 and none 0x200000; FlashMLA, built for 9.0a
and 10.0f, flags its sm_90 entries 0x100000 and its sm_100 ones 0x200000; the plain sm_90/sm_100 cubins of
``_C`` have neither); the cubins themselves carry the same ELF e_flags with or without the suffix.

**HIP.** clang puts a ROCm binary's device code in ``.hip_fatbin``: clang offload bundles (magic
``__CLANG_OFFLOAD_BUNDLE__``, u64 entry count, then per entry u64 offset, u64 size, u64 triple length and the
triple, e.g. ``hipv4-amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-``), or compressed ones (magic ``CCOB``, u16
version, u16 method: 0 zlib, 1 zstd; then sizes and a hash: 20, 24 or 32 bytes of header for versions 1-3).
zlib is decompressed only as far as the entry table (bounded); zstd is not in the standard library, so a
zstd-compressed bundle "cannot be read" and the check fails closed on it rather than guess.

**XPU.** Intel's SYCL device images (SPIR-V, JIT-compiled for any Intel GPU, or AOT images) are not read:
for the xpu family the binaries check is the ELF closure alone (docs/GATE.md says so).
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass

from skupin.imageview.elf import ElfError, ReadAt, Section

NV_FATBIN = ".nv_fatbin"
NV_RELFATBIN = "__nv_relfatbin"
HIP_FATBIN = ".hip_fatbin"
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2
FLAG_ARCH_SPECIFIC = 0x100000  # an `a` entry (sm_90a, compute_100a)
FLAG_FAMILY_SPECIFIC = 0x200000  # an `f` entry (sm_100f)
MAX_CONTAINERS = 200_000  # libcublasLt.so.13 holds 2,775
MAX_ENTRIES = 1_000_000
MAX_ENTRY_HEADER = 4096
MAX_ZERO_SKIPS = 4096  # 16-byte steps of padding between containers
WINDOW = 1 << 16
BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"
COMPRESSED_MAGIC = b"CCOB"
MAX_BUNDLES = 100_000
MAX_BUNDLE_ENTRIES = 4096
MAX_TRIPLE = 1024
MAX_BUNDLE_TABLE = 1 << 20  # the decompressed bytes read of a zlib bundle: its entry table
MAX_INFLATED = 64 << 20  # decompressed bytes of one section's zlib bundles together (100,000 1 MiB bombs: 100 GB)
# LLVM's generic AMDGPU targets and the processors each runs on (llvm.org/docs/AMDGPUUsage.html, "Generic Processors").
AMD_GENERIC = {
    "gfx9-generic": ("gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"),
    "gfx9-4-generic": ("gfx940", "gfx941", "gfx942", "gfx950"),
    "gfx10-1-generic": ("gfx1010", "gfx1011", "gfx1012", "gfx1013"),
    "gfx10-3-generic": ("gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036"),
    "gfx11-generic": ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1153"),
    "gfx12-generic": ("gfx1200", "gfx1201"),
}


@dataclass(frozen=True, order=True)
class CudaCode:
    """One kind of device code a fatbin carries: a cubin (SASS) or PTX for an arch, with its suffix."""

    arch: int  # 90 for 9.0, 100 for 10.0, 121 for 12.1
    ptx: bool
    suffix: str = ""  # "a" (arch-specific), "f" (family-specific) or ""

    @property
    def label(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.arch}{self.suffix}"


@dataclass(frozen=True)
class CudaScan:
    """What the fatbins of one file carry: every kind of code, and how many containers and entries were read."""

    codes: frozenset[CudaCode]
    containers: int
    entries: int
    uncovering: int = 0  # containers none of whose entries runs on the target `read_cuda_fatbin` was given


def _capability(arch: int) -> tuple[int, int]:
    return arch // 10, arch % 10


def parse_cuda_arch(text: str) -> int | None:
    """The arch number of a manifest's `accelerator.arch` (sm_90 -> 90; sm_90a names the same device)."""
    found = re.fullmatch(r"sm_(\d{2,3})[af]?", text.strip())
    return int(found.group(1)) if found else None


def runs_on(code: CudaCode, target: int) -> bool:
    """Whether `code` runs on a device of compute capability `target` (90 for 9.0), by the CUDA documentation's
    rules (CUDA C++ Programming Guide, "Binary Compatibility", "PTX Compatibility" and "Feature Availability";
    NVIDIA's "Family-Specific Architecture Features" of CUDA 12.9):

    - a cubin for X.y runs on devices X.z with z >= y only (same major: no cubin crosses a major version);
    - an arch-specific cubin (sm_90a) runs on X.y exactly: its features "do not follow the onion layer model";
    - a family-specific cubin (sm_100f) runs on the family's later minors, X.z with z >= y, like a plain one;
    - PTX for compute_XY is JIT-compiled by the driver for any device of capability >= X.Y; arch-specific PTX
      (compute_90a) only for X.Y itself, family-specific PTX (compute_100f) only within the family (X.z, z >= y).
    """
    major, minor = _capability(code.arch)
    t_major, t_minor = _capability(target)
    if code.suffix == "a":
        return (major, minor) == (t_major, t_minor)
    if code.ptx and not code.suffix:
        return (major, minor) <= (t_major, t_minor)
    return major == t_major and minor <= t_minor


def _window_reader(read_at: ReadAt) -> ReadAt:
    """`read_at` through one cached window of WINDOW bytes: the many small headers of adjacent entries cost one read."""
    cache: list[tuple[int, bytes]] = [(0, b"")]

    def read(offset: int, size: int) -> bytes:
        start, data = cache[0]
        if start <= offset and offset + size <= start + len(data):
            return data[offset - start:offset - start + size]
        if size > WINDOW:
            return read_at(offset, size)
        data = read_at(offset, WINDOW)
        cache[0] = (offset, data)
        return data[:size]
    return read


def read_cuda_fatbin(read_at: ReadAt, section: Section, *, where: str, target: int | None = None) -> CudaScan:
    """Every kind of code in the fatbin containers of `section` (see the module docstring), and with `target` how
    many containers hold nothing that runs there (a translation unit whose kernels the engine only calls on other
    archs: reported, not failed); ElfError when the containers do not fit the section or pass the limits."""
    read = _window_reader(read_at)
    pos, end = section.offset, section.offset + section.size
    codes: set[CudaCode] = set()
    containers = entries = skips = uncovering = 0
    while end - pos >= 16:
        head = read(pos, 16)
        if len(head) < 16:
            raise ElfError(f"{where}: {NV_FATBIN} is truncated at offset {pos}")
        magic, _version, header_size, fat_size = struct.unpack("<IHHQ", head)
        if magic != FATBIN_MAGIC:
            if head == bytes(16) and skips < MAX_ZERO_SKIPS:  # padding between containers
                pos, skips = pos + 16, skips + 1
                continue
            raise ElfError(f"{where}: no fatbin container at offset {pos - section.offset} of {NV_FATBIN} "
                           f"(magic {magic:#010x}, not {FATBIN_MAGIC:#010x})")
        container_end = pos + header_size + fat_size
        if header_size < 16 or container_end > end:
            raise ElfError(f"{where}: a fatbin container at offset {pos - section.offset} declares "
                           f"{header_size + fat_size} bytes, past the end of {NV_FATBIN}")
        containers += 1
        if containers > MAX_CONTAINERS:
            raise ElfError(f"{where}: more than {MAX_CONTAINERS} fatbin containers")
        entry, covered = pos + header_size, False
        while container_end - entry >= 64:
            raw = read(entry, 64)
            if len(raw) < 64:
                raise ElfError(f"{where}: a fatbin entry at offset {entry} is truncated")
            kind, _ver, entry_header, payload = struct.unpack_from("<HHIQ", raw, 0)
            arch, = struct.unpack_from("<I", raw, 28)
            flags, = struct.unpack_from("<Q", raw, 40)
            if not 64 <= entry_header <= MAX_ENTRY_HEADER or entry + entry_header + payload > container_end:
                raise ElfError(f"{where}: a fatbin entry at offset {entry - section.offset} of {NV_FATBIN} declares "
                               f"a {entry_header}-byte header and {payload} bytes of payload, past its container")
            entries += 1
            if entries > MAX_ENTRIES:
                raise ElfError(f"{where}: more than {MAX_ENTRIES} fatbin entries")
            if kind in (KIND_PTX, KIND_CUBIN):
                suffix = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY_SPECIFIC else ""
                code = CudaCode(arch=arch, ptx=kind == KIND_PTX, suffix=suffix)
                codes.add(code)
                covered = covered or (target is not None and runs_on(code, target))
            entry += entry_header + payload
        uncovering += not covered
        pos = container_end
    return CudaScan(codes=frozenset(codes), containers=containers, entries=entries,
                    uncovering=uncovering if target is not None else 0)


# ---------------------------------------------------------------- HIP


@dataclass(frozen=True)
class HipScan:
    """The device targets of one file's offload bundles (`gfx942:sramecc+:xnack-`), and why some could not be read."""

    targets: frozenset[str]
    bundles: int
    unreadable: str = ""  # the first reason a bundle could not be read (a zstd-compressed one)


def amd_processor(target: str) -> str:
    """The processor of a target id (`gfx942` of `gfx942:sramecc+:xnack-`)."""
    return target.split(":", 1)[0]


def hip_runs_on(target: str, device: str) -> bool:
    """Whether a code object for target id `target` runs on processor `device` (the manifest's `gfx942`).

    AMD code objects are not forward compatible: one built for gfxN runs on gfxN only, and one built for a
    generic target (gfx9-4-generic) on the processors LLVM lists for it. The features after the colon
    (sramecc, xnack) must match the device's current mode, which the manifest does not name: any is accepted.
    """
    processor, wanted = amd_processor(target), amd_processor(device)
    return processor == wanted or wanted in AMD_GENERIC.get(processor, ())


def _bundle_targets(data: bytes, *, where: str, offset: int) -> tuple[list[str], int]:
    """(targets, bytes the bundle spans from its start) of an uncompressed bundle whose table `data` starts with."""
    if len(data) < 32 or data[:24] != BUNDLE_MAGIC:
        raise ElfError(f"{where}: no offload bundle at offset {offset} of {HIP_FATBIN}")
    count, = struct.unpack_from("<Q", data, 24)
    if count > MAX_BUNDLE_ENTRIES:
        raise ElfError(f"{where}: an offload bundle of {count} entries (limit {MAX_BUNDLE_ENTRIES})")
    pos, span = 32, 32
    targets: list[str] = []
    for _ in range(count):
        if pos + 24 > len(data):
            raise ElfError(f"{where}: the offload bundle at offset {offset} has a truncated entry table")
        start, size, length = struct.unpack_from("<QQQ", data, pos)
        if length > MAX_TRIPLE or pos + 24 + length > len(data):
            raise ElfError(f"{where}: an offload bundle entry at offset {offset} with a {length}-byte triple")
        triple = data[pos + 24:pos + 24 + length].decode("ascii", "replace")
        pos += 24 + length
        span = max(span, start + size)
        if triple.startswith("hip") and "--" in triple:
            targets.append(triple.split("--", 1)[1])
    return targets, max(span, pos)


def _compressed_bundle(read: ReadAt, pos: int, end: int, *, where: str, inflated: list[int]
                       ) -> tuple[list[str], int, str]:
    """(targets, bytes spanned, why unreadable) of the CCOB bundle at `pos`; `inflated[0]` counts the bytes
    decompressed in the section so far (ElfError past MAX_INFLATED)."""
    head = read(pos, 32)
    if len(head) < 16:
        raise ElfError(f"{where}: a compressed offload bundle at file offset {pos} is truncated")
    version, method = struct.unpack_from("<HH", head, 4)
    if version == 1:
        header, total = 20, 0
    elif version == 2:
        header, total = 24, struct.unpack_from("<I", head, 8)[0]
    elif version == 3:
        header, total = 32, struct.unpack_from("<Q", head, 8)[0]
    else:
        return [], 0, f"a compressed offload bundle of version {version}, which this reader does not know"
    if total and pos + total > end:
        raise ElfError(f"{where}: a compressed offload bundle declares {total} bytes, past the end of {HIP_FATBIN}")
    if method != 0:
        return [], total, (f"its device code is a zstd-compressed offload bundle (method {method}), which cannot be "
                           "read without a zstd decoder")
    stream = zlib.decompressobj()
    table, at = b"", pos + header
    try:
        while len(table) < MAX_BUNDLE_TABLE and at < (pos + total if total else end) and not stream.eof:
            chunk = read(at, min(WINDOW, (pos + total if total else end) - at))
            at += len(chunk)
            table += stream.decompress(chunk, MAX_BUNDLE_TABLE - len(table))
            if len(table) >= 32 and _table_complete(table):
                break
    except zlib.error as exc:
        raise ElfError(f"{where}: a zlib-compressed offload bundle that does not decompress: {exc}") from exc
    inflated[0] += len(table)
    if inflated[0] > MAX_INFLATED:
        raise ElfError(f"{where}: the compressed offload bundles of {HIP_FATBIN} decompress to more than "
                       f"{MAX_INFLATED} bytes of entry tables")
    targets, _span = _bundle_targets(table, where=where, offset=pos)
    if not total:
        return targets, 0, "a version-1 compressed offload bundle (no total size: later bundles cannot be found)"
    return targets, total, ""


def _table_complete(table: bytes) -> bool:
    """Whether the decompressed bytes hold a bundle's whole entry table."""
    count, = struct.unpack_from("<Q", table, 24)
    pos = 32
    for _ in range(min(count, MAX_BUNDLE_ENTRIES + 1)):
        if pos + 24 > len(table):
            return False
        pos += 24 + struct.unpack_from("<Q", table, pos + 16)[0]
    return pos <= len(table)


def read_hip_fatbin(read_at: ReadAt, section: Section, *, where: str) -> HipScan:
    """The targets of every offload bundle in `section`: bundles back to back, each padded to 4096 bytes or not."""
    read = _window_reader(read_at)
    pos, end = section.offset, section.offset + section.size
    targets: set[str] = set()
    bundles, unreadable, inflated = 0, "", [0]
    while end - pos >= 24:
        magic = read(pos, 24)
        if len(magic) < 24:  # the file ends inside the section: never padding (a step of 4 KiB per empty read)
            raise ElfError(f"{where}: {HIP_FATBIN} is truncated at offset {pos - section.offset}")
        if magic[:4] == COMPRESSED_MAGIC:
            found, span, why = _compressed_bundle(read, pos, end, where=where, inflated=inflated)
        elif magic == BUNDLE_MAGIC:
            table = read(pos, min(MAX_BUNDLE_TABLE, end - pos))
            found, span = _bundle_targets(table, where=where, offset=pos - section.offset)
            why = ""
        elif bundles and not magic.strip(b"\0"):
            pos = pos - (pos - section.offset) % 4096 + 4096  # padding to the next 4096-byte boundary
            continue
        else:
            raise ElfError(f"{where}: no offload bundle at offset {pos - section.offset} of {HIP_FATBIN}")
        bundles += 1
        if bundles > MAX_BUNDLES:
            raise ElfError(f"{where}: more than {MAX_BUNDLES} offload bundles")
        targets.update(found)
        unreadable = unreadable or why
        if span <= 0:
            break
        if pos + span > end:
            raise ElfError(f"{where}: an offload bundle at offset {pos - section.offset} spans past {HIP_FATBIN}")
        pos += span
    return HipScan(targets=frozenset(targets), bundles=bundles, unreadable=unreadable)
