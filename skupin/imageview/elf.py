"""Read the headers of an ELF file from an image under test: bounded, by ranges, never loading or running it.

The binaries check (gates/integrity/binaries.py) needs, of each ELF64 little-endian file of an image, what
the dynamic loader and the CUDA/HIP runtimes would read: the file header, the program headers (PT_INTERP,
PT_DYNAMIC, the PT_LOADs that map the dynamic section's addresses to file offsets, as ld.so maps them), the
dynamic section's DT_NEEDED, DT_SONAME, DT_RPATH and DT_RUNPATH, and the section headers with their names (where
``.nv_fatbin`` and ``.hip_fatbin`` are found). The file is hostile: every count, offset and size it declares is
checked against the file's real size and against fixed limits before anything is read, reads go through a
``read_at(offset, size)`` callable (a ``pread`` on a descriptor opened without following links, see
skupin/imageview/layers.py), and libtorch_cuda's gigabyte is never read whole: a few kilobytes of headers are.

A file that is not what it declares is an ``ElfError`` (an UntrustedInputError) naming the file and why; the
check turns it into a finding. 32-bit and big-endian files are ``ElfError`` with ``unsupported`` set: reported,
not failed, since no image skupin builds loads them (the loader would refuse them too).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

from skupin.common.untrusted import UntrustedInputError

ReadAt = Callable[[int, int], bytes]  # (offset, size) -> at most `size` bytes (fewer only at the end of the file)

MAGIC = b"\x7fELF"
ET_EXEC, ET_DYN = 2, 3
EM_X86_64, EM_AARCH64, EM_CUDA, EM_AMDGPU = 62, 183, 190, 224
PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
SHT_NOBITS = 8
DT_NULL, DT_NEEDED, DT_STRTAB, DT_STRSZ, DT_SONAME, DT_RPATH, DT_RUNPATH = 0, 1, 5, 10, 14, 15, 29
MAX_PHDRS = 4096
MAX_SECTIONS = 65280  # below SHN_LORESERVE: extended section numbering (e_shnum 0) is refused
MAX_NAMES_BYTES = 4 << 20  # .shstrtab
MAX_DYNAMIC_BYTES = 1 << 20  # 65,536 dynamic entries
MAX_DYNAMIC_STRINGS = 4096  # NEEDED + SONAME + RPATH + RUNPATH entries
MAX_STRING = 4096  # one dynamic string (a RUNPATH of many folders)
MAX_INTERP = 4096
MAX_SEARCH_FOLDERS = 512  # folders of one DT_RPATH or DT_RUNPATH (each looked in for every NEEDED)
MAX_SECTION_NAME = 256  # bytes of one section's name: a longer one is no section this reads (labels stay bounded)


class ElfError(UntrustedInputError):
    """An ELF file that cannot be read as it declares (`unsupported`: a well-formed file of a class not read here)."""

    def __init__(self, message: str, *, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


@dataclass(frozen=True)
class Section:
    """One section header: its name, type and where its bytes lie in the file."""

    name: str
    type: int
    offset: int
    size: int


@dataclass(frozen=True)
class ElfFile:
    """What the loader reads of an ELF64 file: its type and machine, interpreter, dynamic entries and sections."""

    type: int
    machine: int
    size: int
    interp: str = ""
    dynamic: bool = False  # has a PT_DYNAMIC (a static executable has none: nothing to resolve)
    needed: tuple[str, ...] = ()
    soname: str = ""
    rpath: tuple[str, ...] = ()  # DT_RPATH folders, in order (ld.so ignores them when DT_RUNPATH is present)
    runpath: tuple[str, ...] = ()
    sections: tuple[Section, ...] = ()

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)


def identify(head: bytes) -> tuple[int, int] | None:
    """(ELF class, data encoding) of a file's first bytes, or None when it is not ELF."""
    if len(head) < 6 or head[:4] != MAGIC:
        return None
    return head[4], head[5]


def read_exact(read_at: ReadAt, offset: int, size: int, *, size_limit: int, where: str, what: str) -> bytes:
    """Exactly `size` bytes at `offset`, which must lie inside the file (`size_limit` bytes), or ElfError."""
    if offset < 0 or size < 0 or offset + size > size_limit:
        raise ElfError(f"{where}: {what} at offset {offset} ({size} bytes) lies outside the file ({size_limit} bytes)")
    data = read_at(offset, size)
    if len(data) != size:
        raise ElfError(f"{where}: {what} at offset {offset} is truncated ({len(data)} of {size} bytes)")
    return data


def read_elf(read_at: ReadAt, size: int, *, where: str) -> ElfFile:
    """The loader's view of the ELF64 little-endian file of `size` bytes that `read_at` reads (see the docstring)."""
    head = read_exact(read_at, 0, 64, size_limit=size, where=where, what="the ELF header")
    ident = identify(head)
    if ident is None:
        raise ElfError(f"{where}: not an ELF file")
    if ident != (2, 1):
        raise ElfError(f"{where}: ELF class {ident[0]} / data encoding {ident[1]} (only ELF64 little-endian is read)",
                       unsupported=True)
    (e_type, machine, _version, _entry, phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize, shnum,
     shstrndx) = struct.unpack_from("<HHIQQQIHHHHHH", head, 16)
    elf = ElfFile(type=e_type, machine=machine, size=size)
    phdrs = _program_headers(read_at, size, where=where, phoff=phoff, phentsize=phentsize, phnum=phnum)
    interp = next((p for p in phdrs if p[0] == PT_INTERP), None)
    if interp is not None:
        if interp[2] > MAX_INTERP:
            raise ElfError(f"{where}: PT_INTERP of {interp[2]} bytes (limit {MAX_INTERP})")
        raw = read_exact(read_at, interp[1], interp[2], size_limit=size, where=where, what="PT_INTERP")
        elf = replace(elf, interp=raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
    dynamic = next((p for p in phdrs if p[0] == PT_DYNAMIC), None)
    if dynamic is not None:
        elf = _with_dynamic(elf, read_at, where=where, dynamic=dynamic, loads=[p for p in phdrs if p[0] == PT_LOAD])
    sections = _section_headers(read_at, size, where=where, shoff=shoff, shentsize=shentsize, shnum=shnum,
                                shstrndx=shstrndx)
    return replace(elf, sections=sections)


# (p_type, p_offset, p_filesz, p_vaddr, p_memsz)
_Phdr = tuple[int, int, int, int, int]


def _program_headers(read_at: ReadAt, size: int, *, where: str, phoff: int, phentsize: int, phnum: int
                     ) -> list[_Phdr]:
    if phnum == 0:
        return []
    if phentsize != 56:
        raise ElfError(f"{where}: program header entries of {phentsize} bytes (ELF64 has 56)")
    if phnum > MAX_PHDRS:
        raise ElfError(f"{where}: {phnum} program headers (limit {MAX_PHDRS})")
    raw = read_exact(read_at, phoff, phnum * 56, size_limit=size, where=where, what="the program headers")
    out: list[_Phdr] = []
    for i in range(phnum):
        p_type, _flags, offset, vaddr, _paddr, filesz, memsz, _align = struct.unpack_from("<IIQQQQQQ", raw, i * 56)
        if p_type in (PT_LOAD, PT_DYNAMIC, PT_INTERP) and offset + filesz > size:
            raise ElfError(f"{where}: program header {i} (type {p_type}) declares bytes {offset}..{offset + filesz} "
                           f"beyond the file's {size}")
        out.append((p_type, offset, filesz, vaddr, memsz))
    return out


def _file_offset(loads: list[_Phdr], vaddr: int) -> int | None:
    """The file offset the loader maps address `vaddr` from (the PT_LOAD holding it), or None."""
    for _t, offset, filesz, start, _memsz in loads:
        if start <= vaddr < start + filesz:
            return offset + (vaddr - start)
    return None


def _with_dynamic(elf: ElfFile, read_at: ReadAt, *, where: str, dynamic: _Phdr, loads: list[_Phdr]) -> ElfFile:
    """The dynamic entries the loader reads (through PT_DYNAMIC and the PT_LOAD mapping, not the section headers,
    which the loader never reads and a file may lie in)."""
    _t, _offset, filesz, vaddr, _memsz = dynamic
    if filesz > MAX_DYNAMIC_BYTES:
        raise ElfError(f"{where}: a dynamic section of {filesz} bytes (limit {MAX_DYNAMIC_BYTES})")
    # ld.so reads the dynamic entries at PT_DYNAMIC's address (l_ld = l_addr + p_vaddr), not at its p_offset: a file
    # whose p_offset names other entries than its address must be read as the loader reads it
    offset = _file_offset(loads, vaddr) if filesz else 0
    if offset is None:
        raise ElfError(f"{where}: PT_DYNAMIC's address {vaddr:#x} is not in any PT_LOAD segment's file bytes")
    raw = read_exact(read_at, offset, filesz - filesz % 16, size_limit=elf.size, where=where, what="PT_DYNAMIC")
    tags: list[tuple[int, int]] = []
    for i in range(0, len(raw), 16):
        tag, value = struct.unpack_from("<qQ", raw, i)
        if tag == DT_NULL:
            break
        tags.append((tag, value))
    strtab = next((v for t, v in tags if t == DT_STRTAB), None)
    strsz = next((v for t, v in tags if t == DT_STRSZ), 0)
    wanted = [(t, v) for t, v in tags if t in (DT_NEEDED, DT_SONAME, DT_RPATH, DT_RUNPATH)]
    if not wanted:
        return replace(elf, dynamic=True)
    if len(wanted) > MAX_DYNAMIC_STRINGS:
        raise ElfError(f"{where}: {len(wanted)} NEEDED/SONAME/RPATH/RUNPATH entries (limit {MAX_DYNAMIC_STRINGS})")
    base = _file_offset(loads, strtab) if strtab is not None else None
    if base is None:
        raise ElfError(f"{where}: the dynamic string table (DT_STRTAB {strtab}) is not in any PT_LOAD segment")
    strings: dict[int, list[str]] = {DT_NEEDED: [], DT_SONAME: [], DT_RPATH: [], DT_RUNPATH: []}
    for tag, value in wanted:
        strings[tag].append(_dynamic_string(read_at, elf.size, base=base, strsz=strsz, index=value, where=where))
    # ld.so keeps one entry per tag but DT_NEEDED (elf/get-dynamic-info.h: `info[tag] = dyn`, the last one wins):
    # a second DT_RUNPATH does not add folders to the search, so it must not add them here either
    return replace(elf, dynamic=True, needed=tuple(strings[DT_NEEDED]),
                   soname=strings[DT_SONAME][-1] if strings[DT_SONAME] else "",
                   rpath=_folders(strings[DT_RPATH], "DT_RPATH", where),
                   runpath=_folders(strings[DT_RUNPATH], "DT_RUNPATH", where))


def _folders(values: list[str], tag: str, where: str) -> tuple[str, ...]:
    """The folders of the last of `values` (see above), at most MAX_SEARCH_FOLDERS of them (each is searched for
    every NEEDED: thousands would make one file cost millions of lookups)."""
    folders = tuple(values[-1].split(":")) if values else ()
    if len(folders) > MAX_SEARCH_FOLDERS:
        raise ElfError(f"{where}: a {tag} of {len(folders)} search folders (limit {MAX_SEARCH_FOLDERS})")
    return folders


def _dynamic_string(read_at: ReadAt, size: int, *, base: int, strsz: int, index: int, where: str) -> str:
    """The NUL-terminated string at `index` of the dynamic string table (at most MAX_STRING bytes)."""
    if strsz and index >= strsz:
        raise ElfError(f"{where}: a dynamic string at {index}, past DT_STRSZ {strsz}")
    start = base + index
    if start >= size:
        raise ElfError(f"{where}: a dynamic string at file offset {start}, past the file's end")
    data = read_at(start, min(MAX_STRING + 1, size - start))
    end = data.find(b"\0")
    if end < 0:
        raise ElfError(f"{where}: a dynamic string at file offset {start} longer than {MAX_STRING} bytes "
                       "or not terminated")
    return data[:end].decode("utf-8", "replace")


def _section_headers(read_at: ReadAt, size: int, *, where: str, shoff: int, shentsize: int, shnum: int,
                     shstrndx: int) -> tuple[Section, ...]:
    if shnum == 0 or shoff == 0:
        return ()  # stripped of section headers (the loader does not need them): no sections to look into
    if shentsize != 64:
        raise ElfError(f"{where}: section header entries of {shentsize} bytes (ELF64 has 64)")
    if shnum > MAX_SECTIONS:
        raise ElfError(f"{where}: {shnum} section headers (limit {MAX_SECTIONS})")
    raw = read_exact(read_at, shoff, shnum * 64, size_limit=size, where=where, what="the section headers")
    rows = [struct.unpack_from("<IIQQQQIIQQ", raw, i * 64) for i in range(shnum)]
    names = b""
    if 0 < shstrndx < shnum:
        _n, _t, _f, _a, offset, length, *_ = rows[shstrndx]
        if length > MAX_NAMES_BYTES:
            raise ElfError(f"{where}: a section name table of {length} bytes (limit {MAX_NAMES_BYTES})")
        names = read_exact(read_at, offset, length, size_limit=size, where=where, what="the section name table")
    out = []
    for i, (name, kind, _flags, _addr, offset, length, *_rest) in enumerate(rows):
        # section 0 too: a section 0 named like a section this reads is read like one
        if kind != SHT_NOBITS and offset + length > size:
            raise ElfError(f"{where}: section {i} declares bytes {offset}..{offset + length} beyond the file's {size}")
        # one name at most MAX_SECTION_NAME bytes: 65,280 headers naming one 4 MiB string would be 260 GB of labels
        end = names.find(b"\0", name, name + MAX_SECTION_NAME + 1) if name < len(names) else -1
        label = names[name:end].decode("utf-8", "replace") if end >= 0 else ""
        out.append(Section(name=label, type=kind, offset=offset, size=0 if kind == SHT_NOBITS else length))
    return tuple(out)
