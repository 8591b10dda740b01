"""Check an image's native binaries from its files, before anything runs: every NEEDED resolves, the device code fits.

The gate's `binaries` check (gates/gate.py, right after `pins`) runs this on the merged file view the pins check
built (skupin/imageview/layers.py); it reads ELF headers by ranges (skupin/imageview/elf.py), never a whole file,
never runs one. What the image's build added (every ELF file above the locked base's layers: the locked wheels,
the apt packages) is checked; the base's own files are the base publisher's, pinned by digest, and are only
looked up, not checked (measured: bench/binaries_real.py).

- **closure**: each DT_NEEDED of each ELF executable and shared object must resolve inside the image as glibc's
  ld.so would find it: DT_RPATH (when there is no DT_RUNPATH), LD_LIBRARY_PATH of the image's config,
  DT_RUNPATH, the folders of /etc/ld.so.conf and its includes, then the default folders (lib/<multiarch>,
  usr/lib/<multiarch>, lib, usr/lib), with $ORIGIN (and $LIB, $PLATFORM) expanded and symlinks followed inside
  the image only (FileView.resolve, a hop limit), a candidate of another ELF class or machine skipped as ld.so
  skips it. Then, in order: a soname the family's container runtime mounts from the host (FamilyInfo.
  host_libraries: libcuda.so.1 for cuda, nothing for cpu), and, for a Python extension module only (a shared
  object under site-packages or dist-packages), a library of that name elsewhere in the image: ld.so satisfies
  a NEEDED by a library already loaded under that name, and vLLM's extensions NEED libtorch.so and
  libcudart.so.13 with no RUNPATH at all, found because `import torch` loaded them first. A NEEDED nowhere in
  the image (a libcudart.so.12 in a CUDA 13 image, libnuma for vLLM's CPU ops) fails, named by the binary.
- **arch coverage** (families with device code: cuda, hip): each binary with a ``.nv_fatbin`` (``.hip_fatbin``)
  must carry code that runs on the SKU's `accelerator.arch` (skupin/imageview/fatbin.py: `runs_on`,
  `hip_runs_on`); one that does not fails, named by its path with the archs it carries.

Honest binaries that break a rule on purpose are declared, with why, in gates/data/binaries.yaml (`unresolved`:
an optional plugin's NEEDED; `arch_exempt`: a module an engine uses only on the archs it was built for, or one
whose `.nv_fatbin` is not where its kernels are), never
special-cased in code; the report lists every declaration it applied. What this cannot see: libraries only ever
dlopen'd (no NEEDED names them), kernels JIT-compiled at run time (Triton), symbol versions, and whether a
binary's kernels are ever launched. A malformed ELF file is a finding, never an exception.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from skupin.builder.catalog.families import FamilyInfo
from skupin.common.untrusted import UntrustedInputError, load_yaml, printable
from skupin.imageview.elf import EM_AARCH64, EM_X86_64, ET_DYN, ET_EXEC, ElfError, ElfFile, identify, read_elf
from skupin.imageview.fatbin import (
    HIP_FATBIN,
    NV_FATBIN,
    hip_runs_on,
    parse_cuda_arch,
    read_cuda_fatbin,
    read_hip_fatbin,
    runs_on,
)
from skupin.imageview.layers import Entry, FileView

# platform -> (ELF machine, Debian multiarch triplet, what ld.so's $LIB and $PLATFORM expand to)
PLATFORMS = {"linux/amd64": (EM_X86_64, "x86_64-linux-gnu", "x86_64"),
             "linux/arm64": (EM_AARCH64, "aarch64-linux-gnu", "aarch64")}
LD_SO_CONF = "etc/ld.so.conf"
MAX_CONF_FILES = 256
MAX_CONF_BYTES = 64 << 10
MAX_CONF_DEPTH = 8
MAX_CONF_PATTERNS = 256  # `include` globs, all files together (each lists a folder of the view)
MAX_CONF_LISTED = 100_000  # paths those globs look at, all together (a folder may hold millions)
MAX_CONF_FOLDERS = 1024  # folders of ld.so.conf and LD_LIBRARY_PATH (each searched for every NEEDED of every file)
MAX_LISTED = 50
MAX_FINDINGS = 1000  # the check stops once it has this many: the verdict is a fail already
MAX_NOTED = 1000  # lines kept of what passed by a library loaded earlier or a declaration (counted past it)
MAX_SECONDS = 300.0  # the whole check (measured: 0.4-1.3 s for the NVIDIA SKU's 5 GB of wheels); past it: error
PYTHON_FOLDERS = ("/site-packages/", "/dist-packages/")
MAX_RULES_BYTES = 1 << 20

Kind = Literal["unresolved", "arch", "malformed", "unreadable"]


@dataclass(frozen=True)
class Declared:
    """One declared exception of gates/data/binaries.yaml: the binaries it covers (a pattern of image paths, no
    leading slash, matched folder by folder: `*`, `?` and `[...]` within one name, `**` any folders), for
    `unresolved` the NEEDED names it covers, and why it is honest."""

    path: str
    why: str
    needed: str = "*"

    def covers(self, path: str, needed: str = "*") -> bool:
        return _path_match(path.split("/"), self.path.split("/")) and fnmatch.fnmatchcase(needed, self.needed)


def _path_match(parts: list[str], patterns: list[str], i: int = 0, j: int = 0) -> bool:
    """Whether path `parts[i:]` match `patterns[j:]` name by name (fnmatch's `*` alone would cross folders: a
    pattern of a file name would cover anything below a folder of that name)."""
    while j < len(patterns) and patterns[j] != "**":
        if i >= len(parts) or not fnmatch.fnmatchcase(parts[i], patterns[j]):
            return False
        i, j = i + 1, j + 1
    if j == len(patterns):
        return i == len(parts)
    return any(_path_match(parts, patterns, k, j + 1) for k in range(i, len(parts) + 1))


@dataclass(frozen=True)
class BinaryRules:
    """The declared exceptions (gates/data/binaries.yaml)."""

    unresolved: tuple[Declared, ...] = ()
    arch_exempt: tuple[Declared, ...] = ()


def load_rules(path: Path) -> BinaryRules:
    """The declared exceptions of `path` (bounded YAML); UntrustedInputError naming the file when malformed."""
    try:
        doc = load_yaml(path.read_bytes(), source=str(path), max_bytes=MAX_RULES_BYTES) or {}
    except OSError as exc:
        raise UntrustedInputError(f"{path}: cannot be read: {exc}") from exc
    if not isinstance(doc, dict) or set(doc) - {"unresolved", "arch_exempt"}:
        raise UntrustedInputError(f"{path}: expected a mapping of `unresolved` and `arch_exempt` lists")

    def rows(key: str, fields: set[str]) -> tuple[Declared, ...]:
        out = []
        for i, row in enumerate(doc.get(key) or ()):
            if not isinstance(row, dict) or not {"path", "why"} <= set(row) <= fields or not all(
                    isinstance(v, str) and v for v in row.values()):
                raise UntrustedInputError(f"{path}: {key}[{i}]: expected `path` and `why` strings"
                                          + (" (and `needed`)" if "needed" in fields else ""))
            out.append(Declared(**row))
        return tuple(out)
    return BinaryRules(unresolved=rows("unresolved", {"path", "why", "needed"}),
                       arch_exempt=rows("arch_exempt", {"path", "why"}))


@dataclass(frozen=True)
class BinaryFinding:
    """One way a binary would not load or run here."""

    kind: Kind
    path: str
    detail: str

    def line(self) -> str:
        return f"/{self.path}: {self.detail}"


@dataclass(frozen=True)
class BinariesReport:
    """What the binaries check established (frozen; its CheckResult is built by gates/judge/verdict.py)."""

    findings: tuple[BinaryFinding, ...] = ()
    unverifiable: tuple[str, ...] = ()
    checked: int = 0  # ELF files above the base whose closure was checked
    needed: int = 0  # NEEDED entries resolved, all ways together
    preloaded: tuple[str, ...] = ()  # "binary: NEEDED <- provider" resolved as a library loaded earlier (MAX_NOTED)
    preloaded_count: int = 0  # all of them
    host: tuple[str, ...] = ()  # host-injected sonames the image's binaries need
    archs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # device-code binary -> the code it carries
    declared: tuple[str, ...] = ()  # declared exceptions applied ("path: what: why"; the first MAX_NOTED)
    declared_count: int = 0  # all of them
    skipped: dict[str, int] = field(default_factory=dict)  # ELF files not checked, by why
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.findings and not self.unverifiable


# ---------------------------------------------------------------- the loader's search


@dataclass
class _Search:
    """What ld.so's search needs of the image: the view, the machine, LD_LIBRARY_PATH, ld.so.conf, the defaults,
    and a cache of the ELF identities of candidates."""

    view: FileView
    machine: int
    lib: str
    platform: str
    env_path: tuple[str, ...]
    conf: tuple[str, ...]
    defaults: tuple[str, ...]
    deadline: float = float("inf")  # time.monotonic() past which the check gives up (_OutOfTime)
    idents: dict[str, bool] = field(default_factory=dict)
    folders: dict[str, str | None] = field(default_factory=dict)  # search folder -> the folder it resolves to
    by_name: dict[str, str] | None = None

    def loadable(self, path: str) -> bool:
        """Whether `path` is an ELF64 little-endian file of the image's machine (ld.so skips any other)."""
        if path not in self.idents:
            try:
                with self.view.open_ranges(path) as read_at:
                    head = read_at(0, 20)
                self.idents[path] = identify(head) == (2, 1) and int.from_bytes(head[18:20], "little") == self.machine
            except (UntrustedInputError, OSError):
                self.idents[path] = False
        return self.idents[path]

    def in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OutOfTime

    def library(self, real: str | None) -> str | None:
        """`real` when it is a regular file ld.so would load (an ELF file of the image's class and machine)."""
        if real is not None and (entry := self.view.get(real)) is not None and entry.kind == "f" \
                and self.loadable(real):
            return real
        return None

    def find(self, name: str, folders: Iterable[str]) -> str | None:
        for folder in folders:
            self.in_time()
            if folder not in self.folders:  # each folder's links followed once per check, not once per NEEDED
                self.folders[folder] = self.view.resolve(folder)
            base = self.folders[folder]
            if base is None:
                continue
            if (found := self.library(self.view.resolve(posixpath.join(base, name)))) is not None:
                return found
        return None

    def expand(self, folders: tuple[str, ...], origin: str) -> list[str]:
        """RPATH/RUNPATH folders with ld.so's dynamic string tokens expanded; an empty one (the working folder)
        and a relative one (relative to it) are left out: no working folder is known."""
        out = []
        for folder in folders:
            for token, value in (("$ORIGIN", origin), ("${ORIGIN}", origin), ("$LIB", self.lib), ("${LIB}", self.lib),
                                 ("$PLATFORM", self.platform), ("${PLATFORM}", self.platform)):
                folder = folder.replace(token, value)
            if folder.startswith("/"):
                out.append(posixpath.normpath(folder))
        return out

    def provider(self, name: str) -> str | None:
        """An ELF file of the image loadable under `name` (its file name or a link's), for an already-loaded match."""
        if self.by_name is None:
            self.by_name = {}
            for known, entry in self.view.entries.items():
                base = known.rpartition("/")[2]
                if ".so" in base and base not in self.by_name and (entry.kind == "l" or (entry.kind == "f" and entry.elf)):
                    self.by_name[base] = known
        found = self.by_name.get(name)
        real = self.view.resolve(found) if found else None
        return real if real is not None and self.loadable(real) else None


class _OutOfTime(Exception):
    """The check ran past MAX_SECONDS."""


def ld_so_conf_folders(view: FileView) -> tuple[str, ...]:
    """The folders /etc/ld.so.conf names, with its `include`s (globs, relative to the including file's folder),
    as ldconfig reads them; bounded in files, bytes, depth, `include` patterns and folders; `hwcap` lines ignored."""
    folders: list[str] = []
    seen: set[str] = set()
    patterns = [0, 0]  # `include` patterns read, paths their globs looked at
    children: dict[str, list[str]] = {}

    def read(path: str, depth: int) -> None:
        real = view.resolve(path)
        if real is None or real in seen or len(seen) >= MAX_CONF_FILES or depth > MAX_CONF_DEPTH:
            return
        seen.add(real)
        entry = view.get(real)
        if entry is None or entry.kind != "f" or entry.size > MAX_CONF_BYTES:
            return
        try:
            text = view.read_file(real, max_bytes=MAX_CONF_BYTES).decode("utf-8", "replace")
        except UntrustedInputError:
            return
        for raw in text.splitlines():
            line = raw.split("#", 1)[0].strip()
            if line.startswith("include") and line[7:8].isspace():
                for pattern in line[8:].split():
                    patterns[0] += 1
                    if patterns[0] > MAX_CONF_PATTERNS or patterns[1] > MAX_CONF_LISTED:
                        return
                    full = pattern if pattern.startswith("/") else posixpath.join("/" + posixpath.dirname(real),
                                                                                   pattern)
                    matches, looked = _glob(view, full, children)
                    patterns[1] += looked
                    for match in matches:
                        read(match, depth + 1)
            elif line and not line.startswith("hwcap"):
                folders.extend(p for p in line.replace(",", " ").split() if p.startswith("/"))

    read(LD_SO_CONF, 0)
    return tuple(dict.fromkeys(posixpath.normpath(f) for f in folders))[:MAX_CONF_FOLDERS]


def _glob(view: FileView, pattern: str, children: dict[str, list[str]]) -> tuple[list[str], int]:
    """(the paths of the view matching `pattern`'s last name in its folder, how many paths were looked at);
    `children`: each folder -> its paths, made once for all patterns rather than a walk of the view per pattern."""
    if not children:
        children[""] = []
        for path in view.entries:
            children.setdefault(path.rpartition("/")[0], []).append(path)
    folder, _, name = pattern.strip("/").rpartition("/")
    real = view.resolve(folder) if folder else ""
    if real is None:
        return [], 0
    paths = children.get(real, [])
    match = re.compile(fnmatch.translate(name)).match
    return sorted(p for p in paths if match(p.rpartition("/")[2])), len(paths)


def _env_path(env: Mapping[str, str]) -> tuple[str, ...]:
    paths = (posixpath.normpath(p) for p in env.get("LD_LIBRARY_PATH", "").split(":") if p.startswith("/"))
    return tuple(dict.fromkeys(paths))[:MAX_CONF_FOLDERS]


# ---------------------------------------------------------------- the check


@dataclass
class _Log:
    findings: list[BinaryFinding] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    preloaded: list[str] = field(default_factory=list)
    host: set[str] = field(default_factory=set)
    archs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    declared: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    needed: int = 0
    preloaded_count: int = 0
    declared_count: int = 0

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def preload(self, line: str) -> None:
        self.preloaded_count += 1
        if len(self.preloaded) < MAX_NOTED:  # hard links make millions of files cheap: memory stays bounded
            self.preloaded.append(line)

    def declare(self, line: str) -> None:
        self.declared_count += 1
        if len(self.declared) < MAX_NOTED:
            self.declared.append(line)


def check_binaries(*, view: FileView, base_layers: int, env: Mapping[str, str], family: FamilyInfo, arch: str,
                   platform: str, rules: BinaryRules) -> BinariesReport:
    """The closure and arch coverage of every ELF file above the image's bottom `base_layers` layers (see the
    module docstring); `env` is the image config's environment, `arch` the SKU's accelerator.arch."""
    started = time.monotonic()
    machine, triplet, cpu = PLATFORMS.get(platform, PLATFORMS["linux/amd64"])
    search = _Search(view=view, machine=machine, lib=f"lib/{triplet}", platform=cpu, env_path=_env_path(env),
                     conf=ld_so_conf_folders(view),
                     defaults=(f"/lib/{triplet}", f"/usr/lib/{triplet}", "/lib", "/usr/lib", "/lib64", "/usr/lib64"),
                     deadline=started + MAX_SECONDS)
    log = _Log()
    checked = 0
    try:
        for path, entry in sorted(view.entries.items()):
            if entry.kind != "f" or not entry.elf or entry.layer < base_layers:
                continue
            if len(log.findings) >= MAX_FINDINGS:  # a fail already; a crafted image could make millions
                break
            search.in_time()
            elf = _read(view, path, entry, log)
            if elf is None:
                continue
            if elf.machine != machine:
                log.skip(f"another machine ({elf.machine})")  # GPU code objects, cubins, cross tools: not loaded here
                continue
            if elf.type not in (ET_EXEC, ET_DYN):
                log.skip("not an executable or shared object")
                continue
            checked += 1
            _interpreter(search, log, path, elf, rules=rules)
            if elf.dynamic:
                _closure(search, log, path, elf, family=family, rules=rules)
            _coverage(view, log, path, elf, family=family, arch=arch, rules=rules)
    except _OutOfTime:
        log.unverifiable.append(f"the binaries check ran past its time budget of {MAX_SECONDS:.0f} s "
                                f"({checked} ELF files checked): the image's binaries could not all be checked")
    return BinariesReport(findings=tuple(log.findings), unverifiable=tuple(log.unverifiable), checked=checked,
                          needed=log.needed, preloaded=tuple(log.preloaded), preloaded_count=log.preloaded_count,
                          host=tuple(sorted(log.host)), archs=log.archs, declared=tuple(log.declared),
                          declared_count=log.declared_count, skipped=log.skipped,
                          seconds=round(time.monotonic() - started, 3))


def _read(view: FileView, path: str, entry: Entry, log: _Log) -> ElfFile | None:
    try:
        with view.open_ranges(path) as read_at:
            return read_elf(read_at, entry.size, where=f"/{path}")
    except ElfError as exc:
        if exc.unsupported:
            log.skip("ELF32 or big-endian")
        else:
            log.findings.append(BinaryFinding("malformed", path, f"a malformed ELF file: {exc}"))
    except (UntrustedInputError, OSError) as exc:
        log.unverifiable.append(f"/{path}: cannot be read here: {printable(str(exc), 300)}")
    return None


def _interpreter(search: _Search, log: _Log, path: str, elf: ElfFile, *, rules: BinaryRules) -> None:
    """An executable's PT_INTERP (the dynamic loader the kernel starts it with) must be a loadable file of the image:
    without it the program does not start, whatever its NEEDED."""
    if not elf.interp or search.library(search.view.resolve(elf.interp)) is not None:
        return
    if declared := next((d for d in rules.unresolved if d.covers(path, elf.interp)), None):
        log.declare(f"/{path}: interpreter {elf.interp} unresolved: {declared.why}")
        return
    log.findings.append(BinaryFinding("unresolved", path, f"its interpreter {printable(elf.interp, 200)} is not a "
                                      "loadable file of the image"))


def _closure(search: _Search, log: _Log, path: str, elf: ElfFile, *, family: FamilyInfo, rules: BinaryRules) -> None:
    origin = "/" + posixpath.dirname(path)
    rpath = search.expand(elf.rpath, origin) if not elf.runpath else []
    folders = list(dict.fromkeys([*rpath, *search.env_path, *search.expand(elf.runpath, origin), *search.conf,
                                  *search.defaults]))
    extension = any(f in "/" + path for f in PYTHON_FOLDERS) and not elf.interp
    for name in dict.fromkeys(elf.needed):
        if "/" in name:  # ld.so opens it as that file (relative to a working folder no one knows here)
            found = search.library(search.view.resolve(name)) if name.startswith("/") else None
        else:
            found = search.find(name, folders)
        if found is not None:
            log.needed += 1
        elif "/" not in name and any(fnmatch.fnmatchcase(name, pattern) for pattern in family.host_libraries):
            log.needed += 1
            log.host.add(name)
        elif extension and "/" not in name and (provider := search.provider(name)) is not None:
            log.needed += 1
            log.preload(f"/{path}: {name} <- /{provider}")
        elif declared := next((d for d in rules.unresolved if d.covers(path, name)), None):
            log.declare(f"/{path}: NEEDED {name} unresolved: {declared.why}")
        else:
            where = "its RPATH/RUNPATH, LD_LIBRARY_PATH, ld.so.conf or the default folders" if not extension else \
                "the loader's search path or anywhere in the image"
            log.findings.append(BinaryFinding("unresolved", path, f"NEEDED {name} is not in {where}"
                                              + (f" (host libraries of {family.name} are accepted: none match)"
                                                 if family.host_libraries else "")))


def _coverage(view: FileView, log: _Log, path: str, elf: ElfFile, *, family: FamilyInfo, arch: str,
              rules: BinaryRules) -> None:
    if family.device_code == "cuda" and (section := elf.section(NV_FATBIN)) is not None:
        target = parse_cuda_arch(arch)
        if target is None:
            log.unverifiable.append(f"accelerator.arch {arch!r} is not an sm_XY arch the fatbin rule can read")
            return
        try:
            with view.open_ranges(path) as read_at:
                scan = read_cuda_fatbin(read_at, section, where=f"/{path}", target=target)
        except ElfError as exc:
            log.findings.append(BinaryFinding("malformed", path, f"a malformed fatbin: {exc}"))
            return
        labels = tuple(sorted({c.label for c in scan.codes}))
        log.archs[path] = labels
        covered = any(runs_on(code, target) for code in scan.codes)
        _judge_coverage(log, path, covered=covered or not scan.codes, labels=labels, arch=arch, rules=rules)
    elif family.device_code == "hip" and (section := elf.section(HIP_FATBIN)) is not None:
        try:
            with view.open_ranges(path) as read_at:
                hip = read_hip_fatbin(read_at, section, where=f"/{path}")
        except ElfError as exc:
            log.findings.append(BinaryFinding("malformed", path, f"a malformed offload bundle: {exc}"))
            return
        labels = tuple(sorted(hip.targets))
        log.archs[path] = labels
        covered = any(hip_runs_on(t, arch) for t in hip.targets)
        if not covered and hip.unreadable:
            log.findings.append(BinaryFinding("unreadable", path, f"its device code cannot be read: {hip.unreadable}; "
                                              f"it cannot be shown to carry code for {arch}"))
            return
        _judge_coverage(log, path, covered=covered or not hip.bundles, labels=labels, arch=arch, rules=rules)


def _judge_coverage(log: _Log, path: str, *, covered: bool, labels: tuple[str, ...], arch: str,
                    rules: BinaryRules) -> None:
    if covered:
        return
    declared = next((d for d in rules.arch_exempt if d.covers(path)), None)
    if declared is not None:
        log.declare(f"/{path}: no code for {arch} (carries {', '.join(labels) or 'none'}): {declared.why}")
        return
    log.findings.append(BinaryFinding("arch", path, f"no device code runs on {arch}: it carries "
                                      f"{', '.join(labels) or 'no entries'}"))
