"""A source-built engine (stack.engine.source kind sdist): its sdist on the index and what it needs to build and run.

The lock records the sdist itself (the index's URL and sha256), then resolves, wheels only like
every other layer, what the sdist declares: its build-system requirements (pyproject.toml
[build-system] requires, the wheels of the image's build stage, `Lock.build`) and its run
requirements (PKG-INFO Requires-Dist, with the pin's extras; the engine layer). Both are read from
the sdist file itself, fetched into the wheel store and checked against the index's sha256 first.
Reading never runs code of the sdist and never extracts it: two members are read from the archive.
"""

from __future__ import annotations

import email.parser
import email.policy
import tarfile
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from skupin.builder.catalog.lockfile import LockedPackage
from skupin.builder.catalog.manifest import Pin
from skupin.builder.wheels import fetch_wheels
from skupin.clients.pypi import IndexClient
from skupin.common.errors import LockError, NetworkError
from skupin.common.model import Frozen

MAX_MEMBER_BYTES = 1 << 20
SDIST_SUFFIX = ".tar.gz"


class SdistInfo(Frozen):
    """What a locked sdist declares: its build-system requirements and its Requires-Dist lines."""

    name: str
    version: str
    build_requires: tuple[str, ...]
    requires_dist: tuple[str, ...]


# (pin, index URL) -> the locked sdist and the file holding it (fetched and hash-checked)
SdistFetcher = Callable[[Pin, str], tuple[LockedPackage, Path]]


def find_sdist(pin: Pin, index_url: str, *, ca_bundle: Path | None = None) -> LockedPackage:
    """The one .tar.gz of `pin`'s distribution and version on the index, with the index's sha256 (LockError otherwise)."""
    what = f"{pin.distribution} {pin.version}"
    try:
        with IndexClient(index_url, ca_bundle=ca_bundle) as index:
            files = index.files(pin.distribution, pin.version)
    except NetworkError as exc:
        raise LockError(f"stack.engine.source: cannot read {what} from {index_url}: {exc}") from exc
    sdists = [f for f in files if f.filename.endswith(SDIST_SUFFIX) and not f.yanked]
    if len(sdists) != 1:
        raise LockError(f"stack.engine.source: {index_url} has {len(sdists)} source distributions (.tar.gz, not "
                        f"yanked) of {what}, not exactly one")
    found = sdists[0]
    if not found.sha256:
        raise LockError(f"stack.engine.source: the index gives no sha256 for {found.filename}")
    return LockedPackage(name=str(canonicalize_name(pin.distribution)), version=pin.version, filename=found.filename,
                         sha256=found.sha256.lower(), url=found.url, source="sdist")


def fetch_sdist(pin: Pin, index_url: str, *, ca_bundle: Path | None = None, store: Path | None = None,
                on_event: Callable[[str], None] = lambda _: None) -> tuple[LockedPackage, Path]:
    """`find_sdist`, then the file into the wheel store (downloaded once, kept only with the index's sha256)."""
    pkg = find_sdist(pin, index_url, ca_bundle=ca_bundle)
    stored = fetch_wheels([pkg], store=store, ca_bundle=ca_bundle, on_event=on_event)
    return pkg, stored[pkg.sha256]


def _member(archive: tarfile.TarFile, top: str, name: str, *, required: bool) -> bytes | None:
    try:
        info = archive.getmember(f"{top}/{name}")
    except KeyError:
        if required:
            raise LockError(f"the sdist has no {top}/{name}") from None
        return None
    if not info.isfile() or info.size > MAX_MEMBER_BYTES:
        raise LockError(f"the sdist's {top}/{name} is not a regular file under {MAX_MEMBER_BYTES} bytes")
    handle = archive.extractfile(info)
    assert handle is not None  # a regular file
    return handle.read()


def read_sdist(path: Path, pkg: LockedPackage) -> SdistInfo:
    """Build-system requires (pyproject.toml) and Requires-Dist (PKG-INFO) of a locked sdist, read from the archive."""
    top = pkg.filename.removesuffix(SDIST_SUFFIX)
    try:
        with tarfile.open(path, "r:gz") as archive:
            pkg_info = _member(archive, top, "PKG-INFO", required=True)
            pyproject = _member(archive, top, "pyproject.toml", required=True)
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise LockError(f"{pkg.filename}: not a readable .tar.gz: {exc}") from exc
    assert pkg_info is not None and pyproject is not None
    meta = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(pkg_info, headersonly=True)
    dynamic = {str(v).strip().lower() for v in meta.get_all("Dynamic") or ()}
    if "requires-dist" in dynamic:
        raise LockError(f"{pkg.filename}: PKG-INFO marks Requires-Dist as dynamic (computed at build time), so the "
                        "lock cannot know what the built wheel requires")
    if canonicalize_name(str(meta.get("Name", ""))) != canonicalize_name(pkg.name) or str(meta.get("Version")) != pkg.version:
        raise LockError(f"{pkg.filename}: PKG-INFO names {meta.get('Name')} {meta.get('Version')}, not {pkg.name} "
                        f"{pkg.version}")
    try:
        build = tomllib.loads(pyproject.decode("utf-8")).get("build-system", {})
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise LockError(f"{pkg.filename}: pyproject.toml is not readable TOML: {exc}") from exc
    requires = build.get("requires")
    if not isinstance(requires, list) or not requires or not all(isinstance(r, str) for r in requires):
        raise LockError(f"{pkg.filename}: pyproject.toml declares no [build-system] requires")
    return SdistInfo(name=pkg.name, version=pkg.version, build_requires=tuple(requires),
                     requires_dist=tuple(str(v) for v in meta.get_all("Requires-Dist") or ()))


def applicable(lines: Sequence[str], *, env: Mapping[str, str], extras: Sequence[str] = (), what: str) -> tuple[str, ...]:
    """The requirements of `lines` that apply on the target `env` with `extras` requested, markers removed."""
    out: dict[str, None] = {}
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise LockError(f"{what}: unreadable requirement {line!r}: {exc}") from exc
        try:
            applies = req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras))
        except (InvalidMarker, UndefinedEnvironmentName, UndefinedComparison) as exc:
            raise LockError(f"{what}: the marker of {line!r} cannot be evaluated: {exc}") from exc
        if applies:
            extra = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            out[f"{req.name}{extra}{req.specifier}"] = None
    return tuple(out)
