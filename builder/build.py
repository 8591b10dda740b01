"""Build a SKU's image from its lock: render, BuildKit build, verify the installed set, then tag.

The flow of `build_image` (a lock that no longer matches the manifest is refused first):
1. make sure the base exists (`builder.base.ensure_base`);
2. gather every locked wheel in the host's wheel store (`builder.wheels`: from the wheelhouse or
   downloaded, each checked against the lock's sha256; the extra CA bundle is trusted here);
3. render the Dockerfile with the lock and sync the SKU's build context folder
   (`.skupin/contexts/<sku>`, kept between builds and locked while in use, so that BuildKit
   re-sends only what changed; each step's wheels are hard-linked from the store);
4. `docker build` through the engine adapter with no tag (`--iidfile`); the locked steps need
   no network and no CA (the CA bundle reaches BuildKit, as the secret `skupin_ca`, only if the
   Dockerfile mounts it);
5. parse BuildKit's plain progress into per-layer durations and cache hits, mapping each step
   to the `# layer: NAME` comment above its instruction;
6. ask the image's own Python (in a sandboxed container) for its installed distributions and
   fail unless they equal the lock;
7. only then tag the content-addressed tag (`builder.lockfile.image_tag`) and write the build
   record (`.skupin/builds/<sku>.json`).
A failure at any step raises BuildError naming the layer with the tail of its log; no tag is made.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from packaging.utils import canonicalize_name
from pydantic import Field

from builder.base import ensure_base
from builder.lockfile import Lock, image_tag
from builder.manifest import SkuManifest
from builder.render import render_manifest, write_context
from builder.wheels import STORE, fetch_wheels
from common.errors import BuildError, DockerError, LockError
from common.model import Frozen
from common.paths import STATE
from dockerd import ContainerSpec, Docker

OnLine = Callable[[str], None]
Progress = Literal["tty", "plain"]
CA_SECRET_ID = "skupin_ca"
LOG_TAIL_LINES = 30


def _quiet(_: str) -> None:
    return None


class StepTiming(Frozen):
    """One BuildKit step (vertex) of the build."""

    number: int
    name: str
    layer: str
    seconds: float
    cached: bool


class LayerTiming(Frozen):
    """One layer of the rendered Dockerfile: its steps' total time and whether all were cached."""

    name: str
    seconds: float
    cached: bool
    steps: int


class BuiltImage(Frozen):
    """A built, verified and tagged image of one SKU."""

    sku: str
    image: str = Field(description="A reference `docker run` accepts: the content-addressed tag")
    image_id: str
    tags: tuple[str, ...]
    labels: dict[str, str]
    base_id: str
    lock_sha256: str
    dockerfile_sha256: str
    layers: tuple[LayerTiming, ...]
    steps: tuple[StepTiming, ...]
    cache_hits: int
    total_s: float
    phases: dict[str, float] = Field(
        default_factory=dict,
        description="Wall seconds per phase: base (check or bootstrap), context (render + sync), "
                    "buildkit (the `docker build`), verify (the image's Python vs. the lock), tag",
    )
    size_bytes: int
    installed: dict[str, str] = Field(description="Distributions the image's own Python reports: name -> version")
    created: str


# ---------------------------------------------------------------- Dockerfile -> layers


_LAYER_RE = re.compile(r"^#\s*layer:\s*([A-Za-z0-9_.-]+)\s*$")
_STEP_HEAD = re.compile(r"^#(\d+) \[(?:[^\]]*?\s)?(\d+)/(\d+)\] (.*)$")
_EXPORT_HEAD = re.compile(r"^#(\d+) exporting to image$")
_STEP_DONE = re.compile(r"^#(\d+) DONE ([0-9.]+)s$")
_STEP_CACHED = re.compile(r"^#(\d+) CACHED$")
_STEP_ERROR = re.compile(r"^#(\d+) ERROR: (.*)$")
_STEP_LOG = re.compile(r"^#(\d+) [0-9]+\.[0-9]+ (.*)$")
_WS = re.compile(r"\s+")


def _norm(text: str) -> str:
    return _WS.sub(" ", text).strip()


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(layer, normalised instruction) for every instruction of a Dockerfile, in order.

    An instruction belongs to the nearest `# layer: NAME` comment above it ("preamble" before
    the first; BuildKit's FROM step is reported as layer "base", its export as "export"). Continuation lines are joined
    the way BuildKit names its steps.
    """
    out: list[tuple[str, str]] = []
    layer = "preamble"
    pending = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not pending:
            m = _LAYER_RE.match(line.strip())
            if m:
                layer = m.group(1)
                continue
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((layer, _norm(pending + line)))
        pending = ""
    if pending:
        out.append((layer, _norm(pending)))
    return out


class _Step:
    def __init__(self, number: int, name: str, layer: str) -> None:
        self.number, self.name, self.layer = number, name, layer
        self.seconds = 0.0
        self.cached = False
        self.error: str | None = None
        self.log: list[str] = []


def parse_progress(lines: list[str], *, dockerfile: str) -> list[_Step]:
    """BuildKit plain progress -> the Dockerfile's steps (FROM/RUN/COPY...) with layer, time, cache, log."""
    instructions = dockerfile_instructions(dockerfile)
    steps: dict[int, _Step] = {}
    cursor = 0
    for line in lines:
        m = _STEP_HEAD.match(line)
        if m and int(m.group(1)) not in steps:
            name = _norm(m.group(4))
            layer, cursor = _layer_of(name, instructions, cursor)
            steps[int(m.group(1))] = _Step(int(m.group(1)), name, layer)
            continue
        m = _EXPORT_HEAD.match(line)
        if m and int(m.group(1)) not in steps:
            steps[int(m.group(1))] = _Step(int(m.group(1)), "exporting to image", "export")
            continue
        for regex in (_STEP_DONE, _STEP_CACHED, _STEP_ERROR, _STEP_LOG):
            m = regex.match(line)
            if m and int(m.group(1)) in steps:
                step = steps[int(m.group(1))]
                if regex is _STEP_DONE:
                    step.seconds = float(m.group(2))
                elif regex is _STEP_CACHED:
                    step.cached = True
                elif regex is _STEP_ERROR:
                    step.error = m.group(2)
                else:
                    step.log.append(m.group(2))
                break
    return list(steps.values())


def _layer_of(name: str, instructions: list[tuple[str, str]], cursor: int) -> tuple[str, int]:
    """The layer of the instruction BuildKit calls `name`, searching forward from `cursor` first."""
    if name.startswith("FROM "):
        return "base", cursor
    order = list(range(cursor, len(instructions))) + list(range(cursor))
    for i in order:
        layer, text = instructions[i]
        if name == text or text.startswith(name) or name.startswith(text):
            return layer, i + 1
    for i in order:  # BuildKit names steps with ENV/ARG values substituted: `$VIRTUAL_ENV` -> its value
        layer, text = instructions[i]
        if "$" in text and _with_variables(text).match(name):
            return layer, i + 1
    return "unknown", cursor


@functools.lru_cache(maxsize=256)
def _with_variables(text: str) -> re.Pattern[str]:
    parts = re.split(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", text)
    return re.compile(".*?".join(re.escape(part) for part in parts))


def layer_timings(steps: list[_Step]) -> tuple[LayerTiming, ...]:
    """Sum steps per layer, in the order layers first appear."""
    agg: dict[str, list[_Step]] = {}
    for s in steps:
        agg.setdefault(s.layer, []).append(s)
    return tuple(
        LayerTiming(
            name=n, seconds=round(sum(s.seconds for s in group), 2), cached=all(s.cached for s in group), steps=len(group)
        )
        for n, group in agg.items()
    )


def _refuse_stale(*, manifest: SkuManifest, manifest_path: Path, lock: Lock) -> None:
    """LockError when the lock no longer matches the manifest (the image would not be what it says)."""
    from builder.lock import stale_reasons

    reasons = stale_reasons(manifest=manifest, lock=lock, dockerfile_sha256=render_manifest(manifest=manifest).sha256)
    if reasons:
        raise LockError(f"{manifest_path}: the lock does not match the manifest: {'; '.join(reasons)}; "
                        f"fix: run `skupin lock {manifest.name}`")


def _failure(exc: BuildError, *, lines: list[str], dockerfile: str, ca_given: bool = True) -> BuildError:
    steps = parse_progress(lines, dockerfile=dockerfile)
    failed = next((s for s in steps if s.error), None)
    if failed is None:
        tail = "\n".join(lines[-LOG_TAIL_LINES:])
        return BuildError(f"build failed before any layer ran ({exc}):\n{tail}")
    tail = "\n".join(failed.log[-LOG_TAIL_LINES:])
    hint = ""
    if not ca_given and any("CERTIFICATE_VERIFY_FAILED" in line for line in failed.log):
        hint = "\nfix: TLS to the index is intercepted here; pass --ca-bundle FILE (e.g. /etc/ssl/certs/ca-certificates.crt)"
    err = BuildError(f"layer '{failed.layer}' failed: step {failed.name[:160]}: {failed.error}\n"
                     f"last lines of its log:\n{tail}{hint}")
    err.layer = failed.layer  # type: ignore[attr-defined]
    return err


# ---------------------------------------------------------------- verifying the image


_LIST_DISTS = (
    "import importlib.metadata as m, json, sys\n"
    "d = {}\n"
    "for dist in m.distributions():\n"
    "    n = dist.metadata['Name']\n"
    "    if n: d[n] = dist.version\n"
    "json.dump(d, sys.stdout, sort_keys=True)\n"
)


def installed_distributions(*, docker: Docker, image: str, deadline_s: float = 120) -> dict[str, str]:
    """Ask the image's own Python (sandboxed: no network, read-only) for its installed distributions."""
    spec = ContainerSpec(image=image, entrypoint=("python", "-c", _LIST_DISTS), mem_limit="1g", user="65534:65534")
    res = docker.run(spec, deadline_s=deadline_s)
    if res.exit_code != 0:
        raise BuildError(f"could not list the distributions of {image} (exit {res.exit_code}): {res.stderr.strip()[-2000:]}")
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise BuildError(f"the image's Python printed no JSON list of distributions: {res.stdout[:500]!r}") from exc
    return {canonicalize_name(k): str(v) for k, v in data.items()}


def compare_with_lock(*, installed: dict[str, str], lock: Lock) -> list[str]:
    """Every difference between what the image contains and what the lock says (empty = equal)."""
    locked = {n: p.version for n, p in lock.packages().items()}  # keys already canonical
    problems = [f"{n}: locked {v}, image has {installed.get(n, 'nothing')}"
                for n, v in sorted(locked.items()) if installed.get(n) != v]
    problems += [f"{n}: image has {v}, not in the lock" for n, v in sorted(installed.items()) if n not in locked]
    return problems


# ---------------------------------------------------------------- the build


def build_image(
    *,
    manifest: SkuManifest,
    manifest_path: Path,
    lock: Lock,
    docker: Docker,
    wheelhouse: Path | None = None,
    ca_bundle: Path | None = None,
    progress: Progress = "plain",
    on_line: OnLine = _quiet,
    no_cache: bool = False,
    records: Path | None = None,
    wheel_store: Path | None = None,
) -> BuiltImage:
    """Build, verify and tag the SKU's image from its lock; write the build record; see the module doc."""
    if lock.sku != manifest.name:
        raise BuildError(f"{manifest_path}: the lock is for SKU {lock.sku!r}, not {manifest.name!r}")
    if ca_bundle is not None and not ca_bundle.is_file():
        raise BuildError(f"--ca-bundle {ca_bundle}: no such file")
    _refuse_stale(manifest=manifest, manifest_path=manifest_path, lock=lock)  # before any Docker work
    start = time.monotonic()
    phases: dict[str, float] = {}
    mark = start

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = round(now - mark, 3)
        mark = now

    base_id = ensure_base(manifest=manifest, docker=docker, on_event=on_line)
    phase("base")
    rendered = render_manifest(manifest=manifest, lock=lock)
    tag = image_tag(sku=manifest.name, engine_version=manifest.stack.engine.version, lock=lock)
    lock_hash = lock.content_hash()
    lines: list[str] = []
    sink = _sink(progress=progress, on_line=on_line, dockerfile=rendered.text, lines=lines)
    stored = fetch_wheels(
        lock.packages().values(), store=wheel_store or STORE, wheelhouse=wheelhouse,
        ca_bundle=ca_bundle, on_event=on_line,
    )
    phase("wheels")
    with _context_folder(STATE / "contexts" / manifest.name, on_line=on_line) as folder:
        ctx = write_context(rendered=rendered, out=folder, wheels=stored, prune=True)
        phase("context")
        try:
            image_id = docker.build(
                context=ctx,
                dockerfile=ctx / "Dockerfile",
                build_args={
                    "SKUPIN_BASE": manifest.base.reference,
                    "SKUPIN_LOCK_HASH": lock_hash,
                    "SKUPIN_DOCKERFILE_SHA256": rendered.sha256,
                },
                secrets={CA_SECRET_ID: ca_bundle} if ca_bundle and f"id={CA_SECRET_ID}" in rendered.text else None,
                no_cache=no_cache,
                on_line=sink,
            )
        except BuildError as exc:
            raise _failure(exc, lines=lines, dockerfile=rendered.text, ca_given=ca_bundle is not None) from exc
    phase("buildkit")
    steps = parse_progress(lines, dockerfile=rendered.text)
    installed = installed_distributions(docker=docker, image=image_id)
    problems = compare_with_lock(installed=installed, lock=lock)
    phase("verify")
    if problems:
        raise BuildError(
            f"image {image_id[:19]} of {manifest.name} does not contain its locked set ({len(problems)} difference(s)); "
            "not tagged:\n"
            + "\n".join(problems[:40])
        )
    docker.tag(image_id, tag)
    info = docker.inspect_image(tag)
    if info is None:
        raise DockerError(f"tagged {image_id} as {tag} but the engine does not show it")
    phase("tag")
    built = BuiltImage(
        sku=manifest.name,
        image=tag,
        image_id=info.id,
        tags=info.tags,
        labels=info.labels,
        base_id=base_id,
        lock_sha256=lock_hash,
        dockerfile_sha256=rendered.sha256,
        layers=layer_timings(steps),
        steps=tuple(
            StepTiming(number=s.number, name=s.name[:200], layer=s.layer, seconds=s.seconds, cached=s.cached) for s in steps
        ),
        cache_hits=sum(1 for s in steps if s.cached),
        total_s=round(time.monotonic() - start, 2),
        phases=phases,
        size_bytes=info.size,
        installed=installed,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    if records is not None:
        write_record(built=built, folder=records)
    return built


@contextlib.contextmanager
def _context_folder(folder: Path, *, on_line: OnLine):
    """The SKU's build-context folder, held under an exclusive lock for the whole build."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_line(f"waiting for another build of {folder.name} (context {folder} is in use)")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sink(*, progress: Progress, on_line: OnLine, dockerfile: str, lines: list[str]) -> OnLine:
    """Collect every line; pass all of them on (plain) or one status line per step event (tty)."""
    instructions = dockerfile_instructions(dockerfile) if progress == "tty" else []  # only tty maps steps live
    names: dict[str, str] = {}
    cursor = [0]

    def sink(line: str) -> None:
        lines.append(line)
        if progress == "plain":
            on_line(line)
            return
        m = _STEP_HEAD.match(line)
        if m and m.group(1) not in names:
            layer, cursor[0] = _layer_of(_norm(m.group(4)), instructions, cursor[0])
            names[m.group(1)] = f"[{layer}] {_norm(m.group(4))[:90]}"
            on_line(f"{names[m.group(1)]} ...")
            return
        for regex, what in ((_STEP_DONE, "done"), (_STEP_CACHED, "cached"), (_STEP_ERROR, "ERROR")):
            m = regex.match(line)
            if m and m.group(1) in names:
                extra = f" {m.group(2)}s" if regex is _STEP_DONE else f": {m.group(2)}" if regex is _STEP_ERROR else ""
                on_line(f"{names[m.group(1)]} {what}{extra}")
                return

    return sink


def write_record(*, built: BuiltImage, folder: Path) -> Path:
    """Write the build record JSON (<folder>/<sku>.json, atomic replace) and return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    return built.write_json(folder / f"{built.sku}.json")
