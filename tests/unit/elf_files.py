"""A tiny ELF64 little-endian writer for the binaries check's tests: chosen sections, NEEDED, SONAME, RPATH and
RUNPATH, an interpreter; plus CUDA fatbin containers and HIP offload bundles to put in `.nv_fatbin` / `.hip_fatbin`.

The file maps itself whole with one PT_LOAD at address 0 (addresses are file offsets), as the loader's view needs.
"""

from __future__ import annotations

import struct
import zlib

from skupin.imageview.layers import Entry, FileView

ET_EXEC, ET_DYN, ET_REL = 2, 3, 1
EM_X86_64 = 62


def _align(data: bytearray, to: int = 8) -> None:
    data.extend(b"\0" * (-len(data) % to))


def elf(*, needed: tuple[str, ...] = (), soname: str = "", rpath: str = "", runpath: str = "",
        sections: dict[str, bytes] | None = None, e_type: int = ET_DYN, machine: int = EM_X86_64, interp: str = "",
        dynamic: bool = True, extra: tuple[tuple[int, str], ...] = ()) -> bytes:
    """An ELF64 file with the given dynamic entries and sections (see the module docstring); `extra`: more (tag,
    string) dynamic entries after those, e.g. a second DT_RUNPATH."""
    sections = sections or {}
    phnum = 1 + int(dynamic) + int(bool(interp))
    out = bytearray(64 + phnum * 56)
    interp_at = len(out)
    out += interp.encode() + b"\0" if interp else b""
    strtab = bytearray(b"\0")

    def string(text: str) -> int:
        strtab.extend(text.encode() + b"\0")
        return len(strtab) - len(text) - 1

    tags = [(1, string(n)) for n in needed]
    tags += [(14, string(soname))] if soname else []
    tags += [(15, string(rpath))] if rpath else []
    tags += [(29, string(runpath))] if runpath else []
    tags += [(tag, string(text)) for tag, text in extra]
    _align(out)
    strtab_at = len(out)
    out += strtab
    _align(out)
    dynamic_at = len(out)
    tags += [(5, strtab_at), (10, len(strtab)), (0, 0)]
    if dynamic:
        for tag, value in tags:
            out += struct.pack("<qQ", tag, value)
    dynamic_size = len(out) - dynamic_at
    placed = []
    for name, data in sections.items():
        _align(out)
        placed.append((name, len(out), len(data)))
        out += data
    names = bytearray(b"\0")
    name_at = {}
    for name in [*sections, ".shstrtab"]:
        name_at[name] = len(names)
        names += name.encode() + b"\0"
    shstr_at = len(out)
    out += names
    _align(out)
    shoff = len(out)
    headers = [bytes(64)]
    for name, offset, size in placed:
        headers.append(struct.pack("<IIQQQQIIQQ", name_at[name], 1, 2, offset, offset, size, 0, 0, 8, 0))
    headers.append(struct.pack("<IIQQQQIIQQ", name_at[".shstrtab"], 3, 0, 0, shstr_at, len(names), 0, 0, 1, 0))
    for header in headers:
        out += header
    total = len(out)
    phdrs = [struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, total, total, 0x1000)]
    if dynamic:
        phdrs.append(struct.pack("<IIQQQQQQ", 2, 6, dynamic_at, dynamic_at, dynamic_at, dynamic_size, dynamic_size, 8))
    if interp:
        phdrs.append(struct.pack("<IIQQQQQQ", 3, 4, interp_at, interp_at, interp_at, len(interp) + 1,
                                 len(interp) + 1, 1))
    out[64:64 + phnum * 56] = b"".join(phdrs)
    out[0:64] = (b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
                 + struct.pack("<HHIQQQIHHHHHH", e_type, machine, 1, 0, 64, shoff, 0, 64, 56, phnum, 64,
                               len(headers), len(headers) - 1))
    return bytes(out)


def fatbin(*entries: tuple[int, int, int], payload: int = 40) -> bytes:
    """One CUDA fatbin container of entries (kind 1 PTX / 2 cubin, arch, flags), each with `payload` bytes."""
    body = b""
    for kind, arch, flags in entries:
        header = bytearray(64)
        struct.pack_into("<HHIQ", header, 0, kind, 0x0101, 64, payload)
        struct.pack_into("<I", header, 28, arch)
        struct.pack_into("<Q", header, 40, 0x11 | flags)
        body += bytes(header) + b"\xab" * payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def offload_bundle(*triples: str) -> bytes:
    """An uncompressed clang offload bundle of `triples`, each with 16 bytes of code."""
    table = b""
    start = 32 + sum(24 + len(t) for t in triples)
    for i, triple in enumerate(triples):
        table += struct.pack("<QQQ", start + 16 * i, 16, len(triple)) + triple.encode()
    return b"__CLANG_OFFLOAD_BUNDLE__" + struct.pack("<Q", len(triples)) + table + b"\xcd" * (16 * len(triples))


def compressed_bundle(*triples: str, method: int = 0) -> bytes:
    """A CCOB version-2 bundle of `triples` (method 0: zlib; any other: a header whose payload is not read)."""
    raw = offload_bundle(*triples)
    payload = zlib.compress(raw) if method == 0 else b"\x28\xb5\x2f\xfd" + bytes(32)
    return b"CCOB" + struct.pack("<HHIIQ", 2, method, 24 + len(payload), len(raw), 0) + payload


def view(files: dict[str, bytes], *, links: dict[str, str] | None = None, base: tuple[str, ...] = ()) -> FileView:
    """A FileView of `files` (layer 1, above a base) and `links`; paths in `base` are in layer 0 (the base)."""
    entries: dict[str, Entry] = {}
    for path, data in files.items():
        entries[path] = Entry("f", 0o755, len(data), 0, elf=data[:4] == b"\x7fELF", layer=0 if path in base else 1)
        parent = path.rpartition("/")[0]
        while parent:
            entries.setdefault(parent, Entry("d", 0o755, 0, 0, layer=0))
            parent = parent.rpartition("/")[0]
    for path, target in (links or {}).items():
        entries[path] = Entry("l", 0o777, 0, 0, target=target, layer=1)
    return FileView(entries=entries, layers=("sha256:base", "sha256:top"),
                    read=lambda rel, _entry, _limit: files[rel])
