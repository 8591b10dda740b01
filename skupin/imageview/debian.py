"""Debian's records as the static integrity check reads them: dpkg status, .list, .md5sums, update-alternatives.

The records of an image under test are hostile input (gates/integrity/static.py decides whose records to
trust for which package); this host's (`host_dpkg`) are trusted, the image cannot rewrite them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from skupin.imageview.layers import FileView

ALTERNATIVE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
MAX_ALTERNATIVES = 4096
DEBIAN_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,127}$")
DEBIAN_ARCH = re.compile(r"^[a-z0-9-]{0,32}$")


@dataclass
class Package:
    """One installed Debian package and the records dpkg keeps of it."""

    name: str
    arch: str
    version: str
    conffiles: dict[str, str] = field(default_factory=dict)
    depends: tuple[tuple[str, ...], ...] = ()  # Pre-Depends and Depends: clauses of alternative package names
    provides: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.name, self.arch, self.version)

    @property
    def info_names(self) -> tuple[str, ...]:
        if not DEBIAN_NAME.match(self.name) or not DEBIAN_ARCH.match(self.arch):
            return ()  # not a Debian package name: no record file is looked up for it
        return (f"{self.name}:{self.arch}", self.name) if self.arch else (self.name,)

    def label(self) -> str:
        return f"{self.name} {self.version}"


def relations(value: str) -> tuple[tuple[str, ...], ...]:
    """The package names of a Depends-style field: 'a (>= 1), b | c:any' -> (('a',), ('b', 'c'))."""
    clauses = []
    for clause in value.split(","):
        names = [alt.strip().split("(", 1)[0].split("[", 1)[0].strip().split(":", 1)[0] for alt in clause.split("|")]
        if any(names):
            clauses.append(tuple(n for n in names if n))
    return tuple(clauses)


def parse_status(text: str) -> list[Package]:
    """Installed packages of a dpkg status file (conffiles with their md5)."""
    out = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        conffiles: dict[str, str] = {}
        key = ""
        for line in block.splitlines():
            if line.startswith(" ") and key == "Conffiles":
                parts = line.split()
                if len(parts) >= 2 and parts[0].startswith("/") and re.fullmatch(r"[0-9a-f]{32}", parts[1]):
                    conffiles[parts[0].lstrip("/")] = parts[1]
                continue
            key, sep, value = line.partition(":")
            if sep and not line.startswith(" "):
                fields[key] = value.strip()
        if fields.get("Package") and "installed" in fields.get("Status", "").split()[-1:]:
            depends = relations(fields.get("Pre-Depends", "")) + relations(fields.get("Depends", ""))
            provides = tuple(n for clause in relations(fields.get("Provides", "")) for n in clause)
            out.append(Package(name=fields["Package"], arch=fields.get("Architecture", ""),
                               version=fields.get("Version", ""), conffiles=conffiles, depends=depends,
                               provides=provides))
    return out


def parse_md5sums(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        digest, _, path = line.partition("  ")
        if re.fullmatch(r"[0-9a-f]{32}", digest) and path:
            out[path.strip().lstrip("/")] = digest
    return out


def parse_alternatives(group: str, text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """One file of /var/lib/dpkg/alternatives: {name: (its link, the paths it may choose)} for the group and its
    slaves (mode, link, slave name/link pairs, a blank line, then per choice: path, priority, a path per slave)."""
    lines = text.split("\n")
    try:
        link, i, slaves = lines[1], 2, []
        while lines[i]:
            slaves.append((lines[i], lines[i + 1]))
            i += 2
        i += 1
        choices: dict[str, set[str]] = {group: set(), **{name: set() for name, _ in slaves}}
        while i < len(lines) and lines[i]:
            choices[group].add(lines[i])
            i += 2  # the path, then its priority
            for name, _ in slaves:
                if lines[i]:
                    choices[name].add(lines[i])
                i += 1
    except IndexError:
        return {}
    return {group: (link, frozenset(choices[group])), **{name: (slave, frozenset(choices[name])) for name, slave in slaves}}


class DpkgRecords:
    """dpkg's records of one system (an image's or this host's): read(name) returns a file of /var/lib/dpkg."""

    def __init__(self, read: Callable[[str], bytes | None], *, groups: Callable[[], list[str]] | None = None) -> None:
        self._read = read
        self._groups = groups  # the names of its update-alternatives group files
        self._alternatives: dict[str, tuple[str, frozenset[str]]] | None = None
        status = read("status")
        self.packages = parse_status(status.decode("utf-8", "replace")) if status else []
        self._by_key = {p.key: p for p in self.packages}
        self._by_name: dict[str, list[Package]] = {}
        for p in self.packages:
            self._by_name.setdefault(p.name, []).append(p)

    def has(self, pkg: Package) -> bool:
        return pkg.key in self._by_key

    def get(self, pkg: Package) -> Package | None:
        return self._by_key.get(pkg.key)

    def named(self, name: str) -> list[Package]:
        """Its installed packages called `name` (any architecture, any version)."""
        return self._by_name.get(name, [])

    def conffiles(self, pkg: Package) -> dict[str, str]:
        return self._by_key[pkg.key].conffiles

    def alternative(self, name: str) -> tuple[str, frozenset[str]] | None:
        """(link, the paths it may choose) of update-alternatives' name `name`, a group or one of its slaves."""
        if self._alternatives is None:
            self._alternatives = {}
            for group in (self._groups() if self._groups else [])[:MAX_ALTERNATIVES]:
                if ALTERNATIVE_NAME.match(group) and (data := self._read(f"alternatives/{group}")):
                    self._alternatives.update(parse_alternatives(group, data.decode("utf-8", "replace")))
        return self._alternatives.get(name)

    def info(self, pkg: Package, suffix: str) -> str:
        for name in pkg.info_names:
            data = self._read(f"info/{name}.{suffix}")
            if data is not None:
                return data.decode("utf-8", "replace")
        return ""


def host_dpkg(root: Path = Path("/var/lib/dpkg")) -> DpkgRecords:
    """This host's dpkg records (trusted: the image cannot rewrite them)."""
    def read(rel: str) -> bytes | None:
        try:
            return (root / rel).read_bytes()
        except OSError:
            return None

    def groups() -> list[str]:
        try:
            return sorted(p.name for p in (root / "alternatives").iterdir())
        except OSError:
            return []
    return DpkgRecords(read, groups=groups)


def image_dpkg(view: FileView) -> DpkgRecords:
    def read(rel: str) -> bytes | None:
        path = f"var/lib/dpkg/{rel}"
        if view.get(path) is None:
            return None
        return view.read_file(path)
    return DpkgRecords(read)


def declared_packages(roots: tuple[str, ...], image: DpkgRecords, trusted: list[DpkgRecords]) -> tuple[set[str], set[str]]:
    """(names of the installed packages `roots` need: the roots and their Pre-Depends/Depends closure, names whose
    Depends only the image's own records give).

    A package's Depends and Provides are read from a trusted record (this host's or the base's) of the same version,
    else of another version of it, else from the image's own record. A clause is met by its installed alternatives,
    else by the installed packages that provide one of them (by a trusted record's Provides when any does).
    """
    installed = {p.name: p for p in image.packages}

    def relations_of(pkg: Package) -> tuple[Package, bool]:
        for records in trusted:
            if (same := records.get(pkg)) is not None:
                return same, True
        for records in trusted:
            if others := records.named(pkg.name):
                return others[0], True
        return pkg, False

    providers: dict[str, list[tuple[str, bool]]] = {}
    for pkg in installed.values():
        record, is_trusted = relations_of(pkg)
        for virtual in record.provides:
            providers.setdefault(virtual, []).append((pkg.name, is_trusted))
    reached: set[str] = set()
    from_image: set[str] = set()
    queue: list[tuple[str, ...]] = [(root,) for root in roots]
    while queue:
        clause = queue.pop()
        offered = [p for n in clause for p in providers.get(n, ())]
        names = ([n for n in clause if n in installed] or [name for name, is_trusted in offered if is_trusted]
                 or [name for name, _ in offered])
        for name in names:
            if name in reached:
                continue
            reached.add(name)
            record, is_trusted = relations_of(installed[name])
            if not is_trusted:
                from_image.add(name)
            queue.extend(record.depends)
    return reached, from_image
