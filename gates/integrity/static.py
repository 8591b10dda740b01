"""Decide from an image's files alone whether it is exactly its lock: the bytes are the lock, not what the metadata says.

The gate's `pins` check (gates/gate.py) runs this before it boots anything. Inputs: the image's
merged file view (skupin/imageview/layers.py) and the view of its base layers alone, its config, the
lock, the Dockerfile the lock renders to, the locked wheels from the host's wheel store, and the
locked base's layers (from the host's base record for bootstrap bases, builder/base.py). What is
accounted for, and how:

- **config**: the image's config is exactly what the rendered Dockerfile gives on the locked base
  (builder/imageconfig.py): every environment variable (PATH included), working folder, user,
  shell, entrypoint, command, ports, volumes, ONBUILD, stop signal and health check;
- **base**: files of the locked base's own layers (the image's bottom layers must be exactly the
  base's, by diff id; the base is pinned in the lock and, for bootstraps, in the host's record);
- **wheels**: every file a locked wheel installs, computed by running pypa installer (the same
  version the build binds) into a hashing destination laid out as the image's venv: module files,
  generated console scripts, INSTALLER and RECORD, each by sha256;
- **Debian**: every package above the base must be an apt package of the lock or the rendered
  Dockerfile, or in their Depends closure (read from this host's or the base's records where they
  know the package); a file owned by a package and written above the base must match the md5 of
  the package's records (this host's when it has the same version, else the base's when the base
  has it, read from the base layers alone, else the image's own), conffiles their recorded md5,
  links must lead to accounted files; no package owns a file of skupin's venv;
- **bytecode**: each ``__pycache__`` file must unmarshal to exactly the code its accounted source
  compiles to, with an interpreter byte-identical to the image's (skupin/imagetools/pyc_verify.py, run as an
  unprivileged, resource-limited process);
- **venv scaffold**: pyvenv.cfg (home, no system site-packages) and the interpreter links.

Everything under a Python path (the venv, the interpreter's stdlib and dist-packages folders, the
folder the gate mounts its probe in) that none of these accounts for fails, and so does any
unaccounted executable, ELF file or Python file elsewhere, a symlink above the base that nothing
accounts for and that sits in a PATH folder, leads out of the image or to an executable or code
(update-alternatives links count as accounted only as this host's own alternatives records have
them), a .pth/sitecustomize start-up hook, a distribution outside the lock and a lock label that
is not the lock's hash. Importable archives (.zip, .egg, .whl, .pyz, and in a Python path any
zip) are code wherever they sit, and what a .pth adds to sys.path is a Python path too. Where the
gate's sandbox mounts over the image (its /tmp tmpfs, the model folder, the probe's folder) only
empty folders may be: anything else there production sees and the gate does not.
Unowned data files (certificates, logs, caches) are counted and listed, not failed. What this
cannot see is described in docs/GATE.md ("Threat model").
"""

from __future__ import annotations

import base64
import email.parser
import email.policy
import fnmatch
import glob
import hashlib
import io
import json
import posixpath
import re
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

from installer import install
from installer.destinations import SchemeDictionaryDestination
from installer.records import Hash, RecordEntry
from installer.scripts import Script
from installer.sources import WheelFile
from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from pydantic import Field

from skupin.builder.base import base_record_path, read_base_record
from skupin.builder.catalog.lockfile import Lock
from skupin.builder.imageconfig import DockerfileConfigError, ImageConfig, apt_installs, config_of
from skupin.builder.lock import BUILD_STAGE, marker_environment
from skupin.builder.sourcebuild import BuiltWheel, read_built
from skupin.builder.wheels import fetch_wheels, file_sha256, store_path, wheel_store
from skupin.common.errors import SkupinError
from skupin.common.model import Frozen
from skupin.common.untrusted import UntrustedInputError, printable
from skupin.dockerd import Docker
from skupin.engines import MODEL_MOUNT
from skupin.gates.integrity.bytecode import bytecode_verifier
from skupin.gates.sandbox import SANDBOX_TMPFS
from skupin.imageview.debian import DpkgRecords, Package, declared_packages, host_dpkg, image_dpkg, parse_md5sums
from skupin.imageview.layers import Entry, FileView, image_view

# Environment variables that make the dynamic loader or the interpreter load other code.
HIJACK_ENV = ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
              "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONEXECUTABLE", "PYTHONSAFEPATH", "PYTHONPYCACHEPREFIX",
              "PYTHONWARNINGS", "PYTHONBREAKPOINT", "PYTHONPLATLIBDIR", "BASH_ENV", "ENV")
# Debian paths whose files may be missing (dpkg path-excludes of documentation).
MAY_BE_MISSING = re.compile(r"^usr/share/(doc|man|info|locale|lintian|linda|groff)/")
MAINTAINER_SCRIPTS = re.compile(r"^var/lib/dpkg/info/[^/]+\.(preinst|postinst|prerm|postrm|config|templates)$")
# Importable archives: zipimport loads code from a zip (a wheel, an egg, a zipapp) that sys.path, a .pth or PYTHONPATH
# names, so an archive is code like a module, wherever it sits.
ARCHIVE_SUFFIXES = (".zip", ".egg", ".whl", ".pyz")
ZIP_MAGIC = b"PK\x03\x04"  # a zip's local-file header: what zipimport reads, whatever the name
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pth", ".so", ".sh", ".pl", ".pm", *ARCHIVE_SUFFIXES)
MAX_PTH_BYTES = 1 << 20
MAX_MAGIC_READ = 16 << 20  # an unaccounted file of a Python path read to say whether it is a zip
# Where the gate's sandbox mounts over the image (gates/sandbox.py's tmpfs, the model at its production path; the
# probe's folder is ImageLayout.probe_dir): what the image holds there production sees and the gate does not.
SANDBOX_MOUNTS = (*SANDBOX_TMPFS, MODEL_MOUNT)
# A process's home is where engines keep what they load at run time without asking: Triton's compiled kernels in
# .triton, CUDA's JIT cache in .nv, Inductor's and vLLM's compiled graphs, torch extensions and Hugging Face's hub in
# .cache, MIOpen's kernel database in .config, user site-packages in .local. The sandbox gives every process an empty
# HOME on its tmpfs and points every cache variable there (SANDBOX_ENV), so whatever an image ships in a home
# production would load and the gate would not: nothing may be there above the base.
MAX_PASSWD_BYTES = 1 << 20
MAX_LISTED = 25
DEBIAN_ARCH = {"linux/amd64": "amd64", "linux/arm64": "arm64"}
# The image config fields compared with the render, and how a finding names each.
CONFIG_FIELDS = (("entrypoint", "entrypoint"), ("cmd", "default command"), ("working_dir", "working folder (WorkingDir)"),
                 ("user", "user"), ("shell", "shell"), ("exposed_ports", "set of exposed ports"),
                 ("volumes", "set of volumes"), ("on_build", "list of ONBUILD triggers"), ("stop_signal", "stop signal"),
                 ("healthcheck", "health check"))

Kind = Literal["config", "label", "base", "debian", "wheel", "unaccounted", "hook", "extra_distribution",
               "bytecode", "venv", "executable", "requirement", "sandbox"]


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
    probe_dir: str = "skupin"  # where the gate mounts its probe (gates/gate.py PROBE_DIR_MOUNT): the probe's sys.path[0]

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
                f"usr/local/lib/python{v}", "usr/local/lib/python3/dist-packages", f"usr/lib/python{v}/site-packages",
                self.probe_dir)

    def sandbox_mounts(self) -> tuple[str, ...]:
        """Folders the gate's sandbox mounts over (relative to /): the tmpfs, the model, the probe's folder."""
        return tuple(dict.fromkeys(m.strip("/") for m in (*SANDBOX_MOUNTS, self.probe_dir)))

    def debian_python_paths(self) -> tuple[str, ...]:
        """The Python paths Debian packages install into; the others (the venv, /usr/local) no package owns."""
        v = self.python
        return (f"usr/lib/python{v}", f"usr/lib/python{v.replace('.', '')}.zip", "usr/lib/python3/dist-packages")


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

    def _write(self, scheme: str, path: str, stream: BinaryIO, is_executable: bool) -> RecordEntry:

        digest, size = hashlib.sha256(), 0
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
        target = posixpath.normpath(posixpath.join(self._inner.scheme_dict[scheme], path))
        self.files[target.lstrip("/")] = digest.hexdigest()
        encoded = base64.urlsafe_b64encode(digest.digest()).decode("ascii").rstrip("=")  # as installer writes it
        return RecordEntry(path, Hash("sha256", encoded), size)

    def _script(self, name: str, module: str, attr: str, section: str) -> RecordEntry:

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


# ---------------------------------------------------------------- the check


@dataclass(frozen=True)
class _Image:
    """The image under check and what it is checked against; read by every step, changed by none."""

    view: FileView
    base_view: FileView
    layout: ImageLayout
    base_layers: int
    host: DpkgRecords | None = None
    locked: Mapping[str, str] = field(default_factory=dict)  # the lock's distributions: name -> version
    path_dirs: tuple[str, ...] = ()  # the expected PATH's folders, as written and resolved in the image
    path_order: tuple[str, ...] = ()  # the expected PATH's folders resolved in the image, in lookup order
    pth_paths: tuple[str, ...] = ()  # folders and archives the image's .pth files add to sys.path (beyond the layout's)

    def base(self, entry: Entry) -> bool:
        return entry.layer < self.base_layers

    def canonical(self, path: str) -> str:
        """`path` with its folder resolved through the image's links (usr-merge: bin -> usr/bin)."""
        folder, _, name = path.strip("/").rpartition("/")
        real = (self.view.resolve(folder) or folder) if folder else ""
        return f"{real}/{name}" if real else name


@dataclass
class _Log:
    """What the steps found so far, in the order they found it: the IntegrityReport's findings, unverifiable
    parts and counts (appended to only)."""

    findings: list[Finding] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def find(self, kind: Kind, detail: str, path: str = "") -> None:
        self.findings.append(Finding(kind=kind, path=path, detail=printable(detail, 400)))

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


@dataclass(frozen=True)
class _DebianFiles:
    """The Debian step's result: the paths the packages' records name (and by which package), and the files whose
    md5 matched a record. Filled by that step only, read by the later ones."""

    owned: set[str] = field(default_factory=set)
    owner: dict[str, Package] = field(default_factory=dict)
    verified: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Accounted:
    """What the Debian records and the locked wheels account for: the input of the wheel and file steps."""

    debian: _DebianFiles
    wheel: Mapping[str, tuple[str, str]]  # path -> (sha256, distribution) of every locked wheel's file


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


def check_integrity(*, view: FileView, base_view: FileView, config: dict[str, Any], labels: dict[str, str], lock: Lock,
                    expected: ImageConfig | None, apt_roots: tuple[str, ...], wheels: dict[str, Path], base_layers: int,
                    host: DpkgRecords | None, verify_bytecode: VerifyBytecode, layout: ImageLayout | None = None,
                    wheel_cache: Path | None = None) -> IntegrityReport:
    """Every rule of the module docstring over one image; the findings say which file broke which rule.

    `base_view` is the file system of the image's bottom `base_layers` layers alone (the locked base);
    `expected` the config the rendered Dockerfile gives (None: unknown, which leaves the check
    unverifiable); `apt_roots` the Debian packages the rendered Dockerfile installs by name.
    Steps, in order, each taking what it needs and returning what a later one reads: config, Debian (the files
    the records account for), the locked wheels' files, their requirements, every other file (with the wheels, the
    bytecode to verify), the bytecode, the unowned data.
    """
    layout = layout or ImageLayout(python=lock.python)
    path_order: tuple[str, ...] = ()
    path_dirs: tuple[str, ...] = ()
    if expected is not None:
        folders = expected.path_dirs()
        path_order = tuple(dict.fromkeys(view.resolve(d) or d for d in folders))
        path_dirs = tuple(dict.fromkeys([*folders, *path_order]))
    image = _Image(view=view, base_view=base_view, layout=layout, base_layers=base_layers, host=host,
                   locked={name: pkg.version for name, pkg in lock.packages().items()}, path_dirs=path_dirs,
                   path_order=path_order)
    log = _Log()
    image = replace(image, pth_paths=_pth_paths(image, log))
    _check_config(image, log, config=config, labels=labels, lock=lock, expected=expected)
    _check_sandbox_mounts(image, log)
    _check_home_caches(image, log, _homes(image, log, config))
    # a source-built engine's compiler and build packages live in its build stage, never in the image
    image_system = {layer: items for layer, items in lock.system.items() if layer != BUILD_STAGE}
    system = {item.partition("=")[0] for items in image_system.values() for item in items}
    debian = _check_debian(image, log, system=image_system, roots=tuple(dict.fromkeys([*sorted(system), *apt_roots])),
                           arch=DEBIAN_ARCH.get(lock.platform, ""))
    wheel, problems = expected_wheel_files(wheels, layout=layout, cache=wheel_cache)
    log.unverifiable.extend(problems)
    accounted = _Accounted(debian=debian, wheel=wheel)
    pycs = _check_wheels(image, log, accounted)
    omitted = _check_requirements(image, log, wheels=wheels, lock=lock)
    pycs += _check_files(image, log, accounted)
    interpreter = _check_bytecode(image, log, pycs, debian=debian, verify_bytecode=verify_bytecode)
    verified = {item.pyc for item in pycs}
    data = sorted(p for p, e in view.entries.items() if e.kind == "f" and not image.base(e) and p not in debian.owned
                  and p not in wheel and p not in verified and not _in_paths(p, layout.python_paths())
                  and not _in_paths(p, image.pth_paths)
                  and not MAINTAINER_SCRIPTS.match(p))
    log.count("unowned_data", len(data))
    return IntegrityReport(findings=tuple(log.findings), unverifiable=tuple(log.unverifiable), counts=log.counts,
                           unowned_data=tuple(data[:MAX_LISTED]), interpreter=interpreter, omitted=omitted)


def _check_bytecode(image: _Image, log: _Log, pycs: list[Bytecode], *, debian: _DebianFiles,
                    verify_bytecode: VerifyBytecode) -> str | None:
    """Each queued bytecode file is exactly the code its source compiles to; the host interpreter that said so."""
    if not pycs:
        return None
    layout = image.layout
    owner = debian.owner.get(image.view.resolve(layout.interpreter) or "")
    failures, unverifiable, interpreter = verify_bytecode(pycs, image.view, layout.interpreter,
                                                          upstream_version(owner.version) if owner else None)
    for line in failures:
        log.find("bytecode", line)
    log.unverifiable.extend(unverifiable)
    log.count("bytecode_verified", len(pycs) - len(failures) if not unverifiable else 0)
    return interpreter


def wheel_requirements(wheel: Path) -> tuple[str, ...]:
    """The Requires-Dist lines of a wheel's METADATA (a locked file from the host's wheel store, not the image)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ValueError(f"{wheel.name}: {len(names)} dist-info/METADATA files")
        with archive.open(names[0]) as fh:
            message = email.parser.BytesParser(policy=email.policy.compat32).parse(fh, headersonly=True)
    return tuple(str(v) for v in message.get_all("Requires-Dist") or ())


def _check_requirements(image: _Image, log: _Log, *, wheels: dict[str, Path], lock: Lock) -> tuple[str, ...]:
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
            log.unverifiable.append(f"{name}: {path.name}: its requirements cannot be read: {exc}")
            continue
        for line in lines:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                log.find("requirement", f"{name} declares an unreadable requirement {line!r}")
                continue
            try:
                applies = req.marker is None or req.marker.evaluate({**env, "extra": ""})
            except (InvalidMarker, UndefinedEnvironmentName, UndefinedComparison) as exc:
                log.find("requirement", f"{name} declares a requirement whose marker cannot be evaluated: {line!r} ({exc})")
                continue
            if not applies:
                continue
            dep = str(canonicalize_name(req.name))
            if dep in lock.omitted:
                omitted.setdefault(dep, []).append(name)
                continue
            have = image.locked.get(dep)
            if have is None:
                log.find("requirement", f"{name} requires {req}, which the lock does not install and stack.omit "
                                        "does not name")
            elif req.specifier and not req.specifier.contains(have, prereleases=True):
                log.find("requirement", f"{name} requires {req}, but the lock installs {dep} {have}")
            else:
                log.count("requirements_met")
    log.count("requirements_omitted", sum(len(v) for v in omitted.values()))
    return tuple(f"{dep} (required by {', '.join(sorted(by))}): {lock.omitted[dep]}" for dep, by in sorted(omitted.items()))


def _in_paths(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _check_config(image: _Image, log: _Log, *, config: dict[str, Any], labels: dict[str, str], lock: Lock,
                  expected: ImageConfig | None) -> None:
    seen: set[str] = set()
    for item in config.get("Env") or ():
        key, sep, _ = str(item).partition("=")
        if not sep:
            log.find("config", f"the image's environment has an entry without '=': {str(item)[:80]!r}")
        elif key in seen:
            log.find("config", f"the image's environment sets {key} more than once")
        seen.add(key)
    if expected is None:
        log.unverifiable.append("the config the rendered Dockerfile gives is not known, so the image's config "
                                "(environment, command, working folder, user) was not compared with it")
    else:
        _compare_config(log, ImageConfig.from_engine(config), expected)
    label = labels.get("io.skupin.lock-sha256")
    if label != lock.content_hash():
        log.find("label", f"the image's io.skupin.lock-sha256 label is {label!r}, not the lock's hash "
                          f"{lock.content_hash()[:12]}")
    preload = image.view.get("etc/ld.so.preload")
    if preload is not None and not image.base(preload):
        log.find("config", "/etc/ld.so.preload exists: the loader would inject a library into every process",
                 "etc/ld.so.preload")


def _compare_config(log: _Log, got: ImageConfig, want: ImageConfig) -> None:
    """The image's config must be exactly the render's: every variable of the environment, then each other field."""
    have, wanted = got.env_dict(), want.env_dict()
    for key in sorted(set(have) | set(wanted)):
        value, expected = have.get(key), wanted.get(key)
        if value == expected:
            continue
        hook = (", which makes the loader or Python run other code"
                if key in HIJACK_ENV or key.startswith("LD_") else "")
        if expected is None:
            log.find("config", f"the image's environment sets {key}={value!r}, which the rendered Dockerfile does not "
                               f"set{hook}")
        elif value is None:
            log.find("config", f"the image's environment does not set {key}, which the rendered Dockerfile sets to "
                               f"{expected!r}")
        else:
            log.find("config", f"the image's environment sets {key}={value!r}, the rendered Dockerfile gives "
                               f"{expected!r}{hook}")
    for name, what in CONFIG_FIELDS:
        value, expected = getattr(got, name), getattr(want, name)
        if value != expected:
            log.find("config", f"the image's {what} is {_shown(value)}, the rendered Dockerfile gives {_shown(expected)}")


def _shown(value: Any) -> str:
    if not value:
        return "none"
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _check_status_entries(log: _Log, *, image: DpkgRecords, base: DpkgRecords, arch: str) -> None:
    """One installed entry per package name, for the image's architecture (or all).

    Declared is by name: a second status entry under a declared name (another architecture or version) would
    bring its own, image-written records along. Skupin images install one architecture, one entry per name.
    """
    seen: set[str] = set()
    for pkg in image.packages:
        if pkg.name in seen:
            log.find("debian", f"{pkg.name} has more than one installed entry in the dpkg status file",
                     "var/lib/dpkg/status")
        seen.add(pkg.name)
        if arch and pkg.arch not in (arch, "all") and not base.has(pkg):
            log.find("debian", f"{pkg.label()} is installed for architecture {pkg.arch or 'none'!r}, not the image's "
                               f"{arch!r}", "var/lib/dpkg/status")


def _check_debian(image: _Image, log: _Log, *, system: dict[str, tuple[str, ...]], roots: tuple[str, ...],
                  arch: str) -> _DebianFiles:
    """Every installed package: above the base only what the lock and the render declare, its files by its records.
    Returns the paths the records name and the files whose md5 they verified."""
    host = image.host
    files = _DebianFiles()
    records_of_image, base = image_dpkg(image.view), image_dpkg(image.base_view)
    installed = {p.name: p.version for p in records_of_image.packages}
    _check_status_entries(log, image=records_of_image, base=base, arch=arch)
    for layer, entries in sorted(system.items()):
        for item in entries:
            name, _, version = item.partition("=")
            if version and installed.get(name) != version:
                log.find("debian", f"apt {name}: the image has {installed.get(name) or 'nothing'}, the lock says "
                                   f"{version} ({layer} layer)")
    if not records_of_image.packages:
        return files
    trusted = [r for r in (host, base) if r is not None]
    declared, from_image = declared_packages(roots, records_of_image, trusted)
    log.count("debian_depends_from_image_records", len(from_image))
    for pkg in records_of_image.packages:
        if not base.has(pkg) and pkg.name not in declared:
            log.find("debian", f"{pkg.label()} ({pkg.arch or 'no architecture'}) is a Debian package outside the lock: "
                               "not in the locked base, not an apt package of the lock or the rendered Dockerfile, "
                               "nor in their Depends", "var/lib/dpkg/status")
        records, source = ((host, "host") if host is not None and host.has(pkg) else
                           (base, "base") if base.has(pkg) else (records_of_image, "image"))
        log.count(f"debian_packages_{source}_records")
        for line in records.info(pkg, "list").splitlines():
            if line.strip():
                _owned(image, log, files, image.canonical(line.strip()), pkg)
        for path, digest in parse_md5sums(records.info(pkg, "md5sums")).items():
            _debian_file(image, log, files, image.canonical(path), digest, pkg)
        for path, digest in records.conffiles(pkg).items():
            if re.fullmatch(r"[0-9a-f]{32}", digest):
                _debian_file(image, log, files, image.canonical(path), digest, pkg, conffile=True)
    return files


def _owned(image: _Image, log: _Log, files: _DebianFiles, path: str, pkg: Package) -> None:
    files.owner[path] = pkg
    if path in files.owned:
        return
    files.owned.add(path)
    entry = image.view.get(path)
    if (entry is not None and entry.kind != "d" and not image.base(entry)
            and _in_paths(path, image.layout.python_paths()) and not _in_paths(path, image.layout.debian_python_paths())):
        log.find("debian", f"{pkg.label()} claims a file of a Python path no Debian package installs into (skupin's "
                           "venv, /usr/local)", path)


def _debian_file(image: _Image, log: _Log, files: _DebianFiles, path: str, digest: str, pkg: Package, *,
                 conffile: bool = False) -> None:
    _owned(image, log, files, path, pkg)
    entry = image.view.get(path)
    what = "conffile" if conffile else "file"
    if entry is None:
        if not MAY_BE_MISSING.match(path) and not conffile:
            log.find("debian", f"{what} of {pkg.label()} is missing", path)
        return
    if entry.kind == "f" and entry.md5 == digest:
        files.verified.add(path)
        log.count("debian_files_verified")
        return
    if image.base(entry):
        log.count("debian_files_base_differs")
        return
    got = "not a regular file" if entry.kind != "f" else f"md5 {entry.md5}, dpkg recorded {digest}"
    log.find("debian", f"{what} of {pkg.label()} was changed ({got})", path)


def _check_wheels(image: _Image, log: _Log, accounted: _Accounted) -> list[Bytecode]:
    """Every file of every locked wheel is in the image with the wheel's bytes; the bytecode it ships that the build
    compiled again, to verify."""
    pycs: list[Bytecode] = []
    for path, (sha, dist) in sorted(accounted.wheel.items()):
        entry = image.view.get(path)
        if entry is None:
            log.find("wheel", f"file of locked {dist} is missing", path)
            continue
        pyc = _bytecode(image, accounted, path, entry) if entry.kind == "f" and entry.sha256 != sha else None
        if pyc is not None:
            # a wheel that ships bytecode (numpy's distutils): the build compiled its source again, over it;
            # accepted only when it is exactly the code of its locked source, like every other bytecode file
            pycs.append(pyc)
            log.count("wheel_bytecode_recompiled")
        elif entry.kind != "f" or entry.sha256 != sha:
            got = (
                "not a regular file" if entry.kind != "f" else f"sha256 {entry.sha256[:16]}..., the wheel installs {sha[:16]}..."
            )
            log.find("wheel", f"file of locked {dist} was changed ({got})", path)
        else:
            log.count("wheel_files_verified")
    return pycs


_PYC = re.compile(r"^(?P<dir>.*)/__pycache__/(?P<name>[^/]+)\.(?P<tag>cpython-\d+)(?:\.opt-(?P<opt>[12]))?\.pyc$")


def _check_files(image: _Image, log: _Log, accounted: _Accounted) -> list[Bytecode]:
    """Account for every file: in Python paths everything must be accounted, elsewhere everything that can run.
    Returns the bytecode files of accounted sources, to verify."""
    layout, view = image.layout, image.view
    pycs: list[Bytecode] = []
    scaffold = _venv_scaffold(image, log)
    for path, entry in sorted(view.entries.items()):
        if entry.kind == "d" or path in accounted.wheel or path in scaffold:
            continue
        in_python = _in_paths(path, layout.python_paths()) or _in_paths(path, image.pth_paths)
        if image.base(entry):
            log.count("base_files")
        elif (pyc := _bytecode(image, accounted, path, entry)) is not None:
            pycs.append(pyc)
        elif path in accounted.debian.owned:
            _owned_entry(image, log, accounted, path, entry)
        elif in_python:
            _unaccounted_python(image, log, path, entry)
        elif MAINTAINER_SCRIPTS.match(path):
            continue
        elif entry.kind == "f" and path.endswith(ARCHIVE_SUFFIXES):
            log.find("executable", "an importable archive (zip) that no Debian package or locked wheel installed: "
                                   "Python runs code from it wherever sys.path, a .pth or PYTHONPATH names it", path)
        elif entry.kind == "f" and (entry.elf or entry.mode & 0o111 or path.endswith(CODE_SUFFIXES)):
            log.find("executable", "an executable, library or script that no Debian package or locked wheel "
                                   "installed", path)
        elif entry.kind == "l":
            _unowned_link(image, log, accounted, path, entry)
    return pycs


def _accounted(image: _Image, accounted: _Accounted, path: str) -> bool:
    entry = image.view.get(path)
    return entry is not None and (path in accounted.wheel or path in accounted.debian.owned or image.base(entry))


def _verified(image: _Image, accounted: _Accounted, path: str) -> bool:
    """A file whose bytes are accounted: from the base, a locked wheel's hash, or a Debian record's md5."""
    entry = image.view.get(path)
    return entry is not None and (image.base(entry) or path in accounted.wheel or path in accounted.debian.verified)


def _bytecode(image: _Image, accounted: _Accounted, path: str, entry: Entry) -> Bytecode | None:
    """The Bytecode to verify of a __pycache__ file of an accounted source; None when it is not one."""
    pyc = _PYC.match(path)
    if not pyc or entry.kind != "f" or pyc.group("tag") != image.layout.pyc_tag:
        return None
    source = f"{pyc.group('dir')}/{pyc.group('name')}.py"
    real = image.view.resolve(source)
    src = image.view.get(real) if real else None
    if real is None or src is None or src.kind != "f" or not (
            _accounted(image, accounted, source) and _accounted(image, accounted, real)):
        return None
    return Bytecode(pyc=path, source=source, real_source=real, opt=int(pyc.group("opt") or 0))


def _owned_entry(image: _Image, log: _Log, accounted: _Accounted, path: str, entry: Entry) -> None:
    """A path a Debian package's records name, written above the base: its md5 verified, or a link to accounted files."""
    pkg = accounted.debian.owner.get(path)
    name = pkg.label() if pkg else "a Debian package"
    if entry.kind == "l":
        _owned_link(image, log, accounted, path, entry)
    elif entry.kind != "f":
        log.find("debian", f"owned by {name} but neither a regular file, a folder nor a link", path)
    elif path not in accounted.debian.verified:
        log.find("debian", f"a file of {name} whose md5 no dpkg record gives (its .list names it, its md5sums do "
                           "not): its bytes are not accounted for", path)


def _owned_link(image: _Image, log: _Log, accounted: _Accounted, path: str, entry: Entry) -> None:
    """A Debian-owned link above the base (dpkg records that it exists, not where it leads): it must lead into the
    image, and to accounted bytes when it sits in a Python path or leads to an executable, a library or code."""
    target = image.view.resolve(path)
    real = image.view.get(target) if target else None
    if target is None or real is None:
        log.find("debian", f"link of a Debian package points nowhere in the image ({entry.target!r})", path)
    elif real.kind == "f" and not _verified(image, accounted, target) and (
            _in_paths(path, image.layout.python_paths()) or real.elf or real.mode & 0o111
            or target.endswith(CODE_SUFFIXES)):
        log.find("debian", f"link of a Debian package points to /{target}, which no package or locked wheel "
                           "installed", path)


def _unowned_link(image: _Image, log: _Log, accounted: _Accounted, path: str, entry: Entry) -> None:
    """A link above the base that nothing accounts for: data, unless a command, an import or a loader may reach
    code through it."""
    target = image.view.resolve(path)
    real = image.view.get(target) if target else None
    why = ""
    if _alternative(image, accounted, path, entry):
        shadowed = _shadows(image, path)
        if not shadowed:
            log.count("alternatives_links")
            return
        why = f"an alternatives link that shadows /{shadowed}, a command of a later folder of PATH"
    elif _in_paths(path, image.path_dirs) or _in_paths(image.canonical(path), image.path_dirs):
        why = "it sits in a folder of PATH, where it shadows or adds a command"
    elif path.endswith(CODE_SUFFIXES):
        why = "its name makes it code to Python, the loader or a shell"
    elif target is None or real is None:
        why = f"it leads out of the image or nowhere ({entry.target!r}), where a container could put code"
    elif real.kind == "f" and real.mode & 0o111:
        why = f"it leads to the executable /{target}, which would run under another name"
    elif _in_paths(target, image.layout.python_paths()) or _in_paths(target, image.path_dirs):
        why = f"it leads into /{target}, a Python path or a folder of PATH"
    elif real.kind == "f" and (real.elf or target.endswith(CODE_SUFFIXES)) and not _verified(image, accounted, target):
        why = f"it leads to /{target}, code that no package or locked wheel installed"
    if why:
        log.find("unaccounted", f"a link that no Debian package, locked wheel or venv set-up made: {why}", path)
    else:
        log.count("unowned_links")


def _alternative(image: _Image, accounted: _Accounted, path: str, entry: Entry) -> bool:
    """A link update-alternatives made, as this host's own alternatives records have it (the image's records are
    not trusted): /etc/alternatives/NAME -> one of NAME's choices, or NAME's link -> /etc/alternatives/NAME; either
    way it must end at a file the base has or a Debian record verified."""
    if image.host is None:
        return False
    if path.startswith("etc/alternatives/"):
        known, choice = image.host.alternative(path.rsplit("/", 1)[-1]), entry.target
    else:
        name = entry.target.removeprefix("/etc/alternatives/")
        known = image.host.alternative(name) if name != entry.target else None
        hop = image.view.get(f"etc/alternatives/{name}")
        if known is None or image.canonical(known[0]) != image.canonical(path) or hop is None or hop.kind != "l":
            return False
        choice = hop.target
    if known is None or choice not in known[1]:
        return False
    chosen = image.view.get(image.canonical(choice))  # the choice itself is a path of the base or of a Debian package
    target = image.view.resolve(path)
    real = image.view.get(target) if target else None
    debian = accounted.debian
    return (chosen is not None and (image.base(chosen) or image.canonical(choice) in debian.owned) and real is not None
            and target is not None and real.kind == "f" and (image.base(real) or target in debian.verified))


def _shadows(image: _Image, path: str) -> str:
    """The command of a later PATH folder that `path` (in a PATH folder) hides, or ''."""
    folder, _, name = image.canonical(path).rpartition("/")
    if folder not in image.path_order:
        return ""
    for later in image.path_order[image.path_order.index(folder) + 1:]:
        if later != folder and image.view.get(f"{later}/{name}") is not None:
            return f"{later}/{name}"
    return ""


def _unaccounted_python(image: _Image, log: _Log, path: str, entry: Entry) -> None:
    name = path.rsplit("/", 1)[-1]
    if name == "METADATA" and ".dist-info/" in path:
        folder = path.split(".dist-info/")[0].rsplit("/", 1)[-1]
        dist, _, version = folder.rpartition("-")
        locked = image.locked.get(_canonical(dist))
        if locked is None:
            log.find("extra_distribution", f"distribution {dist} {version} is installed but not in the lock", path)
        else:
            log.find("extra_distribution", f"distribution {dist} {version} is installed, the lock says {locked}", path)
    elif name.endswith(".pth") or name.split(".")[0] in ("sitecustomize", "usercustomize"):
        log.find("hook", "a start-up hook that no locked wheel or Debian package installed (it runs in every "
                         "Python process)", path)
    elif entry.kind == "f" and (name.endswith(ARCHIVE_SUFFIXES) or _zip_magic(image, path)):
        where = "a Python path" if _in_paths(path, image.layout.python_paths()) else "a path a .pth adds to sys.path"
        log.find("unaccounted", f"an importable archive (zip) in {where} that no locked wheel or Debian package "
                                "installed: Python imports code from it", path)
    else:
        what = "link" if entry.kind == "l" else "file"
        log.find("unaccounted", f"{what} in a Python path that no locked wheel, Debian package or venv set-up "
                                "installed", path)


def _zip_magic(image: _Image, path: str) -> bool:
    """Whether the image's file `path` starts with a zip's local-file header (zipimport reads it whatever its name)."""
    entry = image.view.get(path)
    if entry is None or entry.kind != "f" or not len(ZIP_MAGIC) <= entry.size <= MAX_MAGIC_READ:
        return False  # a bigger one is not read for its name's sake: it fails as an unaccounted file all the same
    try:
        return image.view.read_file(path, max_bytes=MAX_MAGIC_READ).startswith(ZIP_MAGIC)
    except (UntrustedInputError, OSError, KeyError):
        return False  # too big or unreadable here: it fails as an unaccounted file all the same


def _pth_paths(image: _Image, log: _Log) -> tuple[str, ...]:
    """What the image's .pth files add to sys.path outside the layout's Python paths (as site.addpackage reads them:
    every line that is not blank, a comment or an `import` line names a folder or an archive, relative to the .pth's
    own folder). Those are Python paths too: everything there must be accounted for, archives included."""
    layout, view = image.layout, image.view
    found: list[str] = []
    for path, entry in sorted(view.entries.items()):
        if not path.endswith(".pth") or entry.kind not in "fl" or not _in_paths(path, layout.python_paths()):
            continue
        real = view.resolve(path)
        target = view.get(real) if real else None
        if target is None or target.kind != "f":
            continue  # site skips a .pth it cannot open
        try:
            text = view.read_file(real or path, max_bytes=MAX_PTH_BYTES).decode("utf-8", "replace")
        except UntrustedInputError as exc:
            log.unverifiable.append(f"/{path}: a .pth whose entries cannot be read here, so what it adds to sys.path "
                                    f"was not checked: {exc}")
            continue
        folder = posixpath.dirname(path)
        for line in text.splitlines():
            line = line.rstrip()
            if not line or line.startswith("#") or line.startswith(("import ", "import\t")):
                continue
            named = posixpath.normpath(posixpath.join("/" + folder, line)).lstrip("/")
            for added in dict.fromkeys((named, view.resolve(named) or named)):
                if added and not _in_paths(added, layout.python_paths()):
                    found.append(added)
    return tuple(dict.fromkeys(found))


def _check_sandbox_mounts(image: _Image, log: _Log) -> None:
    """Nothing but empty folders where the gate's sandbox mounts over the image (/tmp, the model, the probe's
    folder): a file or link there is what a plain `docker run` would see and the gate never does."""
    mounts = image.layout.sandbox_mounts()
    for path, entry in sorted(image.view.entries.items()):
        if entry.kind != "d" and _in_paths(path, mounts):
            mount = next(m for m in mounts if _in_paths(path, (m,)))
            what = "a link" if entry.kind == "l" else "a file" if entry.kind == "f" else "an entry"
            how = ("a tmpfs" if "/" + mount in SANDBOX_TMPFS else
                   "the model folder" if "/" + mount == MODEL_MOUNT else "the probe's folder")
            log.find("sandbox", f"{what} under /{mount}: the gate's sandbox mounts {how} there: production would "
                                "see it, the gate would not", path)


def _homes(image: _Image, log: _Log, config: dict[str, Any]) -> tuple[str, ...]:
    """Every home a process of the image may have (relative to /, `home/*` a pattern): root's, any under /home, the
    HOME its config sets, and the home the image's own /etc/passwd gives the config's user (where Docker takes HOME
    from when the config sets none)."""
    homes = ["root", "home/*"]
    env = dict(str(item).partition("=")[::2] for item in config.get("Env") or ())
    if env.get("HOME", "").strip("/"):
        homes.append(posixpath.normpath("/" + env["HOME"]).strip("/"))
    user = (str(config.get("User") or "root").split(":")[0]) or "root"
    passwd = image.view.get("etc/passwd")
    if passwd is not None and passwd.kind == "f":
        try:
            text = image.view.read_file("etc/passwd", max_bytes=MAX_PASSWD_BYTES).decode("utf-8", "replace")
        except (UntrustedInputError, OSError, KeyError) as exc:
            log.unverifiable.append(f"/etc/passwd cannot be read here, so the home its user gets was not checked: {exc}")
            text = ""
        for line in text.splitlines():
            fields = line.split(":")
            if len(fields) >= 6 and user in (fields[0], fields[2]) and fields[5].strip("/"):
                homes.append(posixpath.normpath("/" + fields[5]).strip("/"))
    return tuple(dict.fromkeys(glob.escape(h) if h != "home/*" else h for h in homes))


def _check_home_caches(image: _Image, log: _Log, homes: tuple[str, ...]) -> None:
    """Nothing above the base in a home (`homes`, patterns of _homes), the home itself included (a link put there
    leads its caches elsewhere): the gate's sandbox gives every process an empty home, production the image's own."""
    for path, entry in sorted(image.view.entries.items()):
        if image.base(entry) or entry.kind == "d":
            continue  # folders hold nothing by themselves; a home made above the base is judged by what is in it
        home = next((h for h in homes if fnmatch.fnmatchcase(path, h) or fnmatch.fnmatchcase(path, h + "/*")), None)
        if home is None:
            continue
        folder = "/".join(path.split("/")[:home.count("/") + 1])
        what = "a link" if entry.kind == "l" else "a file" if entry.kind == "f" else "an entry"
        log.find("sandbox", f"{what} in the home /{folder}, where engines keep what they load at run time (compiled "
                            "kernels and graphs, downloaded models, user packages): the gate's sandbox gives every "
                            "process an empty home, so production would load it and the gate would not", path)


def _canonical(name: str) -> str:

    return str(canonicalize_name(name))


def _venv_scaffold(image: _Image, log: _Log) -> set[str]:
    """The venv's own files (checked here): pyvenv.cfg and the interpreter links."""
    layout, view = image.layout, image.view
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
            log.find("venv", f"expected a link to {target}, found {entry.kind} {entry.target!r}", path)
    cfg = f"{venv}/pyvenv.cfg"
    if view.get(cfg) is not None:
        found.add(cfg)
        _check_pyvenv(image, log, cfg)
    return found


def _check_pyvenv(image: _Image, log: _Log, path: str) -> None:
    try:
        text = image.view.read_file(path, max_bytes=4096).decode("utf-8")
    except (UntrustedInputError, UnicodeDecodeError) as exc:
        log.find("venv", f"unreadable: {exc}", path)
        return
    values = {k.strip(): v.strip() for k, _, v in (ln.partition("=") for ln in text.splitlines() if "=" in ln)}
    home = "/" + posixpath.dirname(image.layout.interpreter)
    if values.get("home") != home:
        log.find("venv", f"home is {values.get('home')!r}, not {home}: the venv would run another Python", path)
    if values.get("include-system-site-packages", "false").lower() != "false":
        log.find("venv", "include-system-site-packages is not false", path)
    extra = set(values) - {"home", "include-system-site-packages", "version", "executable", "command", "prompt"}
    if extra:
        log.find("venv", f"unexpected keys {sorted(extra)}", path)


def summary(report: IntegrityReport) -> str:
    c = report.counts
    return (f"{c.get('wheel_files_verified', 0)} wheel files, {c.get('debian_files_verified', 0)} Debian files "
            f"({c.get('debian_packages_host_records', 0)} packages checked against this host's dpkg records, "
            f"{c.get('debian_packages_base_records', 0)} against the base's, "
            f"{c.get('debian_packages_image_records', 0)} against the image's own), "
            f"{c.get('bytecode_verified', 0)} bytecode files and {c.get('base_files', 0)} base files accounted for; "
            f"{c.get('requirements_met', 0)} requirements met"
            + (f" ({len(report.omitted)} left out by stack.omit: {', '.join(o.split(' ', 1)[0] for o in report.omitted)})"
               if report.omitted else ""))


# ---------------------------------------------------------------- an image on the engine


class LockedBase(NamedTuple):
    """What the image's bottom layers are: how many are the locked base's, and the config that base starts from."""

    layers: int = 0
    config: ImageConfig | None = None
    problem: str = ""  # the image's bottom layers are not the locked base: a finding
    unverifiable: str = ""  # the locked base cannot be established on this host


def locked_base_layers(*, docker: Docker, lock: Lock, layers: tuple[str, ...], state: Path) -> LockedBase:
    """The locked base of an image whose layers are `layers`: for a bootstrap base, as the host's record of its recipe
    names it (builder/base.py; never the mutable local tag); for a registry base, the engine's image of the
    digest the lock pins."""
    base = lock.base
    if base.kind == "bootstrap":
        if not base.recipe_sha256:
            return LockedBase(unverifiable=f"the lock's bootstrap base {base.reference} names no recipe hash; "
                                           f"fix: skupin lock {lock.sku}")
        path = base_record_path(base.recipe_sha256, folder=state / "bases")
        try:
            record = read_base_record(base.recipe_sha256, folder=state / "bases")
        except SkupinError as exc:
            return LockedBase(unverifiable=str(exc))
        if record is None:
            return LockedBase(unverifiable=(
                f"this host has no record of the bootstrap base {base.reference} ({path}), so the image's bottom "
                f"layers cannot be matched with it; fix: skupin base {lock.sku} (it records the base it makes, or the "
                "one under its tag)"))
        found = record.matching(layers)
        if found is None:
            return LockedBase(problem=f"the image is not built on a base recorded for the locked bootstrap recipe "
                                      f"{base.recipe_sha256[:12]} ({path}): its bottom layers differ")
        return LockedBase(layers=len(found.layers), config=ImageConfig.from_engine(found.config))
    digest = base.digest or ""
    if not digest.startswith("sha256:") or not base.reference.endswith("@" + digest):
        return LockedBase(unverifiable=f"the lock's base {base.reference} is not pinned by its digest; "
                                       f"fix: skupin lock {lock.sku}")
    info = docker.inspect_image(base.reference)
    if info is None:
        return LockedBase(unverifiable=(f"the locked base {base.reference} is not on this engine, so the image's bottom "
                                        f"layers cannot be matched with it; fix: skupin base {lock.sku} (pulls it by "
                                        "digest)"))
    if not any(d.endswith("@" + digest) for d in info.repo_digests):
        return LockedBase(unverifiable=f"the engine's image {info.id[:19]} for {base.reference} does not carry that "
                                       "digest")
    config = ImageConfig.from_engine(docker.image_config(info.id))
    if tuple(layers[: len(info.layers)]) != tuple(info.layers):
        return LockedBase(config=config, problem=f"the image is not built on the locked base {base.reference} "
                                                 "(its bottom layers differ)")
    return LockedBase(layers=len(info.layers), config=config)


def built_wheels(*, lock: Lock, record: BuiltWheel | None, store: Path) -> tuple[dict[str, Path], list[str]]:
    """The wheels this host built from the lock's sdists (name -> file in the store), and why any is missing.

    The wheel comes from this host's record of its own build (builder/sourcebuild.py) and its wheel store, checked
    against the recorded sha256 here; nothing the image says about the wheel is used.
    """
    sources = lock.sources()
    if not sources:
        return {}, []
    fix = f"fix: skupin build {lock.sku} on this host (it records the wheel it builds)"
    if record is None:
        return {}, [f"this host has no record of the wheel built from {', '.join(p.filename for p in sources.values())} "
                    f"for lock {lock.content_hash()[:12]}, so the engine's files cannot be verified; {fix}"]
    problems: list[str] = []
    found: dict[str, Path] = {}
    for name, sdist in sources.items():
        if record.sdist != sdist or str(canonicalize_name(record.wheel.name)) != name:
            problems.append(f"the record of the built wheel names {record.sdist.filename} ({record.wheel.name}), not the "
                            f"locked {sdist.filename}; {fix}")
            continue
        path = store_path(store, record.wheel)
        try:
            sha = file_sha256(path)
        except OSError as exc:
            problems.append(f"the recorded built wheel {record.wheel.filename} is not in the wheel store ({exc}); {fix}")
            continue
        if sha != record.wheel.sha256:
            problems.append(f"{path}: sha256 {sha}, the record says {record.wheel.sha256}; {fix}")
            continue
        found[name] = path
    return found, problems


@dataclass(frozen=True)
class ImageFiles:
    """What the static check read of an image and the checks after it reuse (the binaries check): its merged file
    view, how many of its bottom layers are the locked base's, and its config's environment."""

    view: FileView
    base_layers: int
    env: dict[str, str] = field(default_factory=dict)


def config_env(config: dict[str, Any]) -> dict[str, str]:
    """The environment of an image config (`Env`: NAME=value strings)."""
    return dict(item.split("=", 1) for item in config.get("Env") or () if isinstance(item, str) and "=" in item)


def inspect_image_files(*, docker: Docker, image_id: str, lock: Lock, state: Path, dockerfile: str,
                        wheelhouse: Path | None = None,
                        on_event: Callable[[str], None] = lambda _: None) -> IntegrityReport:
    """The static check of a local image against `lock` and `dockerfile` (the text the lock renders to): layers
    indexed (cached under `state`), wheels gathered into the wheel store, bytecode recompiled by a host interpreter;
    see the module docstring."""
    return inspect_image(docker=docker, image_id=image_id, lock=lock, state=state, dockerfile=dockerfile,
                         wheelhouse=wheelhouse, on_event=on_event)[0]


def inspect_image(*, docker: Docker, image_id: str, lock: Lock, state: Path, dockerfile: str,
                  wheelhouse: Path | None = None, on_event: Callable[[str], None] = lambda _: None
                  ) -> tuple[IntegrityReport, ImageFiles | None]:
    """`inspect_image_files`, and the files it read (None when it stopped before reading the image's layers)."""

    info = docker.inspect_image(image_id)
    if info is None:
        raise UntrustedInputError(f"image {image_id} is not on this engine")
    base = locked_base_layers(docker=docker, lock=lock, layers=info.layers, state=state)
    if base.unverifiable:
        return IntegrityReport(unverifiable=(base.unverifiable,)), None
    expected: ImageConfig | None = None
    roots: tuple[str, ...] = ()
    unknown = ""
    try:
        roots = apt_installs(dockerfile)
        if base.config is not None:
            expected = config_of(dockerfile, base.config)
    except DockerfileConfigError as exc:
        unknown = f"the config of the rendered Dockerfile cannot be computed: {exc}"
    sources = lock.sources()
    packages = {name: pkg for name, pkg in lock.packages().items() if name not in sources}
    stored = fetch_wheels(packages.values(), store=wheel_store(), wheelhouse=wheelhouse, on_event=on_event)
    wheels = {name: stored[pkg.sha256] for name, pkg in packages.items()}
    try:
        record = read_built(lock, folder=state / "built")
    except SkupinError as exc:
        return IntegrityReport(unverifiable=(str(exc),)), None
    built, problems = built_wheels(lock=lock, record=record, store=wheel_store())
    if problems:
        return IntegrityReport(unverifiable=tuple(problems)), None
    wheels.update(built)
    view = image_view(docker=docker, image=info.id, layers=info.layers, cache=state / "cache", bottom=base.layers,
                      on_event=on_event)
    config = docker.image_config(info.id)
    report = check_integrity(view=view, base_view=view.bottom_view(base.layers), config=config,
                             labels=info.labels, lock=lock, expected=expected, apt_roots=roots,
                             wheels=wheels, base_layers=base.layers, host=host_dpkg(),
                             verify_bytecode=bytecode_verifier(cache=state / "cache"),
                             wheel_cache=state / "cache" / "wheel-files")
    if unknown:
        report = report.model_copy(update={"unverifiable": (unknown, *report.unverifiable)})
    if base.problem:
        report = report.model_copy(update={"findings": (Finding(kind="base", detail=base.problem), *report.findings)})
    return report, ImageFiles(view=view, base_layers=base.layers, env=config_env(config))
