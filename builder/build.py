"""Build a SKU's image from its locked render: a pure planner, then an executor that runs Docker.

`build(rendered, docker)` is the build stage. `plan_build(rendered)` decides every step before
anything runs (pure: no Docker, no network, no files; tested without Docker, as cibuildwheel's
`get_build_steps`), refusing a render whose stack has no current lock; `execute_build` runs the
steps in order:
0. `FetchResult` (with a registry cache only; below): the image of these very inputs, if the cache holds one;
1. `GatherWheels`: every locked wheel into the host's wheel store (`builder.wheels`: from the
   wheelhouse or downloaded, each checked against the lock's sha256; the extra CA bundle is
   trusted here), so a missing or mismatched wheel refuses the build before a base is made;
2. `EnsureBase`: make sure the base exists (`builder.base.ensure_base`);
3. `WriteContext`: sync the SKU's build context folder (`.skupin/contexts/<sku>`, kept between
   builds and locked while in use, so that BuildKit re-sends only what changed; each step's wheels
   are hard-linked from the store);
4. `RunBuildKit`: `docker build` through the Docker adapter with no tag (`--iidfile`); the locked
   steps need no network and no CA (the CA bundle reaches BuildKit, as the secret `skupin_ca`,
   only if the Dockerfile mounts it); BuildKit's plain progress is parsed into per-layer
   durations and cache hits, mapping each step to the `# layer: NAME` comment above its instruction;
   with a registry cache reference it reuses that reference's inline cache;
5. `Normalise`: rewrite BuildKit's image so one lock gives one image id on any machine
   (`builder.reproducible`: mtimes clamped to one epoch, one config `created`); BuildKit's image goes;
6. `VerifyInstalled`: ask the image's own Python (in a sandboxed container) for its installed
   distributions and fail unless they equal the lock;
7. `TagImage`: only then tag the content-addressed tag (`builder.catalog.lockfile.image_tag`);
8. `ExportCache` (with a registry cache only): push it (below);
9. `RecordBuiltWheel` (a source-built engine only): record the wheel its build stage made;
10. `WriteRecord`: write the build record (`.skupin/builds/<sku>.json`).
A failure at any step raises BuildError naming the layer with the tail of its log; no tag is made and no image it
made or pulled is left untagged.

The registry cache (`cache`, host/repository:tag such as ghcr.io/acme/skupin-staging/cpu-x86_64:buildcache) is for
runners without local state. After a verified build it holds two images over the same rewritten layers: at the
reference, the layers under a config that carries BuildKit's inline cache (a later build's BuildKit reuses every step
below a changed pin, and gets layers that are rewritten already: the rewrite does not load them again); at
`result_reference` (the same repository, the tag + "-" + 32 hex of `build_inputs_key`, the hash of every build input),
the built image itself. A build with the cache first tries `FetchResult`: a pull of its inputs' result reference,
checked before it runs (every label, the config, the base layer); on a hit steps 1-5 and 8 are skipped and the pulled
image goes through 6 and 7 as a built one does; if it fails there, the plan runs again without FetchResult (a build,
whose image then replaces it in the cache). The cache is trusted as far as whoever can write to it (as any BuildKit
cache is; docs/REPRODUCIBLE.md): `--no-cache` reads neither (and still refreshes both), `skupin verify --rebuild`
builds with no cache at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from packaging.utils import canonicalize_name
from pydantic import Field

from skupin.builder.base import bases_dir, check_locked_base, ensure_base
from skupin.builder.catalog.lockfile import Lock, LockedBase, LockedPackage, sku_image_tag
from skupin.builder.catalog.manifest import SkuManifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.builder.imageconfig import ImageConfig, config_of, labels_of
from skupin.builder.render import ENGINE_WHEEL_STAGE, RenderedDockerfile, write_context
from skupin.builder.reproducible import IMAGE_EPOCH, LAYER_FORMAT, NormalisedImage, normalise_image
from skupin.builder.sourcebuild import BuiltWheel, built_dir, export_wheel, write_built
from skupin.builder.wheels import fetch_wheels
from skupin.builder.wheels import wheel_store as default_wheel_store
from skupin.common.errors import BuildError, DockerError, LockError
from skupin.common.model import Frozen
from skupin.common.paths import state_dir
from skupin.dockerd import ContainerSpec, Docker, ImageInfo

OnLine = Callable[[str], None]
# The build argument the Dockerfile turns into the label DOCKERFILE_LABEL: the hash of the Dockerfile that built the image
# (the image tag hashes it with the lock; publish checks an image's label before giving it a version tag).
DOCKERFILE_ARG = "SKUPIN_DOCKERFILE_SHA256"
DOCKERFILE_LABEL = "io.skupin.dockerfile-sha256"
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
        description="Wall seconds per step of the plan: fetch (the registry cache's image of these inputs), base "
                    "(check or bootstrap), wheels (gather them in the store), context (sync the build context), "
                    "buildkit (the `docker build`), normalise (the rewrite), verify (the image's Python vs. the lock), "
                    "tag, cache (push the registry cache), built (record a source-built wheel)",
    )
    size_bytes: int
    installed: dict[str, str] = Field(description="Distributions the image's own Python reports: name -> version")
    created: str
    builder: str = Field("", description="The engine whose BuildKit built it (`docker <server version>`)")
    reproducible: NormalisedImage | None = Field(None, description="The rewrite that made its image id reproducible "
                                                                   "(builder/reproducible.py)")
    cache: str | None = Field(None, description="The registry cache reference BuildKit read and this build refreshed "
                                                "(None when it was not refreshed, or the image was fetched)")
    fetched: str | None = Field(None, description="repository@digest of the registry cache's image of the same inputs "
                                                  "this build pulled instead of building: nothing was built here (and "
                                                  "`reproducible` is None)")
    stack: ResolvedStack = Field(exclude=True, description="The stack it was built from (for the gate and publish; "
                                                          "not part of the build record)")


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
    from skupin.builder.aptlock import stale_version_hint  # a locked apt version the archive no longer serves

    sku = re.search(r"^# Rendered by skupin \S+ from skus/([A-Za-z0-9._-]+)\.yaml", dockerfile, re.M)
    if "\n# UNLOCKED:" not in dockerfile:  # an unlocked render pins no apt version the archive could have dropped
        hint += stale_version_hint(failed.log, sku=sku.group(1) if sku else "SKU")
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


def locked_versions(lock: Lock) -> dict[str, str]:
    """Every locked distribution: canonical name -> version (what the image must contain, exactly)."""
    return {n: p.version for n, p in lock.packages().items()}  # keys already canonical


def compare_installed(*, installed: Mapping[str, str], locked: Mapping[str, str]) -> list[str]:
    """Every difference between what the image contains and what the lock says (empty = equal)."""
    problems = [f"{n}: locked {v}, image has {installed.get(n, 'nothing')}"
                for n, v in sorted(locked.items()) if installed.get(n) != v]
    problems += [f"{n}: image has {v}, not in the lock" for n, v in sorted(installed.items()) if n not in locked]
    return problems


# ---------------------------------------------------------------- the plan (pure)


class EnsureBase(Frozen):
    """Make the SKU's base image available: reuse it, bootstrap it or pull it by digest."""

    kind: Literal["base"] = "base"
    manifest: SkuManifest
    bases: Path  # the host's records of bootstrap bases (builder/base.py)
    locked: LockedBase | None = None  # the lock's base: a bootstrapped base's layer must be the one it records


class GatherWheels(Frozen):
    """Put every locked wheel into the wheel store, each checked against the lock's sha256."""

    kind: Literal["wheels"] = "wheels"
    packages: tuple[LockedPackage, ...]
    store: Path
    wheelhouse: Path | None = None
    ca_bundle: Path | None = None


class WriteContext(Frozen):
    """Sync the SKU's build-context folder with the rendered files and the gathered wheels (held under a lock)."""

    kind: Literal["context"] = "context"
    folder: Path


class RunBuildKit(Frozen):
    """`docker build` the context, untagged; the context's lock is released when it ends."""

    kind: Literal["buildkit"] = "buildkit"
    build_args: dict[str, str]
    secrets: dict[str, Path] = Field(default_factory=dict)
    no_cache: bool = False
    ca_given: bool = Field(False, description="An extra CA bundle was given (else a TLS failure's hint asks for one)")
    export_stage: str | None = Field(None, description="A source-built engine's wheel stage, exported after the build "
                                                       "(from BuildKit's cache) for the host's record")
    store: Path | None = Field(None, description="The wheel store the exported wheel is put into (with export_stage)")
    cache_from: str | None = Field(None, description="A registry reference whose inline cache BuildKit reuses")


class FetchResult(Frozen):
    """Pull the image a build of exactly these inputs pushed to the registry cache; on a hit the steps that make an image
    are skipped. A miss, or an image whose labels, config or first layer are not what this render and lock give,
    builds; so does a hit that fails a later step (the build then pushes its own image over it)."""

    kind: Literal["fetch"] = "fetch"
    reference: str = Field(description="The result reference (`result_reference`)")
    labels: dict[str, str] = Field(description="Every label the image must carry, no more (`imageconfig.labels_of`)")
    config: ImageConfig = Field(description="The config the image must have before it runs (`imageconfig.config_of`)")
    base_diff_id: str = Field(description="The bootstrapped base's layer: the image's first layer")


class ExportCache(Frozen):
    """Push the registry cache after a verified build (see the module doc): the rewritten layers with BuildKit's inline
    cache to `reference`, the built image to `result`; the local tags go. A push that fails costs the next build time."""

    kind: Literal["cache"] = "cache"
    reference: str
    result: str | None = Field(None, description="The result reference (None where no build fetches one)")


class Normalise(Frozen):
    """Rewrite BuildKit's image so one lock gives one image id (builder/reproducible.py); BuildKit's image goes."""

    kind: Literal["normalise"] = "normalise"
    epoch: int = Field(description="SOURCE_DATE_EPOCH (reproducible.IMAGE_EPOCH)")
    inline_cache: bool = Field(False, description="Also load the cache image (the rewritten layers under BuildKit's "
                                                  "inline cache) for ExportCache")


class VerifyInstalled(Frozen):
    """The image's own Python must report exactly the locked distributions."""

    kind: Literal["verify"] = "verify"
    locked: dict[str, str] = Field(description="Canonical name -> version, from the lock")


class TagImage(Frozen):
    """Tag the verified image with its content-addressed tag."""

    kind: Literal["tag"] = "tag"
    tag: str


class RecordBuiltWheel(Frozen):
    """Record the wheel a source-built engine's build stage made (builder/sourcebuild.py), for the gate's pins check."""

    kind: Literal["built"] = "built"
    folder: Path


class WriteRecord(Frozen):
    """Write the build record `<folder>/<sku>.json`."""

    kind: Literal["record"] = "record"
    folder: Path


BuildStep = (FetchResult | EnsureBase | GatherWheels | WriteContext | RunBuildKit | ExportCache | Normalise
             | VerifyInstalled | TagImage | RecordBuiltWheel | WriteRecord)
# The steps a FetchResult hit skips: those that make the image, and pushing the cache it came from
SKIPPED_ON_FETCH = frozenset({"wheels", "base", "context", "buildkit", "normalise", "cache"})
MAX_TAG = 128
RESULT_KEY_HEX = 32  # hex digits of build_inputs_key in a result reference's tag (128 bits)
_CACHE_REF = re.compile(r"^[^@\s]+/[^@\s:/]+(?:/[^@\s:/]+)*:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def build_inputs_key(rendered: RenderedDockerfile, *, build_args: Mapping[str, str], lock: Lock) -> str:
    """sha256 of everything a build's image is made from: the rewrite's format, the Dockerfile, every context file, every
    wheel's sha256, the build arguments (the lock's hash among them) and the lock's base. Builds with one key give one
    image (reproducible by construction), so the registry cache may hand one build's image to another."""
    payload = {
        "layers": LAYER_FORMAT, "dockerfile": rendered.text,
        "files": {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in sorted(rendered.files.items())},
        "wheels": rendered.wheels, "args": {k: v for k, v in sorted(build_args.items()) if k != "BUILDKIT_INLINE_CACHE"},
        "base": lock.base.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_cache_reference(cache: str) -> None:
    """BuildError unless `cache` is host/repository:tag (a tag, no digest: the cache is rewritten by every build)."""
    if not _CACHE_REF.fullmatch(cache):
        raise BuildError(f"--cache {cache[:200]!r}: not a registry reference with a tag and no digest; fix: name one "
                         "such as ghcr.io/acme/skupin-staging/cpu-x86_64:buildcache")


def result_reference(cache: str, key: str) -> str:
    """Where the registry cache `cache` (host/repository:tag) keeps the image of a build whose inputs hash to `key`: the
    same repository, its tag + "-" + 32 hex digits of the key."""
    check_cache_reference(cache)
    repo, _, tag = cache.rpartition(":")
    return f"{repo}:{tag[:MAX_TAG - RESULT_KEY_HEX - 1]}-{key[:RESULT_KEY_HEX]}"


def locked_stack(rendered: RenderedDockerfile) -> tuple[ResolvedStack, Lock]:
    """The stack `rendered` came from and its current lock; LockError (BuildError for a bare render) otherwise."""
    stack = rendered.stack
    if stack is None:
        raise BuildError(f"the Dockerfile of {rendered.sku} was rendered from a bare manifest, not a resolved stack; "
                         "fix: build render(resolve(path))")
    lock = stack.current_lock
    if lock is None or not rendered.locked:
        raise LockError(f"{stack.manifest_path}: cannot build from a lock that is {stack.lock_state} ({stack.lock_note})")
    return stack, lock


def plan_build(rendered: RenderedDockerfile, *, wheelhouse: Path | None = None, ca_bundle: Path | None = None,
               no_cache: bool = False, records: Path | None = None, wheel_store: Path | None = None,
               contexts: Path | None = None, bases: Path | None = None, built: Path | None = None,
               cache: str | None = None) -> tuple[BuildStep, ...]:
    """Every step of the build of `rendered`, decided before anything runs (pure: no Docker, network or files).

    `rendered` must come from a stack whose lock is current (LockError otherwise: the image would not
    be what its lock says). Without `records` no build record is written. With `cache` (host/repository:tag; BuildError
    otherwise) the build first looks for its inputs' image there, reuses the reference's inline cache and pushes both
    there after it is verified (the registry cache of runners without local state: see the module doc).
    """
    stack, lock = locked_stack(rendered)
    manifest = stack.manifest
    secrets = {CA_SECRET_ID: ca_bundle} if ca_bundle is not None and f"id={CA_SECRET_ID}" in rendered.text else {}
    from_source = bool(lock.sources())
    build_args = {"SKUPIN_BASE": manifest.base.reference, "SKUPIN_LOCK_HASH": lock.content_hash(),
                  DOCKERFILE_ARG: rendered.sha256}
    if cache:
        build_args["BUILDKIT_INLINE_CACHE"] = "1"
    result = result_reference(cache, build_inputs_key(rendered, build_args=build_args, lock=lock)) if cache else ""
    base_diff_id = lock.base.diff_id if lock.base.kind == "bootstrap" else None
    # with a registry cache, the image of these very inputs when it holds one; not for a source-built engine (its build
    # records the wheel it built, which only a build makes), nor a registry base (its config and labels are the base
    # image's, not known before it is pulled), nor with no_cache (that asks for a build)
    fetch = bool(cache) and not no_cache and not from_source and base_diff_id is not None
    steps: list[BuildStep] = [
        *([FetchResult(reference=result, base_diff_id=base_diff_id or "", labels=labels_of(rendered.text, build_args),
                       config=config_of(rendered.text, ImageConfig()))] if fetch else []),
        # the wheels before the base: a missing or mismatched one refuses the build before debootstrap or a base pull
        GatherWheels(packages=(*lock.packages().values(), *lock.build), store=wheel_store or default_wheel_store(),
                     wheelhouse=wheelhouse, ca_bundle=ca_bundle),
        EnsureBase(manifest=manifest, bases=bases or bases_dir(), locked=lock.base),
        WriteContext(folder=(contexts or state_dir() / "contexts") / manifest.name),
        RunBuildKit(build_args=build_args, secrets=secrets, no_cache=no_cache, ca_given=ca_bundle is not None,
                    export_stage=ENGINE_WHEEL_STAGE if from_source else None,
                    store=(wheel_store or default_wheel_store()) if from_source else None, cache_from=cache),
        Normalise(epoch=IMAGE_EPOCH, inline_cache=bool(cache)),
        VerifyInstalled(locked=locked_versions(lock)),
        TagImage(tag=sku_image_tag(manifest, lock=lock, dockerfile_sha256=rendered.sha256)),
        # only a verified image is cached; the image itself only where a build can fetch it
        *([ExportCache(reference=cache, result=result if fetch else None)] if cache else []),
    ]
    if from_source:
        steps.append(RecordBuiltWheel(folder=built or built_dir()))
    if records is not None:
        steps.append(WriteRecord(folder=records))
    return tuple(steps)


# ---------------------------------------------------------------- the executor


@dataclass
class _Execution:
    """What the steps of one build have made so far (the executor's bookkeeping; the result is the BuiltImage)."""

    rendered: RenderedDockerfile
    stack: ResolvedStack
    lock: Lock
    docker: Docker
    progress: Progress
    on_line: OnLine
    started: float
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # the context folder's lock
    base_id: str = ""
    wheels: dict[str, Path] = field(default_factory=dict)
    context: Path | None = None
    lines: list[str] = field(default_factory=list)
    image_id: str = ""
    steps: list[_Step] = field(default_factory=list)
    installed: dict[str, str] = field(default_factory=dict)
    image: ImageInfo | None = None
    tag: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    built: BuiltImage | None = None
    built_wheel: BuiltWheel | None = None
    exported: Path | None = None  # the source-built engine's exported wheel stage (a temporary folder)
    normalised: NormalisedImage | None = None
    cache: str | None = None
    fetched: str = ""  # FetchResult's hit: repository@manifest digest of the image it pulled
    fetched_tag: str = ""  # the reference it pulled (a local tag until TagImage)

    def result(self) -> BuiltImage:
        """The BuiltImage of a tagged build (made once: the record and the caller get the same object)."""
        if self.built is None:
            self.built = self._make()
        return self.built

    def _make(self) -> BuiltImage:
        info = self.image
        if info is None:
            raise BuildError(f"the build plan of {self.stack.manifest.name} ends before the image was tagged")
        return BuiltImage(
            sku=self.stack.manifest.name, image=self.tag, image_id=info.id, tags=info.tags, labels=info.labels,
            base_id=self.base_id, lock_sha256=self.lock.content_hash(), dockerfile_sha256=self.rendered.sha256,
            layers=layer_timings(self.steps),
            steps=tuple(StepTiming(number=s.number, name=s.name[:200], layer=s.layer, seconds=s.seconds, cached=s.cached)
                        for s in self.steps),
            cache_hits=sum(1 for s in self.steps if s.cached), total_s=round(time.monotonic() - self.started, 2),
            phases=dict(self.phases), size_bytes=info.size, installed=self.installed,
            created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), stack=self.stack,
            builder=f"docker {self.docker.ping()}", reproducible=self.normalised, cache=self.cache,
            fetched=self.fetched or None)


def _ensure_base(step: EnsureBase, run: _Execution) -> None:
    run.base_id = ensure_base(manifest=step.manifest, docker=run.docker, on_event=run.on_line, bases=step.bases)
    if step.locked is not None and step.locked.kind == "bootstrap":
        info = run.docker.inspect_image(run.base_id)
        check_locked_base(locked=step.locked, layers=tuple(info.layers) if info else (), sku=step.manifest.name)


def _gather_wheels(step: GatherWheels, run: _Execution) -> None:
    run.wheels = fetch_wheels(step.packages, store=step.store, wheelhouse=step.wheelhouse, ca_bundle=step.ca_bundle,
                              on_event=run.on_line)


def _write_context(step: WriteContext, run: _Execution) -> None:
    folder = run.held.enter_context(_context_folder(step.folder, on_line=run.on_line))
    run.context = write_context(rendered=run.rendered, out=folder, wheels=run.wheels, prune=True)


def _run_buildkit(step: RunBuildKit, run: _Execution) -> None:
    context = run.context
    if context is None:
        raise BuildError("the build plan runs BuildKit before it wrote the build context")
    sink = _sink(progress=run.progress, on_line=run.on_line, dockerfile=run.rendered.text, lines=run.lines)
    try:
        run.image_id = run.docker.build(context=context, dockerfile=context / "Dockerfile", build_args=step.build_args,
                                        secrets=step.secrets or None, no_cache=step.no_cache, on_line=sink,
                                        cache_from=step.cache_from)
        run.steps = parse_progress(run.lines, dockerfile=run.rendered.text)
        if step.export_stage:
            # the same context and arguments: every step is in BuildKit's cache, only the wheel stage's files come out
            out = Path(run.held.enter_context(tempfile.TemporaryDirectory(prefix="skupin-built-")))
            run.docker.build(context=context, dockerfile=context / "Dockerfile", build_args=step.build_args,
                             secrets=step.secrets or None, on_line=lambda _: None, target=step.export_stage,
                             output_dir=out)
            run.built_wheel = export_wheel(out, lock=run.lock, image_id=run.image_id, store=step.store or default_wheel_store())
    except BuildError as exc:
        raise _failure(exc, lines=run.lines, dockerfile=run.rendered.text, ca_given=step.ca_given) from exc
    finally:
        run.held.close()  # the context folder is free for the next build of this SKU


def _fetch_result(step: FetchResult, run: _Execution) -> None:
    run.on_line(f"looking for the image of these inputs in the registry cache: {step.reference}")
    try:
        image_id = run.docker.pull(step.reference, hint=False)
    except DockerError as exc:  # a miss (the usual "manifest unknown"), or a registry that does not answer
        run.on_line(f"none to reuse ({str(exc).splitlines()[0][:300]}); building")
        return
    try:
        info = run.docker.inspect_image(image_id)
        wrong = _not_these_inputs(step, info, run.docker)
    except DockerError as exc:
        info, wrong = None, [f"it could not be inspected: {str(exc).splitlines()[0][:200]}"]
    if info is None or wrong:
        run.on_line(f"{step.reference} is not the image of these inputs ({'; '.join(wrong)[:600]}); building")
        with contextlib.suppress(DockerError):
            run.docker.remove_image(step.reference)
        _remove_if_untagged(run.docker, image_id)  # not left behind either
        return
    repo = step.reference.rpartition(":")[0]
    pinned = next((d for d in info.repo_digests if d.startswith(f"{repo}@")), step.reference)
    run.on_line(f"reusing {image_id[:19]} ({pinned}) from the registry cache: nothing to build")
    # no account of a rewrite (reproducible stays None): nothing here built or rewrote it; the record names its source
    run.image_id, run.fetched, run.fetched_tag = image_id, pinned, step.reference


def _not_these_inputs(step: FetchResult, info: ImageInfo | None, docker: Docker) -> list[str]:
    """What of a pulled image is not what this render, lock and base give (checked before the image ever runs)."""
    if info is None:
        return ["the engine does not show the pulled image"]
    wrong = [f"label {k}: {str(info.labels.get(k))[:80]!r}, not {str(v)[:80]!r}"
             for k, v in sorted(step.labels.items()) if info.labels.get(k) != v]
    wrong += [f"label {k[:80]!r} the render does not set" for k in sorted(set(info.labels) - set(step.labels))]
    found = ImageConfig.from_engine(docker.image_config(info.id))
    wrong += [f"config {name} differs" for name in ImageConfig.model_fields if getattr(found, name) != getattr(step.config, name)]
    if info.layers[:1] != (step.base_diff_id,):
        wrong.append(f"its first layer is not the locked base's {step.base_diff_id[:19]}")
    return wrong


def _export_cache(step: ExportCache, run: _Execution) -> None:
    made = run.normalised
    pushes = [(step.result, run.image_id)] if step.result else []  # the image itself, for a build of the same inputs
    if made is not None and made.cache_image_id is not None:
        pushes.insert(0, (step.reference, made.cache_image_id))  # the rewritten layers under BuildKit's inline cache
    else:
        run.on_line("no cache image (BuildKit's image carried no inline cache, or loading it failed): "
                    f"{step.reference} is not refreshed")
    try:
        for reference, image in pushes:
            run.docker.tag(image, reference)
            run.on_line(f"pushing {reference} (the registry cache)")
            run.docker.push(reference, on_event=run.on_line)  # the second: the same layers, only a config and manifest
    except DockerError as exc:  # a cache that could not be stored costs the next build time, not this one its image
        run.on_line(f"the registry cache was not stored: {exc}")
    else:
        run.cache = step.reference if made is not None and made.cache_image_id is not None else None
    finally:
        for reference, _ in pushes:
            with contextlib.suppress(DockerError):
                run.docker.remove_image(reference)  # the cache image's only tag (it goes), the image's second one
        if made is not None and made.cache_image_id is not None:
            _remove_if_untagged(run.docker, made.cache_image_id)


def _remove_if_untagged(docker: Docker, image: str) -> None:
    with contextlib.suppress(DockerError):
        info = docker.inspect_image(image)
        if info is not None and not info.tags:
            docker.remove_image(image)


def _normalise(step: Normalise, run: _Execution) -> None:
    base = run.docker.inspect_image(run.base_id) if run.base_id else None
    made = normalise_image(run.docker, run.image_id, epoch=step.epoch, base_layers=base.layers if base else (),
                           on_event=run.on_line, inline_cache=step.inline_cache)
    run.on_line(f"normalised {made.source_id[:19]} -> {made.image_id[:19]} ({made.rewritten_layers} layers rewritten, "
                f"{made.unchanged_layers} rewritten already, {made.kept_layers} of the base kept, {made.seconds}s)")
    if made.image_id != made.source_id:
        with contextlib.suppress(DockerError):  # BuildKit's image: its layers stay in BuildKit's cache, not twice on disk
            run.docker.remove_image(made.source_id)
    run.image_id, run.normalised = made.image_id, made


def _verify_installed(step: VerifyInstalled, run: _Execution) -> None:
    run.installed = installed_distributions(docker=run.docker, image=run.image_id)
    problems = compare_installed(installed=run.installed, locked=step.locked)
    if problems:
        raise BuildError(
            f"image {run.image_id[:19]} of {run.stack.manifest.name} does not contain its locked set "
            f"({len(problems)} difference(s)); not tagged:\n" + "\n".join(problems[:40])
        )


def _tag_image(step: TagImage, run: _Execution) -> None:
    run.docker.tag(run.image_id, step.tag)
    info = run.docker.inspect_image(step.tag)
    if info is None:
        raise DockerError(f"tagged {run.image_id} as {step.tag} but the engine does not show it")
    if run.fetched_tag:
        with contextlib.suppress(DockerError):  # the pull's tag: the image keeps its version tag
            run.docker.remove_image(run.fetched_tag)
        info = run.docker.inspect_image(step.tag) or info
    run.image, run.tag = info, step.tag


def _record_built_wheel(step: RecordBuiltWheel, run: _Execution) -> None:
    if run.built_wheel is None:
        raise BuildError("the build plan records a built wheel, but BuildKit exported none")
    write_built(run.built_wheel, folder=step.folder)
    run.on_line(f"recorded the engine wheel built from {run.built_wheel.sdist.filename}: "
                f"{run.built_wheel.wheel.filename} sha256 {run.built_wheel.wheel.sha256[:12]}")


def _run_step(step: BuildStep, run: _Execution) -> None:
    """Run one step of a plan."""
    match step:
        case FetchResult():
            _fetch_result(step, run)
        case EnsureBase():
            _ensure_base(step, run)
        case GatherWheels():
            _gather_wheels(step, run)
        case WriteContext():
            _write_context(step, run)
        case RunBuildKit():
            _run_buildkit(step, run)
        case ExportCache():
            _export_cache(step, run)
        case Normalise():
            _normalise(step, run)
        case VerifyInstalled():
            _verify_installed(step, run)
        case TagImage():
            _tag_image(step, run)
        case RecordBuiltWheel():
            _record_built_wheel(step, run)
        case WriteRecord():
            write_record(built=run.result(), folder=step.folder)


def execute_build(steps: tuple[BuildStep, ...], *, rendered: RenderedDockerfile, docker: Docker,
                  progress: Progress = "plain", on_line: OnLine = _quiet) -> BuiltImage:
    """Run a plan of `plan_build` in order (each step but the record timed as a phase); the tagged BuiltImage."""
    stack, lock = locked_stack(rendered)
    run = _Execution(rendered=rendered, stack=stack, lock=lock, docker=docker, progress=progress, on_line=on_line,
                     started=time.monotonic())
    failed = ""
    with run.held:
        try:
            for step in steps:
                if run.fetched and step.kind in SKIPPED_ON_FETCH:
                    continue
                start = time.monotonic()
                _run_step(step, run)
                if step.kind != "record":
                    run.phases[step.kind] = round(time.monotonic() - start, 3)
        except (BuildError, DockerError) as exc:
            _drop_untagged(run)
            if not run.fetched:
                raise
            failed = str(exc).splitlines()[0][:300]
        except BaseException:
            _drop_untagged(run)
            raise
    if failed:  # the registry cache's image failed a check: build, and the build's own image replaces it in the cache
        on_line(f"the image from the registry cache failed: {failed}; building")
        return execute_build(tuple(s for s in steps if s.kind != "fetch"), rendered=rendered, docker=docker,
                             progress=progress, on_line=on_line)
    return run.result()


def _drop_untagged(run: _Execution) -> None:
    """After a failed step: the pulled registry-cache tag goes, then the images this build made or pulled that carry no
    tag (BuildKit's, the rewritten one, the cache image, the pulled one), so a failure leaves no dangling image behind.
    An image with a tag (the same id as one built before) stays."""
    if run.fetched_tag:
        with contextlib.suppress(DockerError):
            run.docker.remove_image(run.fetched_tag)
    normalised = run.normalised
    made = {run.image_id, *((normalised.source_id, normalised.cache_image_id or "") if normalised else ())}
    for image in sorted(made - {""}):
        _remove_if_untagged(run.docker, image)


def build(rendered: RenderedDockerfile, docker: Docker, *, wheelhouse: Path | None = None,
          ca_bundle: Path | None = None, progress: Progress = "plain", on_line: OnLine = _quiet, no_cache: bool = False,
          records: Path | None = None, wheel_store: Path | None = None, cache: str | None = None) -> BuiltImage:
    """The build stage: plan the build of a locked render (`plan_build`), then run the plan; see the module doc."""
    steps = plan_build(rendered, wheelhouse=wheelhouse, ca_bundle=ca_bundle, no_cache=no_cache, records=records,
                       wheel_store=wheel_store, cache=cache)
    if ca_bundle is not None and not ca_bundle.is_file():
        raise BuildError(f"--ca-bundle {ca_bundle}: no such file")
    return execute_build(steps, rendered=rendered, docker=docker, progress=progress, on_line=on_line)


@contextlib.contextmanager
def _context_folder(folder: Path, *, on_line: OnLine) -> Iterator[Path]:
    """The SKU's build-context folder under an exclusive lock (held from writing the context to the end of BuildKit)."""
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
