"""uv as the lock's resolver: `uv pip compile` for the image's Python and platform, answered in pip's report shape.

uv resolves for the target itself (`--python-version`, `--python-platform`: markers are evaluated for the
image, not this host); the lock took 19-24 s with it against pip's 61 s here (docs/BENCHMARKS.md, "Locking").
It runs twice on the same inputs: once against the index writing a PEP 751 `pylock.toml` (each package's version
and its wheels with their sha256, already filtered to the target), and once `--offline` from uv's cache, writing
annotated requirements whose `# via` comments give the dependency graph (side by side when the cache already answers
with the same versions, else after the first run has filled it; see `run_uv`). `run_uv` turns both into the
dict `builder.lock` reads from pip's `--report` (install[].metadata and download_info), so everything after the
resolution is shared.

Of a package's wheels the one pip would install is kept: the first in the target's tag priority
(packaging.tags for CPython X.Y on the target's platforms). Requires-Dist is replaced by the edges uv
reported (markers already applied), so the layer closure follows exactly what uv resolved.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import quote, unquote, urlparse

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from skupin.common.errors import LockError
from skupin.common.untrusted import printable

_PLATFORM = re.compile(r"^manylinux_(\d+)_(\d+)_(x86_64|aarch64)$")
_PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)\s*(?:#\s*via\s+(.*))?$")


def uv_binary() -> str | None:
    """The uv executable of the `uv` wheel installed with skupin (None when it is missing)."""
    try:
        from uv import find_uv_bin
    except ImportError:
        return None
    try:
        return str(find_uv_bin())
    except FileNotFoundError:
        return None


def _installed_version() -> str:
    """The version of the `uv` wheel that `uv_binary` runs (read from its metadata, not by running it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("uv")
    except PackageNotFoundError:
        return "?"


def uv_platform(platforms: Sequence[str]) -> str | None:
    """uv's --python-platform for pip's platform tags (the first is the newest manylinux), None when it has none."""
    m = _PLATFORM.match(platforms[0]) if platforms else None
    return f"{m.group(3)}-manylinux_{m.group(1)}_{m.group(2)}" if m else None


def usable(requirements: Sequence[str], platforms: Sequence[str]) -> bool:
    """Whether uv can take this request: a manylinux target, and no direct URL requirement (pip takes those)."""
    return uv_platform(platforms) is not None and not any(" @ " in r or "://" in r for r in requirements)


_LEGACY = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}


def _expanded(platforms: Sequence[str]) -> list[str]:
    """pip's expansion of --platform: each manylinux_2_N also admits every older glibc down to 2.5, with the legacy
    aliases (manylinux2014, manylinux2010, manylinux1) where they fall."""
    out: list[str] = []
    for platform in platforms:
        m = _PLATFORM.match(platform)
        extra = [platform]
        if m:
            major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
            extra = []
            for glibc in range(minor, 4, -1):
                extra.append(f"manylinux_{major}_{glibc}_{arch}")
                if (major, glibc) in _LEGACY:
                    extra.append(f"{_LEGACY[(major, glibc)]}_{arch}")
        out += [p for p in extra if p not in out]
    return out


def target_tags(*, python: str, abis: Sequence[str], platforms: Sequence[str]) -> list[Tag]:
    """The target's wheel tags, most preferred first (as pip ranks them)."""
    version = tuple(int(p) for p in python.split(".")[:2])
    interpreter = f"cp{version[0]}{version[1]}"
    every = _expanded(platforms)
    return [*cpython_tags(version, abis=list(abis), platforms=every),
            *compatible_tags(version, interpreter=interpreter, platforms=every)]


def _rank(filename: str, priority: Mapping[Tag, int]) -> int | None:
    try:
        _name, _version, _build, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    ranks = [priority[t] for t in tags if t in priority]
    return min(ranks) if ranks else None


def _wheel_url(wheel: Mapping[str, Any], base: Path) -> str:
    if "url" in wheel:
        return str(wheel["url"])
    path = Path(str(wheel.get("path", "")))
    return "file://" + quote(str(path if path.is_absolute() else (base / path).resolve()))


class Graph(NamedTuple):
    """What the annotated run resolved: each package's version, and the packages each one requires."""

    versions: dict[str, str]
    children: dict[str, tuple[str, ...]]


def via_graph(annotated: str) -> Graph:
    """The dependency graph in `uv pip compile --annotation-style line` output (`name==version  # via a, b`); a
    requirement line it cannot read is an error, never skipped (a package without edges would be dropped)."""
    children: dict[str, set[str]] = {}
    versions: dict[str, str] = {}
    for line in annotated.splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        m = _PINNED.match(text)
        if not m:
            raise LockError(f"uv wrote a requirement line the lock cannot read: {printable(text, 200)}")
        child = str(canonicalize_name(m.group(1)))
        versions[child] = m.group(2)
        children.setdefault(child, set())
        for parent in (m.group(3) or "").split(","):
            parent = parent.strip()
            if parent and not parent.startswith(("-r ", "-c ")):
                children.setdefault(str(canonicalize_name(parent)), set()).add(child)
    return Graph(versions=versions, children={k: tuple(sorted(v)) for k, v in children.items()})


def _versions(pylock: Mapping[str, Any]) -> dict[str, str]:
    return {str(canonicalize_name(p["name"])): str(p["version"]) for p in pylock.get("packages", ())}


def report_from(pylock: Mapping[str, Any], graph: Graph, *, tags: Sequence[Tag],
                base: Path, uv_version: str, layer: str) -> dict[str, Any]:
    """pip's --report shape (install[]: metadata, download_info) for uv's pylock and dependency graph; LockError when
    the two runs did not resolve the same set (an index that changed between them)."""
    locked = _versions(pylock)
    if locked != graph.versions:
        differ = sorted(set(locked.items()) ^ set(graph.versions.items()))
        raise LockError(f"{layer}: uv's two runs resolved different sets ({', '.join(f'{n} {v}' for n, v in differ[:6])}"
                        f"); the index changed meanwhile: lock again")
    priority = {tag: i for i, tag in enumerate(tags)}
    install, problems = [], []
    for pkg in pylock.get("packages", ()):
        name, version = str(canonicalize_name(pkg["name"])), str(pkg["version"])
        urls = [(_wheel_url(w, base), w) for w in pkg.get("wheels", ())]
        ranked = sorted((r, i) for i, (url, _w) in enumerate(urls)
                        if (r := _rank(unquote(urlparse(url).path).rsplit("/", 1)[-1], priority)) is not None)
        if not ranked:
            problems.append(f"{name} {version}: no wheel for the target (locks take wheels only)")
            continue
        url, wheel = urls[ranked[0][1]]
        sha = (wheel.get("hashes") or {}).get("sha256")
        if not sha and not url.startswith("file://"):
            problems.append(f"{name} {version}: the index gave no sha256 for {url.rsplit('/', 1)[-1]}")
            continue
        install.append({"metadata": {"name": name, "version": version,
                                     "requires_dist": list(graph.children.get(name, ()))},
                        "download_info": {"url": url, "archive_info": {"hashes": {"sha256": sha} if sha else {}}},
                        "is_direct": False})
    if problems:
        raise LockError(f"{layer}: uv's resolution cannot be locked: " + "; ".join(problems))
    return {"resolver": f"uv {uv_version}", "install": install}


def _explain(layer: str, output: str) -> str:
    tail = "\n".join(output.strip().splitlines()[-15:])
    if "No solution found" in output:
        return f"{layer}: the pins cannot be installed together (uv):\n{tail}"
    if any(s in output for s in ("Failed to fetch", "dns error", "certificate", "Connection refused", "timed out")):
        return f"{layer}: an index is unreachable (or its TLS is not trusted: pass --ca-bundle):\n{tail}"
    return f"{layer}: uv could not resolve:\n{tail}"


class UvRequest(Protocol):
    """What uv is asked: a `builder.lock.PipRequest` (by its shape: builder/lock.py imports this module)."""

    @property
    def layer(self) -> str: ...
    @property
    def requirements(self) -> tuple[str, ...]: ...
    @property
    def constraints(self) -> tuple[str, ...]: ...
    @property
    def index_url(self) -> str: ...
    @property
    def extra_index_urls(self) -> tuple[str, ...]: ...
    @property
    def find_links(self) -> tuple[str, ...]: ...
    @property
    def python(self) -> str: ...
    @property
    def abis(self) -> tuple[str, ...]: ...
    @property
    def platforms(self) -> tuple[str, ...]: ...


def _command(request: UvRequest, *, uv: str, platform: str, work: Path) -> list[str]:
    """`uv pip compile` of the request's requirements (and constraints, written into `work`) for the target."""
    reqs = work / "requirements.in"
    reqs.write_text("\n".join(request.requirements) + "\n", encoding="utf-8")
    cmd = [uv, "pip", "compile", str(reqs), "--quiet", "--no-header", "--python-version", request.python,
           "--python-platform", platform, "--only-binary", ":all:", "--index-strategy", "unsafe-best-match",
           "--index-url", request.index_url]
    for url in request.extra_index_urls:
        cmd += ["--extra-index-url", url]
    for folder in request.find_links:
        cmd += ["--find-links", folder]
    if request.constraints:
        cons = work / "constraints.txt"
        cons.write_text("\n".join(request.constraints) + "\n", encoding="utf-8")
        cmd += ["--constraints", str(cons)]
    return cmd


def _start(layer: str, cmd: list[str], *, env: Mapping[str, str], work: Path) -> subprocess.Popen[str]:
    try:
        return subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise LockError(f"{layer}: cannot run uv ({cmd[0]}): {exc}") from exc


def _finish(layer: str, proc: subprocess.Popen[str], *, timeout_s: float) -> None:
    """Wait for one `uv pip compile`; LockError (uv's own words) when it failed or ran past `timeout_s` (then killed)."""
    try:
        output = proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired as exc:
        raise LockError(f"{layer}: uv did not finish within {timeout_s:.0f} s") from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise LockError(_explain(layer, output))


def _uv(layer: str, cmd: list[str], *, env: Mapping[str, str], work: Path, timeout_s: float) -> None:
    _finish(layer, _start(layer, cmd, env=env, work=work), timeout_s=timeout_s)


def _read_graph(path: Path) -> Graph | None:
    """The graph uv wrote to `path`; None when there is none (a line it cannot read stays an error: via_graph)."""
    try:
        return via_graph(path.read_text(encoding="utf-8"))
    except OSError:
        return None


def run_uv(request: UvRequest, *, uv: str, ca_bundle: Path | None = None, timeout_s: float = 1800.0,
           environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Resolve one `builder.lock.PipRequest` with uv; pip's report shape (see the module doc). LockError on failure."""
    import os

    platform = uv_platform(request.platforms)
    if platform is None:
        raise LockError(f"{request.layer}: uv takes manylinux targets only, not {request.platforms[:1]}")
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if not k.startswith(("UV_", "PIP_"))}
    env["UV_NO_CONFIG"] = "1"
    if ca_bundle is not None:
        env["SSL_CERT_FILE"] = str(ca_bundle)
    with tempfile.TemporaryDirectory(prefix="skupin-uv-") as tmp:
        work = Path(tmp)
        cmd = _command(request, uv=uv, platform=platform, work=work)
        # One resolution against the index (pylock.toml) and, beside it, the graph from uv's cache alone
        # (`--offline`: no request, ~2 s of resolving here). When the cache held what the index now answers, the graph
        # resolves the same versions and is used; else (a cold cache, or releases the cache had not seen) it is made
        # again offline from the cache the first run has just filled, and from the index when that is refused or still
        # differs.
        # Two runs against the index side by side competed for it and for the cores: 1.5-2.2x one run
        # (docs/BENCHMARKS.md, "Locking").
        online = _start(request.layer, [*cmd, "--format", "pylock.toml", "-o", str(work / "pylock.toml")], env=env,
                        work=work)
        graph_out = work / "graph.txt"
        graph_cmd = [*cmd, "--annotation-style", "line", "-o", str(graph_out)]
        try:
            early = _start(request.layer, [*graph_cmd, "--offline"], env=env, work=work)
        except LockError:
            online.kill()
            online.wait()
            raise
        try:
            _finish(request.layer, online, timeout_s=timeout_s)
        finally:
            try:
                _finish(request.layer, early, timeout_s=timeout_s)
                graph = _read_graph(graph_out)
            except LockError:  # the cache could not answer offline (or what it answered is unreadable): made below
                graph = None
        try:
            pylock = tomllib.loads((work / "pylock.toml").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LockError(f"{request.layer}: uv wrote no readable lock: {exc}") from exc
        if graph is None or graph.versions != _versions(pylock):
            try:
                _uv(request.layer, [*graph_cmd, "--offline"], env=env, work=work, timeout_s=timeout_s)
                graph = _read_graph(graph_out)
            except LockError:
                graph = None
            # the cache still answers otherwise (pages it holds as fresh that the index has moved past, seen in CI):
            # the graph from the index itself; only if that too differs did the index change between the two runs
            if graph is None or graph.versions != _versions(pylock):
                graph_out.unlink(missing_ok=True)  # never the offline run's file read as this run's
                _uv(request.layer, graph_cmd, env=env, work=work, timeout_s=timeout_s)
                graph = _read_graph(graph_out)
            if graph is None:
                raise LockError(f"{request.layer}: uv wrote no readable dependency graph ({graph_out.name})")
        tags = target_tags(python=request.python, abis=request.abis, platforms=request.platforms)
        return report_from(pylock, graph, tags=tags, base=work, uv_version=_installed_version(), layer=request.layer)

