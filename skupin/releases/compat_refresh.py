"""Regenerate the index-derived compatibility rows (torch -> triton + CUDA runtime, engine -> torch) from wheel metadata.

Source of truth: the Requires-Dist of each release's Linux x86_64 wheel, read from the index
(PEP 658 `.metadata` or the wheel's own METADATA via range reads, see skupin/clients/pypi.py), with its
markers evaluated for Linux x86_64 and the target Python. The JSON API's `info.requires_dist` is
not used: on PyPI it can disagree with the wheels (vllm 0.33.0: JSON says torch==2.13.0, both
wheels say torch==2.14.0).

Rows regenerated: `torch_compiler` rows of family cuda (torch >= spec.torch_min), and
`engine_torch` rows of the spec's engine distributions (by default each engine distribution in
skupin/engines/ that names a `refresh_since`: vllm >= 0.8.5, sglang >= 0.5.19). Every other row
(ROCm/XPU, release-note facts such as CUDA -> driver) and every comment of builder/data/compat.yaml
is kept as it is: the file is edited line by line, not dumped.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from pydantic import ValidationError

from skupin.builder.catalog.compat import CompatData
from skupin.clients.pypi import PYPI_SIMPLE, IndexClient, linux_x86_64_wheel
from skupin.common.errors import CompatError, NetworkError
from skupin.common.model import Frozen
from skupin.engines import refresh_sources

if TYPE_CHECKING:
    from skupin.clients.pypi import IndexFile

CUDA_RUNTIME = re.compile(r"^nvidia-cuda-runtime(-cu\d+)?$")
TORCH_KEYS = ("torch", "family", "compiler", "requires", "cuda_runtime", "source", "date")
ENGINE_KEYS = ("engine", "version", "torch", "source", "date")
Progress = Callable[[str], None]


class RefreshSpec(Frozen):
    """What refresh covers: torch releases from torch_min; each engine distribution from its first release."""

    torch_min: str = "2.4.0"
    engines: tuple[tuple[str, str], ...] = refresh_sources()
    python: str = "3.12"


class Refreshed(Frozen):
    """Rows derived from the index, and the releases that gave none (with why)."""

    torch_compiler: tuple[dict, ...]
    engine_torch: tuple[dict, ...]
    skipped: tuple[str, ...] = ()


def marker_env(python: str, extra: str = "") -> dict[str, str]:
    """PEP 508 environment of a Linux x86_64 CPython `python` (the wheel platform the rows describe)."""
    return {"implementation_name": "cpython", "os_name": "posix", "platform_machine": "x86_64",
            "platform_python_implementation": "CPython", "platform_system": "Linux", "sys_platform": "linux",
            "python_version": python, "python_full_version": f"{python}.0", "implementation_version": f"{python}.0",
            "platform_release": "", "platform_version": "", "extra": extra}


def applicable(requires_dist: tuple[str, ...], *, python: str) -> dict[str, Requirement]:
    """Requirements that apply on Linux x86_64 / `python` without extras, by canonical name."""
    env = marker_env(python)
    found: dict[str, Requirement] = {}
    for line in requires_dist:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate(env):
            found.setdefault(canonicalize_name(req.name), req)
    return found


def _exact(req: Requirement) -> str | None:
    pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
    return pins[0] if len(pins) == 1 else None


def cuda_runtime(reqs: dict[str, Requirement]) -> str | None:
    """CUDA runtime of a torch wheel: cuda-toolkit==X.Y.Z (torch >= 2.11) or nvidia-cuda-runtime-cu12==X.Y.* -> X.Y."""
    if "cuda-toolkit" in reqs and (v := _exact(reqs["cuda-toolkit"])):
        return v
    for name, req in reqs.items():
        if CUDA_RUNTIME.match(name) and (v := _exact(req)):
            parsed = Version(v)
            return f"{parsed.major}.{parsed.minor}"
    return None


def _label(index_url: str) -> str:
    return "PyPI" if "pypi.org" in index_url else index_url.rstrip("/")


def _wheel_requiring(index: IndexClient, name: str, version: Version, dependency: str, *, python: str,
                     skipped: list[str]) -> tuple[IndexFile, dict[str, Requirement]] | None:
    """(wheel, applicable requirements) of `name`'s Linux x86_64 wheel when it requires `dependency`;
    else None, with the reason appended to `skipped`."""
    wheel = linux_x86_64_wheel(index.files(name, version), python=python)
    if wheel is None:
        skipped.append(f"{name} {version}: no Linux x86_64 wheel")
        return None
    reqs = applicable(index.core_metadata(wheel).get("requires-dist", ()), python=python)
    if dependency not in reqs:
        skipped.append(f"{name} {version}: {wheel.filename} does not require {dependency}")
        return None
    return wheel, reqs


DEFAULT_SPEC = RefreshSpec()


def torch_compiler_row(index: IndexClient, version: Version, *, today: datetime.date, python: str,
                       skipped: list[str]) -> dict | None:
    """The `torch_compiler` row (family cuda) of one torch release, from its Linux x86_64 wheel's Requires-Dist;
    None (the reason appended to `skipped`) when the wheel is missing or requires no triton."""
    found = _wheel_requiring(index, "torch", version, "triton", python=python, skipped=skipped)
    if found is None:
        return None
    wheel, reqs = found
    row = {"torch": str(version), "family": "cuda", "compiler": "triton", "requires": str(reqs["triton"].specifier),
           "cuda_runtime": cuda_runtime(reqs),
           "source": f"{_label(index.base_url)} torch {version} Requires-Dist ({wheel.filename})", "date": today}
    return {k: v for k, v in row.items() if v is not None}


def engine_torch_row(index: IndexClient, engine: str, version: Version, *, today: datetime.date, python: str,
                     skipped: list[str]) -> dict | None:
    """The `engine_torch` row of one engine release, from its Linux x86_64 wheel's Requires-Dist; None (the reason
    appended to `skipped`) when the wheel is missing or requires no torch."""
    found = _wheel_requiring(index, engine, version, "torch", python=python, skipped=skipped)
    if found is None:
        return None
    wheel, reqs = found
    return {"engine": engine, "version": str(version), "torch": str(reqs["torch"].specifier),
            "source": f"{_label(index.base_url)} {engine} {version} Requires-Dist ({wheel.filename})", "date": today}


def derive_rows(*, index: IndexClient, today: datetime.date, spec: RefreshSpec = DEFAULT_SPEC,
                progress: Progress | None = None) -> Refreshed:
    """Read every covered release's wheel metadata from the index and turn it into compat rows."""
    say = progress or (lambda _m: None)
    _prefetch(index, spec)
    torch_rows: list[dict] = []
    engine_rows: list[dict] = []
    skipped: list[str] = []
    for version in index.versions("torch"):
        if version < Version(spec.torch_min):
            continue
        row = torch_compiler_row(index, version, today=today, python=spec.python, skipped=skipped)
        if row is not None:
            torch_rows.append(row)
            say(f"torch {version}: triton{row['requires']}, CUDA {row.get('cuda_runtime')}")
    for engine, low in spec.engines:
        for version in index.versions(engine):
            if version < Version(low):
                continue
            row = engine_torch_row(index, engine, version, today=today, python=spec.python, skipped=skipped)
            if row is not None:
                engine_rows.append(row)
                say(f"{engine} {version}: torch{row['torch']}")
    return Refreshed(torch_compiler=tuple(torch_rows), engine_torch=tuple(engine_rows), skipped=tuple(skipped))


def _prefetch(index: IndexClient, spec: RefreshSpec, workers: int = 8) -> None:
    """Fetch every covered wheel's metadata concurrently (the client caches it); errors surface later, in order."""

    wanted = [("torch", spec.torch_min), *spec.engines]
    files = []
    for name, low in wanted:
        for version in index.versions(name):
            if version >= Version(low) and (f := linux_x86_64_wheel(index.files(name, version), python=spec.python)):
                files.append(f)

    def fetch(file: IndexFile) -> None:
        try:
            index.core_metadata(file)
        except NetworkError:
            pass

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fetch, files))


# ------------------------------------------------------------------ writing rows into compat.yaml


def _scalar(value: object) -> str:
    """A flow-style YAML scalar that reads back as exactly `value` (quoted when plain would not)."""
    if isinstance(value, datetime.date):
        return value.isoformat()
    text = str(value)
    plain = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", text) is not None
    if plain and yaml.safe_load(f"k: {text}")["k"] == text:
        return text
    return json.dumps(text)


def format_row(row: dict, keys: tuple[str, ...]) -> str:
    """`  - {k: v, ...}` in the file's style: requires/torch specifiers, runtimes and sources quoted."""
    quoted = {"requires", "cuda_runtime", "source"} | ({"torch"} if "engine" in row else set())
    parts = []
    for key in keys:
        if key not in row:
            continue
        value = row[key]
        parts.append(f"{key}: {json.dumps(str(value)) if key in quoted else _scalar(value)}")
    return "  - {" + ", ".join(parts) + "}"


def _sections(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Top-level key -> (first line, end line) of its block."""
    starts = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.match(r"^([A-Za-z_]\w*):", line))]
    return {name: (i, starts[n + 1][0] if n + 1 < len(starts) else len(lines)) for n, (i, name) in enumerate(starts)}


def _replace_rows(lines: list[str], section: str, drop: Callable[[dict], bool], new: list[str]) -> list[str]:
    """Drop the section's rows for which `drop` is true and put `new` where the first of them was."""
    bounds = _sections(lines).get(section)
    if bounds is None:
        return lines + [f"{section}:"] + new
    start, end = bounds
    out = lines[:start + 1]
    at = None
    last_row = start
    for i in range(start + 1, end):
        line = lines[i]
        if line.lstrip().startswith("- {"):
            row = yaml.safe_load(line.strip()[2:])
            last_row = len(out)
            if isinstance(row, dict) and drop(row):
                at = len(out) if at is None else at
                continue
        out.append(line)
    where = at if at is not None else last_row + 1
    return out[:where] + new + out[where:] + lines[end:]


def merge_rows(*, text: str, refreshed: Refreshed, spec: RefreshSpec = DEFAULT_SPEC) -> str:
    """compat.yaml text with the regenerated rows swapped in; comments and other rows untouched."""
    lines = text.splitlines()
    torch_new = [format_row(r, TORCH_KEYS) for r in refreshed.torch_compiler]
    engines = {name for name, _ in spec.engines}
    floors = dict(spec.engines)
    eng_new = [format_row(r, ENGINE_KEYS) for r in refreshed.engine_torch]
    lines = _replace_rows(lines, "torch_compiler",
                          lambda r: r.get("family") == "cuda" and Version(str(r["torch"])) >= Version(spec.torch_min),
                          torch_new)
    lines = _replace_rows(lines, "engine_torch",
                          lambda r: r.get("engine") in engines and Version(str(r["version"])) >= Version(floors[r["engine"]]),
                          eng_new)
    return "\n".join(lines) + "\n"


def _same_release(section: str, a: dict, b: dict) -> bool:
    if section == "torch_compiler":
        return a.get("family") == b.get("family") and Version(str(a["torch"])) == Version(str(b["torch"]))
    return a.get("engine") == b.get("engine") and Version(str(a["version"])) == Version(str(b["version"]))


def _group_version(section: str, row: dict) -> tuple[str, Version]:
    if section == "torch_compiler":
        return str(row.get("family")), Version(str(row["torch"]))
    return str(row.get("engine")), Version(str(row["version"]))


def add_row(*, text: str, section: str, row: dict) -> str:
    """compat.yaml text with one derived row put in: in place of the row of the same release, else after the last row
    of its family (torch_compiler) or engine (engine_torch) with an older version; comments and other rows untouched."""
    keys = TORCH_KEYS if section == "torch_compiler" else ENGINE_KEYS
    line = format_row(row, keys)
    lines = text.splitlines()
    bounds = _sections(lines).get(section)
    if bounds is None:
        return "\n".join([*lines, f"{section}:", line]) + "\n"
    start, end = bounds
    group, version = _group_version(section, row)
    after = last = start
    for i in range(start + 1, end):
        if not lines[i].lstrip().startswith("- {"):
            continue
        old = yaml.safe_load(lines[i].strip()[2:])
        if not isinstance(old, dict):
            continue
        last = i
        if _same_release(section, old, row):
            return "\n".join([*lines[:i], line, *lines[i + 1:]]) + "\n"
        old_group, old_version = _group_version(section, old)
        if old_group == group and old_version < version:
            after = i
    at = (after if after != start else last) + 1
    return "\n".join([*lines[:at], line, *lines[at:]]) + "\n"


class RefreshReport(Frozen):
    out: str
    torch_rows: int
    engine_rows: int
    skipped: tuple[str, ...]
    seconds: float
    changed: bool


def refresh(*, index_url: str = PYPI_SIMPLE, out: Path, compat_path: Path, ca_bundle: Path | None = None,
            today: datetime.date | None = None, spec: RefreshSpec = DEFAULT_SPEC, timeout: float = 60.0,
            progress: Progress | None = None) -> RefreshReport:
    """Derive the rows from `index_url`, merge them into `compat_path`'s text, validate, write `out`."""

    started = time.monotonic()
    with IndexClient(index_url, ca_bundle=ca_bundle, timeout=timeout) as index:
        rows = derive_rows(index=index, today=today or datetime.date.today(), spec=spec, progress=progress)
    if not rows.torch_compiler and not rows.engine_torch:
        raise NetworkError(f"index {index_url}: no torch or engine releases found; is it the right index?")
    old = compat_path.read_text(encoding="utf-8") if compat_path.exists() else "schema_version: 1\n"
    text = merge_rows(text=old, refreshed=rows, spec=spec)
    try:
        CompatData.model_validate(yaml.safe_load(text))
    except ValidationError as exc:
        raise CompatError(f"refreshed compatibility data does not validate: {exc}") from exc
    changed = text != (out.read_text(encoding="utf-8") if out.exists() else None)
    if changed:
        out.write_text(text, encoding="utf-8")
    return RefreshReport(out=str(out), torch_rows=len(rows.torch_compiler), engine_rows=len(rows.engine_torch),
                         skipped=rows.skipped, seconds=round(time.monotonic() - started, 3), changed=changed)


# ------------------------------------------------------------------ CLI
