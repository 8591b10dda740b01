"""Decide from an image's files alone whether it is exactly its lock: the bytes are the lock, not what the metadata says.

The gate's `pins` check (gates/gate.py) runs this before it boots anything. Inputs: the image's
merged file view (gates/static/layers.py), its config, the lock, the locked wheels from the host's wheel
store, and the locked base's layer count. What is accounted for, and how:

- **base**: files of the locked base's own layers (the image's bottom layers must be exactly the
  base's, by diff id; the base is pinned in the lock);
- **wheels**: every file a locked wheel installs, computed by running pypa installer (the same
  version the build binds) into a hashing destination laid out as the image's venv: module files,
  generated console scripts, INSTALLER and RECORD, each by sha256;
- **Debian**: files owned by an installed package match their md5 (from this host's dpkg records
  when it has the same package version — a record the image cannot rewrite — else from the
  image's own records), conffiles match their recorded md5;
- **bytecode**: each ``__pycache__`` file must unmarshal to exactly the code its accounted source
  compiles to, with an interpreter byte-identical to the image's (imagetools/pyc_verify.py, run as an
  unprivileged, resource-limited process);
- **venv scaffold**: pyvenv.cfg (home, no system site-packages) and the interpreter links.

Everything under a Python path (the venv, the interpreter's stdlib and dist-packages folders)
that none of these accounts for fails, and so does any unaccounted executable, ELF file or Python
file elsewhere, a .pth/sitecustomize start-up hook, a distribution outside the lock, an
environment variable that makes the loader or the interpreter run other code, and a lock label
that is not the lock's hash. Unowned data files (certificates, logs, caches) are counted and
listed, not failed. What this cannot see is described in docs/GATE.md ("Threat model").
"""

from __future__ import annotations

import base64
import email.parser
import email.policy
import hashlib
import io
import json
import posixpath
import re
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from installer import install
from installer.destinations import SchemeDictionaryDestination
from installer.records import Hash, RecordEntry
from installer.scripts import Script
from installer.sources import WheelFile
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from pydantic import Field

from builder.lock import marker_environment
from builder.lockfile import Lock
from builder.wheels import STORE, fetch_wheels
from common.model import Frozen
from common.untrusted import UntrustedInputError, printable
from gates.static.bytecode import bytecode_verifier
from gates.static.layers import Entry, FileView, image_view

# Environment variables that make the dynamic loader or the interpreter load other code.
HIJACK_ENV = ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
              "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONEXECUTABLE", "PYTHONSAFEPATH", "PYTHONPYCACHEPREFIX",
              "PYTHONWARNINGS", "PYTHONBREAKPOINT", "PYTHONPLATLIBDIR", "BASH_ENV", "ENV")
# Debian paths whose files may be missing (dpkg path-excludes of documentation).
MAY_BE_MISSING = re.compile(r"^usr/share/(doc|man|info|locale|lintian|linda|groff)/")
MAINTAINER_SCRIPTS = re.compile(r"^var/lib/dpkg/info/[^/]+\.(preinst|postinst|prerm|postrm|config|templates)$")
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pth", ".so", ".sh", ".pl", ".pm")
MAX_LISTED = 25

Kind = Literal["config", "label", "base", "debian", "wheel", "unaccounted", "hook", "extra_distribution",
               "bytecode", "venv", "executable", "requirement"]


class Finding(Frozen):
    """One way the image is not its lock."""

    kind: Kind
    path: str = ""
    detail: str

    def line(self) -> str:
        where = f"/{self.path}: " if self.path else ""
        return f"{where}{self.detail}"


class IntegrityReport(Frozen):
    """What the static check established about an image's files."""

    findings: tuple[Finding, ...] = ()
    unverifiable: tuple[str, ...] = Field(default=(), description="Why part of the image could not be checked here")
    counts: dict[str, int] = Field(default_factory=dict)
    unowned_data: tuple[str, ...] = Field(default=(), description="First unowned data files (not code), for the report")
    interpreter: str | None = None
    omitted: tuple[str, ...] = Field(default=(), description="Requirements left out by the lock (stack.omit), with why")

    @property
    def ok(self) -> bool:
        return not self.findings and not self.unverifiable


@dataclass(frozen=True)
class ImageLayout:
    """Where a skupin image keeps Python: the venv the templates create and the interpreter it links to."""

    venv: str = "opt/skupin/venv"
    python: str = "3.11"

    @property
    def interpreter(self) -> str:
        return f"usr/bin/python{self.python}"

    @property
    def site(self) -> str:
        return f"{self.venv}/lib/python{self.python}/site-packages"

    @property
    def pyc_tag(self) -> str:
        return "cpython-" + self.python.replace(".", "")

    def scheme(self) -> dict[str, str]:
        """The install scheme of the venv (absolute paths), as wheel_install.py computes it in the image."""
        venv = "/" + self.venv
        return {"purelib": f"/{self.site}", "platlib": f"/{self.site}", "scripts": f"{venv}/bin", "data": venv,
                "headers": f"/usr/include/python{self.python}/site"}

    def python_paths(self) -> tuple[str, ...]:
        """Folders (and zip) any Python process of the image may import from."""
        v = self.python
        return (self.venv, f"usr/lib/python{v}", f"usr/lib/python{v.replace('.', '')}.zip", "usr/lib/python3/dist-packages",
                f"usr/local/lib/python{v}", "usr/local/lib/python3/dist-packages", f"usr/lib/python{v}/site-packages")


# ---------------------------------------------------------------- what the locked wheels install


class _HashingDestination:
    """A pypa installer destination that writes nothing: it records (absolute path -> sha256) of every file."""

    def __init__(self, scheme: dict[str, str], interpreter: str) -> None:

        self._inner = SchemeDictionaryDestination(scheme_dict=scheme, interpreter=interpreter, script_kind="posix")
        self.files: dict[str, str] = {}
        inner = self._inner
        inner.write_to_fs = self._write  # type: ignore[method-assign]
        inner.write_script = self._script  # type: ignore[method-assign]
        self.write_file = inner.write_file
        self.finalize_installation = inner.finalize_installation
        self.write_script = inner.write_script

    def _write(self, scheme: str, path: str, stream, is_executable: bool):

        digest, size = hashlib.sha256(), 0
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
        target = posixpath.normpath(posixpath.join(self._inner.scheme_dict[scheme], path))
        self.files[target.lstrip("/")] = digest.hexdigest()
        encoded = base64.urlsafe_b64encode(digest.digest()).decode("ascii").rstrip("=")  # as installer writes it
        return RecordEntry(path, Hash("sha256", encoded), size)

    def _script(self, name: str, module: str, attr: str, section: str):

        kind: Literal["console", "gui"] = "gui" if section == "gui" else "console"
        script_name, data = Script(name, module, attr, kind).generate(self._inner.interpreter, "posix")
        return self._write("scripts", script_name, io.BytesIO(data), True)


def wheel_files(wheel: Path, *, layout: ImageLayout, installer_name: bytes = b"skupin\n") -> dict[str, str]:
    """path (relative to /) -> sha256 of every file installing `wheel` into the image's venv writes."""

    destination = _HashingDestination(layout.scheme(), interpreter=f"/{layout.venv}/bin/python")
    with WheelFile.open(wheel) as source:
        install(source, destination, {"INSTALLER": installer_name})  # type: ignore[arg-type]
    return destination.files


def expected_wheel_files(wheels: dict[str, Path], *, layout: ImageLayout, cache: Path | None = None
                         ) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """(path -> (sha256, distribution) for every locked wheel, problems); results cached by wheel hash."""

    files: dict[str, tuple[str, str]] = {}
    problems: list[str] = []
    for name, path in sorted(wheels.items()):
        if not path.name.endswith(".whl"):
            problems.append(f"{name}: locked as {path.name}, not a wheel: its installed files cannot be computed")
            continue
        try:
            st = path.stat()
        except OSError as exc:
            problems.append(f"{name}: {path}: {exc.strerror}")
            continue
        # the wheel store's path names the file's sha256; size and mtime guard any other folder
        key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{layout.venv}\0{layout.python}\0"
                             f"installer-0.7".encode()).hexdigest()
        cached = cache / f"{key}.json" if cache else None
        try:
            found = json.loads(cached.read_text()) if cached else None
        except (OSError, ValueError):
            found = None
        if found is None:
            try:
                found = wheel_files(path, layout=layout)
            except Exception as exc:  # installer raises many kinds; name the wheel
                problems.append(f"{name}: {path.name}: cannot be read as a wheel: {type(exc).__name__}: {exc}")
                continue
            if cached:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(found, sort_keys=True))
        for file, sha in found.items():
            files[file] = (sha, name)
    return files, problems


# ---------------------------------------------------------------- Debian's records


@dataclass
class Package:
    """One installed Debian package and the records dpkg keeps of it."""

    name: str
    arch: str
    version: str
    conffiles: dict[str, str] = field(default_factory=dict)

    @property
    def info_names(self) -> tuple[str, ...]:
        return (f"{self.name}:{self.arch}", self.name)


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
            out.append(Package(name=fields["Package"], arch=fields.get("Architecture", ""),
                               version=fields.get("Version", ""), conffiles=conffiles))
    return out


def parse_md5sums(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        digest, _, path = line.partition("  ")
        if re.fullmatch(r"[0-9a-f]{32}", digest) and path:
            out[path.strip().lstrip("/")] = digest
    return out


class DpkgRecords:
    """dpkg's records of one system (an image's or this host's): read(name) returns a file of /var/lib/dpkg."""

    def __init__(self, read: Callable[[str], bytes | None]) -> None:
        self._read = read
        status = read("status")
        self.packages = parse_status(status.decode("utf-8", "replace")) if status else []
        self._by_key = {(p.name, p.arch, p.version): p for p in self.packages}

    def has(self, pkg: Package) -> bool:
        return (pkg.name, pkg.arch, pkg.version) in self._by_key

    def conffiles(self, pkg: Package) -> dict[str, str]:
        return self._by_key[(pkg.name, pkg.arch, pkg.version)].conffiles

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
    return DpkgRecords(read)


def image_dpkg(view: FileView) -> DpkgRecords:
    def read(rel: str) -> bytes | None:
        path = f"var/lib/dpkg/{rel}"
        if view.get(path) is None:
            return None
        return view.read_file(path)
    return DpkgRecords(read)


# ---------------------------------------------------------------- the check


@dataclass
class _Run:
    view: FileView
    layout: ImageLayout
    base_layers: int
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    unverifiable: list[str] = field(default_factory=list)
    owned: set[str] = field(default_factory=set)
    owner: dict[str, Package] = field(default_factory=dict)
    wheel: dict[str, tuple[str, str]] = field(default_factory=dict)
    pycs: list[Bytecode] = field(default_factory=list)
    locked: dict[str, str] = field(default_factory=dict)

    def find(self, kind: Kind, detail: str, path: str = "") -> None:
        self.findings.append(Finding(kind=kind, path=path, detail=printable(detail, 400)))

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def base(self, entry: Entry) -> bool:
        return entry.layer < self.base_layers

    def canonical(self, path: str) -> str:
        """`path` with its folder resolved through the image's links (usr-merge: bin -> usr/bin)."""
        folder, _, name = path.strip("/").rpartition("/")
        real = (self.view.resolve(folder) or folder) if folder else ""
        return f"{real}/{name}" if real else name


class Bytecode(NamedTuple):
    """A bytecode file to verify: compiled from `source` (its path in the image), read from `real_source`."""

    pyc: str
    source: str
    real_source: str
    opt: int


# verify_bytecode(pycs, view, interpreter path in the image, its upstream version) -> (failures, unverifiable, host interpreter)
VerifyBytecode = Callable[[list[Bytecode], FileView, str, "str | None"], tuple[list[str], list[str], "str | None"]]


def upstream_version(debian_version: str) -> str:
    """'3.11.2' of a Debian version such as '3.11.2-6+deb12u8' (epoch and revision dropped)."""
    return debian_version.split(":", 1)[-1].rsplit("-", 1)[0]


def check_integrity(*, view: FileView, config: dict[str, Any], labels: dict[str, str], lock: Lock,
                    expected_cmd: tuple[str, ...] | None, wheels: dict[str, Path], base_layers: int,
                    host: DpkgRecords | None,
                    verify_bytecode: VerifyBytecode, layout: ImageLayout | None = None,
                    wheel_cache: Path | None = None) -> IntegrityReport:
    """Every rule of the module docstring over one image; the findings say which file broke which rule."""
    layout = layout or ImageLayout(python=lock.python)
    run = _Run(view=view, layout=layout, base_layers=base_layers,
               locked={name: pkg.version for name, pkg in lock.packages().items()})
    _check_config(run, config=config, labels=labels, lock=lock, expected_cmd=expected_cmd)
    _check_debian(run, host=host, system=dict(lock.system))
    run.wheel, problems = expected_wheel_files(wheels, layout=layout, cache=wheel_cache)
    run.unverifiable.extend(problems)
    _check_wheels(run)
    omitted = _check_requirements(run, wheels=wheels, lock=lock)
    _check_files(run)
    interpreter = None
    if run.pycs:
        owner = run.owner.get(view.resolve(layout.interpreter) or "")
        failures, unverifiable, interpreter = verify_bytecode(run.pycs, view, layout.interpreter,
                                                              upstream_version(owner.version) if owner else None)
        for line in failures:
            run.find("bytecode", line)
        run.unverifiable.extend(unverifiable)
        run.count("bytecode_verified", len(run.pycs) - len(failures) if not unverifiable else 0)
    verified = {item.pyc for item in run.pycs}
    data = sorted(p for p, e in view.entries.items() if e.kind == "f" and not run.base(e) and p not in run.owned
                  and p not in run.wheel and p not in verified and not _in_paths(p, layout.python_paths())
                  and not MAINTAINER_SCRIPTS.match(p))
    run.count("unowned_data", len(data))
    return IntegrityReport(findings=tuple(run.findings), unverifiable=tuple(run.unverifiable), counts=run.counts,
                           unowned_data=tuple(data[:MAX_LISTED]), interpreter=interpreter, omitted=omitted)


def wheel_requirements(wheel: Path) -> tuple[str, ...]:
    """The Requires-Dist lines of a wheel's METADATA (a locked file from the host's wheel store, not the image)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ValueError(f"{wheel.name}: {len(names)} dist-info/METADATA files")
        with archive.open(names[0]) as fh:
            message = email.parser.BytesParser(policy=email.policy.compat32).parse(fh, headersonly=True)
    return tuple(str(v) for v in message.get_all("Requires-Dist") or ())


def _check_requirements(run: _Run, *, wheels: dict[str, Path], lock: Lock) -> tuple[str, ...]:
    """Every requirement of every locked wheel (extras not requested) is locked at a matching version, or omitted.

    What `pip check` asks of an environment, asked of the lock's own wheels: a lock that lost a dependency
    fails here, and a requirement the manifest leaves out (stack.omit) passes only when the lock records why.
    """
    env = marker_environment(python=lock.python, platform=lock.platform)
    omitted: dict[str, list[str]] = {}
    for name, path in sorted(wheels.items()):
        try:
            lines = wheel_requirements(path)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            run.unverifiable.append(f"{name}: {path.name}: its requirements cannot be read: {exc}")
            continue
        for line in lines:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                run.find("requirement", f"{name} declares an unreadable requirement {line!r}")
                continue
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = str(canonicalize_name(req.name))
            run.count("requirements_checked")
            if dep in lock.omitted:
                omitted.setdefault(dep, []).append(name)
                continue
            have = run.locked.get(dep)
            if have is None:
                run.find("requirement", f"{name} requires {req}, which the lock does not install and stack.omit "
                                        "does not name")
            elif req.specifier and not req.specifier.contains(have, prereleases=True):
                run.find("requirement", f"{name} requires {req}, but the lock installs {dep} {have}")
    run.count("requirements_omitted", sum(len(v) for v in omitted.values()))
    return tuple(f"{dep} (required by {', '.join(sorted(by))}): {lock.omitted[dep]}" for dep, by in sorted(omitted.items()))


def _in_paths(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _check_config(run: _Run, *, config: dict[str, Any], labels: dict[str, str], lock: Lock,
                  expected_cmd: tuple[str, ...] | None) -> None:
    for item in config.get("Env") or ():
        key = str(item).partition("=")[0]
        if key in HIJACK_ENV or key.startswith("LD_"):
            run.find("config", f"the image's environment sets {key}, which makes the loader or Python run other code")
    if config.get("Entrypoint"):
        run.find("config", f"the image has an entrypoint {config['Entrypoint']!r}; skupin images start their command directly")
    cmd = tuple(str(c) for c in config.get("Cmd") or ())
    if expected_cmd is not None and cmd != tuple(expected_cmd):
        run.find("config", f"the image's default command is {list(cmd)!r}, not the SKU's server command "
                           f"{list(expected_cmd)!r}")
    label = labels.get("io.skupin.lock-sha256")
    if label != lock.content_hash():
        run.find("label", f"the image's io.skupin.lock-sha256 label is {label!r}, not the lock's hash "
                          f"{lock.content_hash()[:12]}")
    preload = run.view.get("etc/ld.so.preload")
    if preload is not None and not run.base(preload):
        run.find("config", "/etc/ld.so.preload exists: the loader would inject a library into every process",
                 "etc/ld.so.preload")


def _check_debian(run: _Run, *, host: DpkgRecords | None, system: dict[str, tuple[str, ...]]) -> None:
    image = image_dpkg(run.view)
    installed = {p.name: p.version for p in image.packages}
    for layer, entries in sorted(system.items()):
        for item in entries:
            name, _, version = item.partition("=")
            if version and installed.get(name) != version:
                run.find("debian", f"apt {name}: the image has {installed.get(name) or 'nothing'}, the lock says "
                                   f"{version} ({layer} layer)")
    if not image.packages:
        return
    for pkg in image.packages:
        records = host if host is not None and host.has(pkg) else image
        run.count("debian_packages_host_records" if records is host else "debian_packages_image_records")
        for line in records.info(pkg, "list").splitlines():
            if line.strip():
                path = run.canonical(line.strip())
                run.owned.add(path)
                run.owner[path] = pkg
        for path, digest in parse_md5sums(records.info(pkg, "md5sums")).items():
            _debian_file(run, run.canonical(path), digest, pkg)
        for path, digest in records.conffiles(pkg).items():
            if re.fullmatch(r"[0-9a-f]{32}", digest):
                _debian_file(run, run.canonical(path), digest, pkg, conffile=True)


def _debian_file(run: _Run, path: str, digest: str, pkg: Package, *, conffile: bool = False) -> None:
    run.owned.add(path)
    entry = run.view.get(path)
    what = "conffile" if conffile else "file"
    if entry is None:
        if not MAY_BE_MISSING.match(path) and not conffile:
            run.find("debian", f"{what} of {pkg.name} {pkg.version} is missing", path)
        return
    if entry.kind == "f" and entry.md5 == digest:
        run.count("debian_files_verified")
        return
    if run.base(entry):
        run.count("debian_files_base_differs")
        return
    got = "not a regular file" if entry.kind != "f" else f"md5 {entry.md5}, dpkg recorded {digest}"
    run.find("debian", f"{what} of {pkg.name} {pkg.version} was changed ({got})", path)


def _check_wheels(run: _Run) -> None:
    for path, (sha, dist) in sorted(run.wheel.items()):
        entry = run.view.get(path)
        if entry is None:
            run.find("wheel", f"file of locked {dist} is missing", path)
        elif entry.kind == "f" and entry.sha256 != sha and _bytecode(run, path, entry):
            # a wheel that ships bytecode (numpy's distutils): the build compiled its source again, over it;
            # accepted only when it is exactly the code of its locked source, like every other bytecode file
            run.count("wheel_bytecode_recompiled")
        elif entry.kind != "f" or entry.sha256 != sha:
            got = (
                "not a regular file" if entry.kind != "f" else f"sha256 {entry.sha256[:16]}..., the wheel installs {sha[:16]}..."
            )
            run.find("wheel", f"file of locked {dist} was changed ({got})", path)
        else:
            run.count("wheel_files_verified")


_PYC = re.compile(r"^(?P<dir>.*)/__pycache__/(?P<name>[^/]+)\.(?P<tag>cpython-\d+)(?:\.opt-(?P<opt>[12]))?\.pyc$")


def _check_files(run: _Run) -> None:
    """Account for every file: in Python paths everything must be accounted, elsewhere everything that can run."""
    layout, view = run.layout, run.view
    scaffold = _venv_scaffold(run)
    for path, entry in sorted(view.entries.items()):
        if entry.kind == "d" or path in run.wheel or path in scaffold:
            continue
        in_python = _in_paths(path, layout.python_paths())
        if run.base(entry):
            run.count("base_files")
        elif path in run.owned:
            if in_python and entry.kind == "l":
                _owned_link(run, path, entry)
        elif _bytecode(run, path, entry):
            continue
        elif in_python:
            _unaccounted_python(run, path, entry)
        elif MAINTAINER_SCRIPTS.match(path):
            continue
        elif entry.kind == "f" and (entry.elf or entry.mode & 0o111 or path.endswith(CODE_SUFFIXES)):
            run.find("executable", "an executable, library or script that no Debian package or locked wheel "
                                   "installed", path)


def _accounted(run: _Run, path: str) -> bool:
    entry = run.view.get(path)
    return entry is not None and (path in run.wheel or path in run.owned or run.base(entry))


def _bytecode(run: _Run, path: str, entry: Entry) -> bool:
    """Queue a __pycache__ file of an accounted source for verification; False when it is not one."""
    pyc = _PYC.match(path)
    if not pyc or entry.kind != "f" or pyc.group("tag") != run.layout.pyc_tag:
        return False
    source = f"{pyc.group('dir')}/{pyc.group('name')}.py"
    real = run.view.resolve(source)
    src = run.view.get(real) if real else None
    if real is None or src is None or src.kind != "f" or not (_accounted(run, source) and _accounted(run, real)):
        return False
    run.pycs.append(Bytecode(pyc=path, source=source, real_source=real, opt=int(pyc.group("opt") or 0)))
    return True


def _owned_link(run: _Run, path: str, entry: Entry) -> None:
    """A Debian-owned link in a Python path must lead to an accounted file or folder of the image."""
    target = run.view.resolve(path)
    real = run.view.get(target) if target else None
    if real is None:
        run.find("debian", f"link of a Debian package points nowhere ({entry.target!r})", path)
    elif real.kind == "f" and target not in run.owned and target not in run.wheel and not run.base(real):
        run.find("debian", f"link of a Debian package points to /{target}, which no package or locked wheel "
                           "installed", path)


def _unaccounted_python(run: _Run, path: str, entry: Entry) -> None:
    name = path.rsplit("/", 1)[-1]
    if name == "METADATA" and ".dist-info/" in path:
        folder = path.split(".dist-info/")[0].rsplit("/", 1)[-1]
        dist, _, version = folder.rpartition("-")
        locked = run.locked.get(_canonical(dist))
        if locked is None:
            run.find("extra_distribution", f"distribution {dist} {version} is installed but not in the lock", path)
        else:
            run.find("extra_distribution", f"distribution {dist} {version} is installed, the lock says {locked}", path)
    elif name.endswith(".pth") or name.split(".")[0] in ("sitecustomize", "usercustomize"):
        run.find("hook", "a start-up hook that no locked wheel or Debian package installed (it runs in every "
                         "Python process)", path)
    else:
        what = "link" if entry.kind == "l" else "file"
        run.find("unaccounted", f"{what} in a Python path that no locked wheel, Debian package or venv set-up "
                                "installed", path)


def _canonical(name: str) -> str:

    return str(canonicalize_name(name))


def _venv_scaffold(run: _Run) -> set[str]:
    """The venv's own files (checked here): pyvenv.cfg and the interpreter links."""
    layout, view = run.layout, run.view
    venv, v = layout.venv, layout.python
    links = {f"{venv}/bin/python{v}": f"/{layout.interpreter}", f"{venv}/bin/python3": f"python{v}",
             f"{venv}/bin/python": f"python{v}", f"{venv}/lib64": "lib"}
    found = set()
    for path, target in links.items():
        entry = view.get(path)
        if entry is None:
            continue
        found.add(path)
        if entry.kind != "l" or entry.target != target:
            run.find("venv", f"expected a link to {target}, found {entry.kind} {entry.target!r}", path)
    cfg = f"{venv}/pyvenv.cfg"
    if view.get(cfg) is not None:
        found.add(cfg)
        _check_pyvenv(run, cfg)
    return found


def _check_pyvenv(run: _Run, path: str) -> None:
    try:
        text = run.view.read_file(path, max_bytes=4096).decode("utf-8")
    except (UntrustedInputError, UnicodeDecodeError) as exc:
        run.find("venv", f"unreadable: {exc}", path)
        return
    values = {k.strip(): v.strip() for k, _, v in (ln.partition("=") for ln in text.splitlines() if "=" in ln)}
    home = "/" + posixpath.dirname(run.layout.interpreter)
    if values.get("home") != home:
        run.find("venv", f"home is {values.get('home')!r}, not {home}: the venv would run another Python", path)
    if values.get("include-system-site-packages", "false").lower() != "false":
        run.find("venv", "include-system-site-packages is not false", path)
    extra = set(values) - {"home", "include-system-site-packages", "version", "executable", "command", "prompt"}
    if extra:
        run.find("venv", f"unexpected keys {sorted(extra)}", path)


def summary(report: IntegrityReport) -> str:
    c = report.counts
    return (f"{c.get('wheel_files_verified', 0)} wheel files, {c.get('debian_files_verified', 0)} Debian files "
            f"({c.get('debian_packages_host_records', 0)} packages checked against this host's dpkg records, "
            f"{c.get('debian_packages_image_records', 0)} against the image's), "
            f"{c.get('bytecode_verified', 0)} bytecode files and {c.get('base_files', 0)} base files accounted for; "
            f"{c.get('requirements_checked', 0)} requirements met"
            + (f" ({len(report.omitted)} left out by stack.omit: {', '.join(o.split(' ', 1)[0] for o in report.omitted)})"
               if report.omitted else ""))


# ---------------------------------------------------------------- an image on the engine


def locked_base_layers(*, docker, lock: Lock, layers: tuple[str, ...]) -> tuple[int, str]:
    """(how many bottom layers of the image are the locked base's, '' or why the base cannot be trusted)."""
    base = docker.inspect_image(lock.base.reference)
    if base is None:
        return 0, (f"the locked base {lock.base.reference} is not on this engine, so the image's bottom layers cannot "
                   f"be matched with it; fix: skupin base {lock.sku} (or pull the base)")
    if tuple(layers[: len(base.layers)]) != tuple(base.layers):
        return 0, f"the image is not built on the locked base {lock.base.reference} (its bottom layers differ)"
    return len(base.layers), ""


def inspect_image_files(*, docker, image_id: str, lock: Lock, state: Path, expected_cmd: tuple[str, ...] | None,
                        wheelhouse: Path | None = None,
                        on_event: Callable[[str], None] = lambda _: None) -> IntegrityReport:
    """The static check of a local image against `lock`: layers indexed (cached under `state`), wheels
    gathered into the wheel store, bytecode recompiled by a host interpreter; see the module docstring."""

    info = docker.inspect_image(image_id)
    if info is None:
        raise UntrustedInputError(f"image {image_id} is not on this engine")
    base_layers, base_problem = locked_base_layers(docker=docker, lock=lock, layers=info.layers)
    if base_problem and base_layers == 0 and "not on this engine" in base_problem:
        return IntegrityReport(unverifiable=(base_problem,))
    packages = lock.packages()
    stored = fetch_wheels(packages.values(), store=STORE, wheelhouse=wheelhouse, on_event=on_event)
    wheels = {name: stored[pkg.sha256] for name, pkg in packages.items()}
    view = image_view(docker=docker, image=info.id, layers=info.layers, cache=state / "cache", on_event=on_event)
    report = check_integrity(view=view, config=docker.image_config(info.id), labels=info.labels, lock=lock,
                             expected_cmd=expected_cmd,
                             wheels=wheels, base_layers=base_layers, host=host_dpkg(),
                             verify_bytecode=bytecode_verifier(cache=state / "cache"),
                             wheel_cache=state / "cache" / "wheel-files")
    if base_problem:
        report = report.model_copy(update={"findings": (Finding(kind="base", detail=base_problem), *report.findings)})
    return report
