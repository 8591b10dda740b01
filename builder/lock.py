"""Lock a SKU: resolve its Python layers for the image's platform and Python, every file hashed.

The resolver is uv (`uv pip compile` for the target, builder/uv.py), or pip's own (`pip install
--dry-run --ignore-installed --report`) for what uv is not given here (direct URL requirements,
non-manylinux targets, `skupin lock --resolver pip`): each runs in a subprocess isolated from this
machine's configuration and aimed at the image's platform (wheels only); uv answers in pip's
report shape, so everything after the resolution is shared. All pins are resolved
together, so the set is consistent; each layer then holds what its pins add to the layers below
(the dependency closure of framework; + compiler; + engine; + extras), so every package lands
in the lowest layer that needs it and the layers are disjoint.

pip evaluates environment markers against the interpreter it runs on, not the target Python
(`--python-version` only changes tag and Requires-Python matching). So the resolution is checked
against the target's marker environment: a requirement the image has but pip skipped (or
violated) is fed back to pip as an explicit requirement, and packages the image does not need
(pulled in by the host's markers) are dropped.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlparse

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from skupin.builder.catalog.lockfile import PY_LAYERS, Lock, LockedBase, LockedPackage, lock_path, read_lock, write_lock
from skupin.builder.catalog.manifest import PYPI, Pin, SkuManifest, display_path, manifest_digest
from skupin.builder.catalog.pylock import pylock_missing, pylock_problem, write_pylock
from skupin.builder.catalog.stack import LockState
from skupin.builder.render import BUILD_STAGE, apt_roots, render_manifest
from skupin.builder.sdist import SdistFetcher, applicable, fetch_sdist, read_sdist
from skupin.builder.wheels import file_sha256
from skupin.common import __version__
from skupin.common.errors import LockError, Problem
from skupin.common.model import Frozen

if TYPE_CHECKING:
    from skupin.builder.aptlock import HostFacts

DEFAULT_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# glibc of each base distribution: the highest manylinux tag its wheels may carry.
GLIBC = {
    "debian-11": (2, 31),
    "debian-12": (2, 36),
    "debian-13": (2, 41),
    "ubuntu-20.04": (2, 31),
    "ubuntu-22.04": (2, 35),
    "ubuntu-24.04": (2, 39),
}
GLIBC_FALLBACK = (2, 28)
ARCH = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
MAX_MARKER_ROUNDS = 4
Progress = Callable[[str], None]


class PipRequest(Frozen):
    """One resolution: what pip is asked, for which target."""

    layer: str
    requirements: tuple[str, ...]
    constraints: tuple[str, ...] = ()
    index_url: str
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    python: str
    abis: tuple[str, ...]
    platforms: tuple[str, ...]


class Resolved(Frozen):
    """One distribution chosen by pip, with the exact file and its sha256."""

    name: str
    version: str
    filename: str
    sha256: str
    url: str | None
    source: str
    requires_dist: tuple[str, ...] = ()


class LayerPlan(Frozen):
    """What one layer asks for: its pins as requirements, where they come from, which pins to verify."""

    layer: str
    requirements: tuple[str, ...]
    pins: tuple[tuple[str, str, str], ...]  # (field, distribution, exact version)
    indexes: tuple[str, ...]
    url_pins: tuple[tuple[str, str, str], ...] = ()  # (distribution, url, sha256)
    wheelhouse: bool = False


Resolver = Callable[[PipRequest], dict]


# ---------------------------------------------------------------- the target


def target_platforms(manifest: SkuManifest) -> tuple[str, ...]:
    """pip --platform tags of the image: manylinux_2_<glibc>..2_17, manylinux2014, linux, for its arch."""
    arch = ARCH[manifest.base.platform]
    major, minor = GLIBC.get(manifest.base.os, GLIBC_FALLBACK)
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 16, -1)]
    return (*tags, f"manylinux2014_{arch}", f"linux_{arch}")


def target_abis(manifest: SkuManifest) -> tuple[str, ...]:
    """pip --abi tags: the CPython ABI of the image's Python, abi3 and none."""
    return (f"cp{manifest.base.python.replace('.', '')}", "abi3", "none")


def target_environment(manifest: SkuManifest) -> dict[str, str]:
    """PEP 508 marker environment of the image (Linux, CPython of base.python, its arch)."""
    return marker_environment(python=manifest.base.python, platform=manifest.base.platform)


def marker_environment(*, python: str, platform: str) -> dict[str, str]:
    """PEP 508 marker environment of Linux CPython `python` (3.11) on `platform` (linux/amd64)."""
    py = python
    return {
        "implementation_name": "cpython",
        "implementation_version": f"{py}.0",
        "os_name": "posix",
        "platform_machine": ARCH[platform],
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": f"{py}.0",
        "python_version": py,
        "sys_platform": "linux",
    }


# ---------------------------------------------------------------- the plan (pure)


def _pin_requirement(pin: Pin) -> str:
    extras = f"[{','.join(pin.extras)}]" if pin.extras else ""
    if pin.source.kind == "url":
        return f"{pin.distribution}{extras} @ {pin.source.url}#sha256={pin.source.sha256}"
    return f"{pin.distribution}{extras}=={pin.version}"


def _index_field(layer: str, pin: Pin | None) -> tuple[str, str | None]:
    """(manifest field, index URL) a layer's pin comes from."""
    if pin is None:
        return "extras.index", None
    src = pin.source
    if src.kind == "index":
        return f"stack.{layer}.source.url", src.url
    if src.kind == "wheelhouse":
        return f"stack.{layer}.source.index", src.index
    return f"stack.{layer}.source.url", None


def _mirrored(url: str, *, index_url: str | None) -> str:
    """PyPI replaced by `--index-url` (a mirror) when one is given; other indexes kept."""
    return index_url if index_url and url == PYPI else url


def plan_layers(
    *, manifest: SkuManifest, manifest_path: Path, wheelhouse: Path | None, index_url: str | None = None,
    sdist_requires: tuple[str, ...] = (),
) -> tuple[LayerPlan, ...]:
    """The Python layers to resolve, in order; LockError for sources that cannot be locked here.

    A source-built engine (stack.engine.source kind sdist) is not resolved: its layer holds what its
    sdist requires to run (`sdist_requires`, read from the sdist by `lock_sku`).
    """
    file, sku = display_path(manifest_path), manifest.name
    pins = manifest.stack.pins()
    mirror = functools.partial(_mirrored, index_url=index_url)
    plans: list[LayerPlan] = []
    problems: list[Problem] = []
    for layer in PY_LAYERS:
        if layer == "extras":
            reqs = tuple(f"{p.name}=={p.version}" for p in manifest.extras.python)
            checks = tuple((f"extras.python[{i}]", p.name, p.version) for i, p in enumerate(manifest.extras.python))
            if reqs:
                plans.append(LayerPlan(layer=layer, requirements=reqs, pins=checks,
                                       indexes=(mirror(manifest.extras.index),)))
            continue
        pin = pins[layer]
        src = pin.source
        if src.kind == "sdist":
            if sdist_requires:
                plans.append(LayerPlan(layer=layer, requirements=sdist_requires, pins=(),
                                       indexes=tuple(dict.fromkeys((mirror(src.index), mirror(manifest.extras.index))))))
            continue
        if not pin.is_python:
            continue
        if src.kind == "git":
            problems.append(Problem(
                file, f"stack.{layer}.source",
                f"git {src.repo}@{src.ref} cannot be locked here (it is built from source, not resolved from an index)",
                f"make the lock on a machine that reaches and builds it (skupin lock {sku})",
            ))
            continue
        if src.kind == "wheelhouse" and wheelhouse is None:
            problems.append(Problem(file, f"stack.{layer}.source", "comes from a wheelhouse but no wheelhouse was given",
                                    f"skupin lock {sku} --wheelhouse DIR"))
            continue
        if src.kind == "wheelhouse" and wheelhouse is not None and not wheelhouse.is_dir():
            problems.append(Problem(file, f"stack.{layer}.source", f"wheelhouse {wheelhouse} is not a folder",
                                    "pass the folder that holds the wheels"))
            continue
        _, own = _index_field(layer, pin)
        indexes = tuple(dict.fromkeys(mirror(u) for u in (own, manifest.extras.index) if u))
        url_pins = ((pin.distribution, src.url, src.sha256),) if src.kind == "url" else ()
        plans.append(LayerPlan(
            layer=layer, requirements=(_pin_requirement(pin),),
            pins=((f"stack.{layer}.version", pin.distribution, pin.version),),
            indexes=indexes, url_pins=url_pins, wheelhouse=src.kind == "wheelhouse",
        ))
    if problems:
        raise LockError(f"{file}: cannot be locked on this machine", tuple(problems))
    return tuple(plans)


def source_urls(*, manifest: SkuManifest, index_url: str | None = None) -> tuple[tuple[str, str, str], ...]:
    """Every remote source a lock needs: (manifest field, kind, URL)."""
    found: list[tuple[str, str, str]] = []
    mirror = functools.partial(_mirrored, index_url=index_url)
    for layer, pin in manifest.stack.pins().items():
        if pin.source.kind == "sdist":
            found.append((f"stack.{layer}.source.index", "index", mirror(pin.source.index)))
            continue
        if layer not in PY_LAYERS or not pin.is_python:
            continue
        field, url = _index_field(layer, pin)
        if url:
            found.append((field, "index", mirror(url)))
        if pin.source.kind == "url":
            found.append((f"stack.{layer}.source.url", "wheel", pin.source.url))
    found.append(("extras.index", "index", mirror(manifest.extras.index)))
    return tuple(dict.fromkeys(found))


def tcp_reachable(url: str, timeout: float = 5.0) -> bool:
    """True when the URL's host resolves and accepts a TCP connection within `timeout` seconds."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def unreachable_sources(
    *, manifest: SkuManifest, manifest_path: Path, index_url: str | None, reachable: Callable[[str], bool]
) -> list[Problem]:
    """A problem for every remote source this machine does not reach."""
    file, sku = display_path(manifest_path), manifest.name
    answers: dict[str, bool] = {}
    problems = []
    for field, kind, url in source_urls(manifest=manifest, index_url=index_url):
        if url not in answers:
            answers[url] = reachable(url)
        if not answers[url]:
            problems.append(Problem(file, field, f"{kind} {url} is unreachable from this machine",
                                    f"make the lock on a machine that reaches it (skupin lock {sku})"))
    return problems


# ---------------------------------------------------------------- reading pip's report (pure)


def _report_hash(download_info: Mapping) -> str | None:
    info = download_info.get("archive_info") or {}
    hashes = info.get("hashes") or {}
    if hashes.get("sha256"):
        return str(hashes["sha256"]).lower()
    legacy = str(info.get("hash") or "")
    if legacy.startswith("sha256="):
        return legacy.removeprefix("sha256=").lower()
    return None


def parse_report(report: Mapping, *, layer: str) -> dict[str, Resolved]:
    """Every distribution pip chose, by canonical name, with file name and sha256 (LockError if any lacks one)."""
    out: dict[str, Resolved] = {}
    problems: list[str] = []
    for item in report.get("install", []):
        meta, info = item["metadata"], item["download_info"]
        name, version = canonicalize_name(meta["name"]), str(meta["version"])
        url = str(info["url"]).split("#", 1)[0]
        parsed = urlparse(url)
        filename = unquote(parsed.path.rsplit("/", 1)[-1])
        if not filename.endswith(".whl"):
            problems.append(f"{name} {version}: only a source distribution ({filename}) was found; "
                            "locks take wheels only (sdists are not allowed)")
            continue
        if parsed.scheme == "file":
            local = Path(unquote(parsed.path))
            try:
                sha, where, source = file_sha256(local), None, "wheelhouse"
            except OSError as exc:
                problems.append(f"{name} {version}: cannot hash wheelhouse file {local}: {exc}")
                continue
        else:
            reported = _report_hash(info)
            if reported is None:
                problems.append(f"{name} {version}: the index gave no sha256 for {filename}")
                continue
            sha, where, source = reported, url, "url" if item.get("is_direct") else "index"
        out[name] = Resolved(name=name, version=version, filename=filename, sha256=sha, url=where, source=source,
                             requires_dist=tuple(meta.get("requires_dist") or ()))
    if problems:
        raise LockError(f"{layer}: pip's resolution cannot be locked: " + "; ".join(problems))
    return out


def _strip_marker(req: Requirement) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    if req.url:
        return f"{req.name}{extras} @ {req.url}"
    return f"{req.name}{extras}{req.specifier}"


class Closure(Frozen):
    """What the target needs of a resolution, and where pip's host-evaluated markers fell short."""

    needed: frozenset[str]
    omitted: frozenset[str] = frozenset()  # omitted names some needed distribution requires
    missing: tuple[str, ...] = ()  # requirements of the target that pip did not resolve
    conflicts: tuple[str, ...] = ()  # requirements of the target that pip's choice violates
    why: tuple[str, ...] = ()


def closure(resolved: Mapping[str, Resolved], roots: Sequence[str], env: Mapping[str, str],
            omit: frozenset[str] = frozenset()) -> Closure:
    """Walk pip's chosen set from `roots` along Requires-Dist, markers evaluated for the target environment.

    A requirement on a name in `omit` (stack.omit, canonical names) is not followed: it is reported as omitted.
    """
    seen: dict[str, set[str]] = {}
    omitted: set[str] = set()
    missing: dict[str, None] = {}
    conflicts: dict[str, None] = {}
    why: dict[str, None] = {}
    stack: list[tuple[Requirement, str]] = [(Requirement(r), "the pins") for r in roots]
    while stack:
        req, parent = stack.pop()
        name = canonicalize_name(req.name)
        if name in omit:
            omitted.add(name)
            continue
        item = resolved.get(name)
        if item is None:
            missing[_strip_marker(req)] = None
            why[f"{parent} needs {_strip_marker(req)}, not resolved"] = None
            continue
        if req.specifier and not req.specifier.contains(item.version, prereleases=True):
            conflicts[_strip_marker(req)] = None
            why[f"{parent} needs {_strip_marker(req)} but {name} {item.version} was chosen"] = None
        want = {""} | {canonicalize_name(e) for e in req.extras}
        new = want - seen.get(name, set())
        if not new:
            continue
        seen[name] = seen.get(name, set()) | want
        for line in item.requires_dist:
            try:
                dep = Requirement(line)
            except InvalidRequirement as exc:
                raise LockError(f"{name} {item.version}: unreadable Requires-Dist {line!r}: {exc}") from exc
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in new):
                stack.append((dep, name))
    return Closure(needed=frozenset(seen), omitted=frozenset(omitted), missing=tuple(missing),
                   conflicts=tuple(conflicts), why=tuple(why))


def check_pins(resolved: Mapping[str, Resolved], plan: LayerPlan, *, file: str) -> None:
    """LockError when the resolver moved a pin (the locked version must equal the pinned one exactly)."""
    problems = []
    for field, dist, version in plan.pins:
        got = resolved.get(canonicalize_name(dist))
        try:
            same = got is not None and Version(got.version) == Version(version) and got.version == version
        except InvalidVersion:
            same = got is not None and got.version == version
        if not same:
            found = got.version if got else "nothing"
            problems.append(Problem(file, field, f"pinned {dist}=={version} but the resolver chose {found}",
                                    "pin a version the index really has, with its local label (e.g. 2.13.0+cpu)"))
    for dist, url, sha in plan.url_pins:
        got = resolved.get(canonicalize_name(dist))
        if got is None or got.sha256 != sha:
            problems.append(Problem(file, f"stack.{plan.layer}.source.sha256",
                                    f"{url} resolved to sha256 {got.sha256 if got else 'nothing'}, pinned {sha}"))
    if problems:
        raise LockError(f"{file}: the resolver moved a pin", tuple(problems))


# ---------------------------------------------------------------- running pip


def default_ca_bundle(environ: Mapping[str, str] | None = None) -> Path | None:
    """The CA bundle pip should trust: SSL_CERT_FILE / REQUESTS_CA_BUNDLE, else the system bundle if present."""
    environ = os.environ if environ is None else environ
    for key in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if environ.get(key) and Path(environ[key]).is_file():
            return Path(environ[key])
    return DEFAULT_CA_BUNDLE if DEFAULT_CA_BUNDLE.is_file() else None


def pip_command(request: PipRequest, *, python: str, report: Path, reqs: Path, cons: Path | None,
                ca_bundle: Path | None) -> list[str]:
    """The pip command line of one resolution (isolated, wheels only, aimed at the target)."""
    cmd = [python, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--no-input",
           "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
           "--only-binary=:all:", "--implementation", "cp", "--python-version", request.python,
           "--timeout", "30", "--retries", "2", "--index-url", request.index_url]
    for abi in request.abis:
        cmd += ["--abi", abi]
    for platform in request.platforms:
        cmd += ["--platform", platform]
    for url in request.extra_index_urls:
        cmd += ["--extra-index-url", url]
    for folder in request.find_links:
        cmd += ["--find-links", folder]
    if ca_bundle is not None:
        cmd += ["--cert", str(ca_bundle)]
    cmd += ["-r", str(reqs)]
    if cons is not None:
        cmd += ["-c", str(cons)]
    return cmd


def pip_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any PIP_* setting, and no pip config file."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if not k.upper().startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _explain_failure(request: PipRequest, output: str) -> str:
    tail = "\n".join(output.strip().splitlines()[-15:])
    if "No matching distribution found for" in output:
        what = output.split("No matching distribution found for", 1)[1].split("\n", 1)[0].strip()
        return (f"{request.layer}: no wheel of {what} for CPython {request.python} on {request.platforms[0]} "
                f"(locks take wheels only; sdists are not allowed):\n{tail}")
    if "ResolutionImpossible" in output or "conflicting dependencies" in output:
        return f"{request.layer}: the pins cannot be installed together:\n{tail}"
    if any(s in output for s in ("NewConnectionError", "Name or service not known", "Max retries exceeded",
                                 "CERTIFICATE_VERIFY_FAILED")):
        return f"{request.layer}: an index is unreachable (or its TLS is not trusted: pass --ca-bundle):\n{tail}"
    return f"{request.layer}: pip could not resolve:\n{tail}"


def run_pip(request: PipRequest, *, python: str = sys.executable, ca_bundle: Path | None = None,
            timeout_s: float = 1800.0) -> dict:
    """Resolve one request with pip --dry-run --report in a subprocess; return the report."""
    with tempfile.TemporaryDirectory(prefix="skupin-lock-") as tmp:
        work = Path(tmp)
        reqs, report = work / "requirements.txt", work / "report.json"
        reqs.write_text("\n".join(request.requirements) + "\n", encoding="utf-8")
        cons = None
        if request.constraints:
            cons = work / "constraints.txt"
            cons.write_text("\n".join(request.constraints) + "\n", encoding="utf-8")
        cmd = pip_command(request, python=python, report=report, reqs=reqs, cons=cons, ca_bundle=ca_bundle)
        try:
            proc = subprocess.run(cmd, env=pip_environment(), cwd=work, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise LockError(f"{request.layer}: pip did not finish within {timeout_s:.0f} s") from exc
        except OSError as exc:
            raise LockError(f"{request.layer}: cannot run pip ({python}): {exc}") from exc
        if proc.returncode != 0:
            raise LockError(_explain_failure(request, proc.stdout + proc.stderr))
        try:
            return json.loads(report.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise LockError(f"{request.layer}: pip wrote no readable report: {exc}") from exc


# ---------------------------------------------------------------- locking


def _locked(item: Resolved, url_pins: set[str]) -> LockedPackage:
    source = "url" if item.name in url_pins else item.source
    return LockedPackage(name=item.name, version=item.version, filename=item.filename, sha256=item.sha256,
                         url=item.url, source=source)




def _system(manifest: SkuManifest) -> dict[str, tuple[str, ...]]:
    """apt packages per layer; those only the build stage of a source-built engine installs under BUILD_STAGE."""
    out: dict[str, list[str]] = {}
    engine = manifest.stack.engine
    for layer, pin in manifest.stack.pins().items():
        if pin.source.kind == "apt":
            src = pin.source
            where = BUILD_STAGE if engine.source.kind == "sdist" and layer == "compiler" else layer
            out.setdefault(where, []).append(f"{src.package}={src.version}" if src.version else src.package)
    if engine.source.kind == "sdist":
        out.setdefault(BUILD_STAGE, []).extend(f"{p.name}={p.version}" for p in engine.source.build_packages)
    for pkg in manifest.extras.system:
        out.setdefault("extras", []).append(f"{pkg.name}={pkg.version}" if pkg.version else pkg.name)
    return {k: tuple(v) for k, v in out.items()}


def locked_base(manifest: SkuManifest) -> LockedBase:
    """The base of the lock: the image reference and digest, or the bootstrap recipe's local tag and hash."""
    base = manifest.base
    if base.image:
        return LockedBase(kind="image", reference=base.reference, digest=base.image.rsplit("@", 1)[1])
    assert base.bootstrap is not None  # Base's validator guarantees one origin
    return LockedBase(kind="bootstrap", reference=base.reference,
                      recipe_sha256=base.bootstrap.recipe_sha256())


def resolve_target(
    *, request: PipRequest, plans: Sequence[LayerPlan], resolve: Resolver, env: Mapping[str, str], file: str,
    progress: Progress, omit: frozenset[str] = frozenset(),
) -> tuple[dict[str, Resolved], str]:
    """One pip resolution of every pin, corrected for the target's markers; return what the target needs and pip's version.

    pip evaluates markers for the Python it runs on: a requirement the target has but the host lacks
    (or vice versa) is fed back to pip as an explicit requirement until the target's closure is complete.
    """
    roots = tuple(r for plan in plans for r in plan.requirements)
    hints: tuple[str, ...] = ()
    for _ in range(MAX_MARKER_ROUNDS):
        report = resolve(request.model_copy(update={"requirements": (*request.requirements, *hints)}))
        resolved = parse_report(report, layer=request.layer)
        for plan in plans:
            check_pins(resolved, plan, file=file)
        found = closure(resolved, roots, env, omit)
        todo = [r for r in (*found.missing, *found.conflicts) if r not in hints]
        if not found.missing and not found.conflicts:
            unused = sorted(omit - found.omitted)
            if unused:
                raise LockError(f"{file}: stack.omit names {', '.join(unused)}, which no locked distribution "
                                "requires: remove it from stack.omit")
            left_out = sorted(set(resolved) & found.omitted - found.needed)
            if left_out:
                progress(f"left out {', '.join(left_out)} (stack.omit)")
            dropped = sorted(set(resolved) - found.needed - found.omitted)
            if dropped:
                progress(f"dropped {', '.join(dropped)}: not needed on Python {env['python_version']}")
            return {n: resolved[n] for n in found.needed}, _resolver_label(report)
        if not todo:
            break
        progress(f"Python {env['python_version']} (not this host's) also needs {', '.join(todo)}; resolving again")
        hints = (*hints, *todo)
    raise LockError(f"{file}: the resolution does not fit Python {env['python_version']}: " + "; ".join(found.why))


def _resolver_label(report: Mapping) -> str:
    """What resolved: "uv X" (builder/uv.py says so in its report) or "pip X" (pip's report names its version)."""
    return str(report.get("resolver") or f"pip {report.get('pip_version', '?')}")


def default_resolver(*, ca_bundle: Path | None, prefer: str = "uv") -> Resolver:
    """uv (`prefer="uv"`) when its wheel is installed and the request suits it (builder/uv.py: usable), else pip."""
    from skupin.builder.uv import run_uv, usable, uv_binary

    uv = uv_binary() if prefer == "uv" else None

    def resolve(request: PipRequest) -> dict:
        if uv is not None and usable(request.requirements, request.platforms):
            return run_uv(request, uv=uv, ca_bundle=ca_bundle)
        return run_pip(request, ca_bundle=ca_bundle)

    return resolve


def assign_layers(
    *, resolved: Mapping[str, Resolved], plans: Sequence[LayerPlan], env: Mapping[str, str],
    omit: frozenset[str] = frozenset(),
) -> dict[str, tuple[LockedPackage, ...]]:
    """Each package in the lowest layer that needs it: layer k gets closure(pins <= k) minus the layers below."""
    layers: dict[str, tuple[LockedPackage, ...]] = {layer: () for layer in PY_LAYERS}
    roots: list[str] = []
    below: set[str] = set()
    url_pins = {str(canonicalize_name(d)) for p in plans for d, _, _ in p.url_pins}
    for plan in plans:
        roots += plan.requirements
        needed = closure(resolved, roots, env, omit).needed
        new = sorted(needed - below)
        layers[plan.layer] = tuple(_locked(resolved[n], url_pins) for n in new)
        below |= needed
    return layers


def lockable_plans(
    *, manifest: SkuManifest, manifest_path: Path, wheelhouse: Path | None, index_url: str | None,
    reachable: Callable[[str], bool], sdist_requires: tuple[str, ...] = (),
) -> tuple[LayerPlan, ...]:
    """The layer plans, once every source is known to be lockable here; else LockError naming each that is not."""
    problems: list[Problem] = []
    try:
        plans = plan_layers(manifest=manifest, manifest_path=manifest_path, wheelhouse=wheelhouse, index_url=index_url,
                            sdist_requires=sdist_requires)
    except LockError as exc:
        problems += exc.problems
        plans = ()
    if any(pin.is_python or pin.is_sdist for pin in manifest.stack.pins().values()) or manifest.extras.python:
        problems += unreachable_sources(manifest=manifest, manifest_path=manifest_path, index_url=index_url,
                                        reachable=reachable)
    if problems:
        raise LockError(f"{display_path(manifest_path)}: cannot be locked on this machine", tuple(problems))
    return plans


def lock_sku(
    *,
    manifest: SkuManifest,
    manifest_path: Path,
    wheelhouse: Path | None,
    index_url: str | None = None,
    progress: Progress | None = None,
    ca_bundle: Path | None = None,
    resolve: Resolver | None = None,
    reachable: Callable[[str], bool] | None = None,
    sdist: SdistFetcher | None = None,
    host: HostFacts | None = None,
) -> Lock:
    """Resolve every Python layer of a SKU (pins kept exact, every file hashed, layers disjoint) into a Lock.

    One pip resolution of all pins together gives one consistent set; each layer then holds what
    its pins add to the layers below (the closure of framework; + compiler; + engine; + extras).
    A source-built engine (stack.engine.source kind sdist, builder/sdist.py) is locked as its sdist
    (the index's sha256), its layer as what the sdist requires to run, and `Lock.build` as the
    wheels its build-system requires, resolved on their own (they never reach the served image).
    `host` (builder/aptlock.py: host_facts) gives the bootstrapped base's layer and every apt package's version;
    without it the lock pins only the apt versions the manifest names.
    """
    say = progress or (lambda _msg: None)
    file = display_path(manifest_path)
    engine = manifest.stack.engine
    env = target_environment(manifest)
    sdist_pkg: LockedPackage | None = None
    run_reqs: tuple[str, ...] = ()
    build_reqs: tuple[str, ...] = ()
    if engine.source.kind == "sdist":
        problems = unreachable_sources(manifest=manifest, manifest_path=manifest_path, index_url=index_url,
                                       reachable=reachable or tcp_reachable)
        if problems:
            raise LockError(f"{file}: cannot be locked on this machine", tuple(problems))
        index = _mirrored(engine.source.index, index_url=index_url)
        fetch = sdist or (lambda pin, url: fetch_sdist(pin, url, ca_bundle=ca_bundle or default_ca_bundle(),
                                                       on_event=say))
        try:
            sdist_pkg, path = fetch(engine, index)
            info = read_sdist(path, sdist_pkg)
        except LockError as exc:
            raise LockError(f"{file}: stack.engine.source: {exc}") from exc
        what = f"{file}: {sdist_pkg.filename}"
        run_reqs = applicable(info.requires_dist, env=env, extras=engine.extras, what=what)
        build_reqs = applicable(info.build_requires, env=env, what=what)
        say(f"{sdist_pkg.filename} (sha256 {sdist_pkg.sha256[:12]}): builds with {' '.join(build_reqs)}; "
            f"runs with {len(run_reqs)} requirement(s)")
    plans = lockable_plans(manifest=manifest, manifest_path=manifest_path, wheelhouse=wheelhouse,
                           index_url=index_url, reachable=reachable or tcp_reachable, sdist_requires=run_reqs)
    layers: dict[str, tuple[LockedPackage, ...]] = {layer: () for layer in PY_LAYERS}
    build: tuple[LockedPackage, ...] = ()
    resolver = "none (no Python layers)"
    if plans or build_reqs:
        if resolve is None:
            resolve = default_resolver(ca_bundle=ca_bundle or default_ca_bundle())
    omit = frozenset(str(canonicalize_name(o.name)) for o in manifest.stack.omit)
    if plans:
        assert resolve is not None
        roots = tuple(r for plan in plans for r in plan.requirements)
        request = _request(manifest, layer=",".join(p.layer for p in plans), plans=plans, wheelhouse=wheelhouse)
        started = time.monotonic()
        say(f"resolving {' '.join(roots)} for CPython {manifest.base.python} {manifest.base.platform}")
        resolved, resolver = resolve_target(request=request, plans=plans, resolve=resolve, env=env, file=file,
                                            progress=say, omit=omit)
        layers = home_urls(assign_layers(resolved=resolved, plans=plans, env=env, omit=omit), manifest=manifest)
        counts = ", ".join(f"{k} {len(v)}" for k, v in layers.items())
        say(f"resolved {len(resolved)} packages in {time.monotonic() - started:.1f} s ({counts})")
    if sdist_pkg is not None:
        layers["engine"] = tuple(sorted((*layers["engine"], sdist_pkg), key=lambda p: p.name))
    if build_reqs:
        assert resolve is not None and engine.source.kind == "sdist"
        plan = LayerPlan(layer="build", requirements=build_reqs, pins=(),
                         indexes=(_mirrored(engine.source.index, index_url=index_url),))
        say(f"resolving the build stage's {' '.join(build_reqs)}")
        resolved, resolver = resolve_target(request=_request(manifest, layer="build", plans=(plan,), wheelhouse=None),
                                            plans=(plan,), resolve=resolve, env=env, file=file, progress=say)
        build = tuple(_locked(resolved[n], set()) for n in sorted(resolved))
    return Lock(
        sku=manifest.name,
        manifest_sha256=manifest_digest(manifest),
        python=manifest.base.python,
        platform=manifest.base.platform,
        base=locked_base(manifest).model_copy(update={"diff_id": host.diff_id if host else None}),
        layers=layers,
        system=host.system if host is not None else _system(manifest),
        apt_sources=host.apt_sources if host is not None else None,
        apt_closure=host.apt_closure if host is not None else None,
        omitted={str(canonicalize_name(o.name)): o.reason for o in manifest.stack.omit},
        build=build,
        resolver=resolver,
        tool_version=__version__,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def home_urls(layers: dict[str, tuple[LockedPackage, ...]], *, manifest: SkuManifest
              ) -> dict[str, tuple[LockedPackage, ...]]:
    """A pin taken from a wheelhouse whose source names its home (`url`) records <url>/<file> as its download URL."""
    homes = {str(canonicalize_name(p.distribution)): p.source.url for p in manifest.stack.pins().values()
             if p.source.kind == "wheelhouse" and getattr(p.source, "url", None)}
    if not homes:
        return layers
    return {layer: tuple(pkg.model_copy(update={"url": f"{str(homes[pkg.name]).rstrip('/')}/{quote(pkg.filename)}"})
                         if pkg.source == "wheelhouse" and pkg.name in homes else pkg for pkg in pkgs)
            for layer, pkgs in layers.items()}


def _request(manifest: SkuManifest, *, layer: str, plans: Sequence[LayerPlan], wheelhouse: Path | None) -> PipRequest:
    """One pip request for `plans` together, aimed at the image's platform and Python."""
    first = plans[0].indexes[0]
    return PipRequest(
        layer=layer, requirements=tuple(r for plan in plans for r in plan.requirements),
        index_url=first,
        extra_index_urls=tuple(dict.fromkeys(u for p in plans for u in p.indexes if u != first)),
        find_links=(str(Path(wheelhouse).resolve()),) if wheelhouse is not None and any(p.wheelhouse for p in plans) else (),
        python=manifest.base.python, abis=target_abis(manifest), platforms=target_platforms(manifest),
    )


def relock(*, manifest: SkuManifest, manifest_path: Path, wheelhouse: Path | None = None, index_url: str | None = None,
           progress: Progress | None = None, ca_bundle: Path | None = None, resolve: Resolver | None = None,
           host: HostFacts | None = None) -> Lock:
    """`lock_sku` and write the lock next to the manifest, with its PEP 751 form pylock.<sku>.toml (what `skupin
    lock`, `skupin run` and `skupin watch --apply` do)."""
    lock = lock_sku(manifest=manifest, manifest_path=manifest_path, wheelhouse=wheelhouse, index_url=index_url,
                    progress=progress, ca_bundle=ca_bundle, resolve=resolve, host=host)
    write_lock(lock, lock_path(manifest_path))
    write_pylock(lock, lock_path(manifest_path))  # its PEP 751 form beside it: pylock.<sku>.toml
    return lock


def relock_host(*, manifest: SkuManifest, manifest_path: Path, host: HostFacts) -> Lock:
    """The current lock with what the host decides made again (the bootstrapped base's layer, the apt versions and
    closure) and its Python packages kept as they are, written with its pylock (`skupin lock --keep-python`: after a
    Debian point release, without re-resolving against today's indexes). LockError when the lock is stale for another
    reason (that needs a full `skupin lock`) or cannot be read."""
    path = lock_path(manifest_path)
    old = read_lock(path)
    lock = old.model_copy(update={
        "base": old.base.model_copy(update={"diff_id": host.diff_id}), "system": host.system,
        "apt_sources": host.apt_sources, "apt_closure": host.apt_closure, "tool_version": __version__,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    if reasons := stale_reasons(manifest=manifest, lock=lock):
        raise LockError(f"{display_path(path)}: --keep-python keeps the lock's Python packages, but the lock is stale "
                        f"for more than its apt part: {'; '.join(reasons)}; fix: skupin lock {manifest.name}")
    write_lock(lock, path)
    write_pylock(lock, path)
    return lock


# ---------------------------------------------------------------- is a lock still current?


def lock_status(*, manifest: SkuManifest, manifest_path: Path) -> tuple[LockState, str, Lock | None]:
    """("ok" | "unlocked" | "stale", why, the lock when it could be read) for the lock next to a manifest."""
    path = lock_path(manifest_path)
    if not path.exists() and not path.is_symlink():  # a dangling link is a broken lock (stale), not a missing one
        return "unlocked", f"no {path.name}; run `skupin lock {manifest.name}`", None
    try:
        lock = read_lock(path)
    except LockError as exc:
        return "stale", f"{exc}; run `skupin lock {manifest.name}`", None
    reasons = stale_reasons(manifest=manifest, lock=lock)
    if (problem := pylock_problem(lock, path)) is not None:  # a PEP 751 form beside it is the lock's, or it is stale
        reasons.append(problem)
    if reasons:
        return "stale", "; ".join(reasons) + f"; run `skupin lock {manifest.name}`", lock
    notes = [note for note in (apt_note(manifest, lock), pylock_missing(path)) if note]  # current, but say what floats
    return "ok", "; ".join([f"{path.name} {lock.content_hash()[:12]}", *notes]), lock


def apt_note(manifest: SkuManifest, lock: Lock) -> str:
    """What a current lock leaves to the apt archive at build time ('' when nothing): the dependencies of its apt
    packages (no apt closure), or the packages themselves (a --apt manifest lock)."""
    if lock.apt_closure is not None or not apt_roots(render_manifest(manifest=manifest).text):
        return ""
    what = ("its apt packages' dependencies are not locked" if lock.apt_sources is not None else
            "its apt packages are locked only where the manifest pins a version, their dependencies not at all (an "
            "--apt manifest lock)")
    return (f"{what}: no apt closure, apt takes what the archive serves at build time; `skupin lock {manifest.name} "
            "--keep-python` on a host that runs its base pins them")


def stale_reasons(*, manifest: SkuManifest, lock: Lock) -> list[str]:
    """Every way a lock no longer matches what decides the installed set (empty when it does): the manifest's build
    inputs (manifest_digest), the base, the target, each pin, the engine's source, the apt pins, stack.omit, and
    (for a lock that resolved apt versions) the set of packages the Dockerfile apt-installs. Any other template edit
    is not among them: it changes the image (its tag hashes the locked Dockerfile), not the lock."""
    reasons: list[str] = []
    if lock.sku != manifest.name:
        reasons.append(f"lock is for {lock.sku}, not {manifest.name}")
    if lock.manifest_sha256 != manifest_digest(manifest):
        reasons.append("the manifest changed since the lock")
    if lock.base.identity() != locked_base(manifest):
        reasons.append("the base changed since the lock")
    if (lock.python, lock.platform) != (manifest.base.python, manifest.base.platform):
        reasons.append(f"lock targets Python {lock.python} {lock.platform}, manifest {manifest.base.python} "
                       f"{manifest.base.platform}")
    packages = lock.packages()
    wanted = [(layer, pin.distribution, pin.version) for layer, pin in manifest.stack.pins().items()
              if (pin.is_python and pin.source.kind != "git") or pin.is_sdist]
    wanted += [("extras", p.name, p.version) for p in manifest.extras.python]
    for layer, dist, version in wanted:
        got = packages.get(canonicalize_name(dist))
        if got is None or got.version != version:
            reasons.append(f"{layer} pin {dist}=={version} but the lock has {got.version if got else 'none'}")
    sdists = set(lock.sources())
    wanted_sdists = {str(canonicalize_name(p.distribution)) for p in manifest.stack.pins().values() if p.is_sdist}
    if sdists != wanted_sdists:
        reasons.append("the engine's source (a wheel or an sdist built in the image) differs from the lock")
    elif wanted_sdists and not lock.build:
        reasons.append("the lock records no wheels to build the engine's sdist with")
    reasons += _apt_reasons(manifest, lock)
    if lock.omitted != {str(canonicalize_name(o.name)): o.reason for o in manifest.stack.omit}:
        reasons.append("stack.omit differs from the lock")
    return reasons


def _apt_reasons(manifest: SkuManifest, lock: Lock) -> list[str]:
    """A lock that resolved its apt versions (apt_sources) must hold each apt pin of the manifest in its layer; an
    older one must equal the manifest's pins."""
    if lock.apt_sources is None:
        return ["apt pins differ from the lock"] if lock.system != _system(manifest) else []
    moved = []
    have = {entry for entries in lock.system.values() for entry in entries}  # by name in any layer, as pin_apt reads
    names = {entry.partition("=")[0] for entry in have}
    for layer, items in _system(manifest).items():
        moved += [f"{item} ({layer})" for item in items if (item not in have if "=" in item else item not in names)]
    reasons = [f"apt pins differ from the lock: {', '.join(moved)}"] if moved else []
    # what the templates apt-install (a template edit may add or drop a package) against what the lock has versions of
    rendered = {item.partition("=")[0] for items in apt_roots(render_manifest(manifest=manifest).text).values()
                for item in items}
    locked = {entry.partition("=")[0] for items in lock.system.values() for entry in items}
    if rendered - locked:
        reasons.append(f"the Dockerfile apt-installs {', '.join(sorted(rendered - locked))}, which the lock has no "
                       "version of (a template or manifest change)")
    if locked - rendered:
        reasons.append(f"the lock pins apt packages the Dockerfile no longer installs: {', '.join(sorted(locked - rendered))}")
    return reasons
