"""Render a SKU's Dockerfile and its build-context files from templates (skupin.common.paths.templates_dir), without Docker."""

from __future__ import annotations

import functools
import hashlib
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import installer
import jinja2
from packaging.utils import canonicalize_name

from skupin import imagetools
from skupin.builder.catalog.compat import load_compat
from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.builder.catalog.lockfile import PY_LAYERS, Lock, LockedPackage
from skupin.builder.catalog.manifest import GitSource, Pin, SdistSource, SkuManifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.builder.reproducible import IMAGE_EPOCH, LAYER_FORMAT
from skupin.common import __version__
from skupin.common.errors import BuildError
from skupin.common.model import Frozen
from skupin.common.paths import templates_dir
from skupin.engines import serve_launch

WHEELS_DIR = "wheels"
BUILD_STAGE = "build"  # lock.system's key for the apt packages of a source-built engine's build stage
# The image's Python environment (gates/integrity/static.py checks it file by file).
VENV = "/opt/skupin/venv"
REQUIREMENTS_DIR = "requirements"
# Python files whose bytecode a pip step does not compile at build time (a regex for grep -P
# over installed paths): per-architecture model modules that an engine imports only for the
# model it serves. transformers keeps ~2,600 of its ~2,900 modules under models/<arch>/; compiling
# them was ~8 s of CPU in every point-release rebuild, while a container compiles the one
# architecture it loads in memory (docs/BENCHMARKS.md). models/auto, imported on every start,
# stays compiled. Engines whose registry imports every model module at start (SGLang walks
# sglang/srt/models) must not be listed here.
LAZY_BYTECODE = r"/site-packages/transformers/models/(?!auto/)[^/]+/"
# The in-build tools, written into every build context under tools/ and bind-mounted into each
# pip step (never shipped): the bytecode compiler, the locked-step installer, and the pure-Python
# package of pypa `installer` that the latter uses (the host's copy, pinned in pyproject.toml).
TOOLS_DIR = "tools"
# A source-built engine (stack.engine.source kind sdist): its build stage, the stage that holds only the
# wheel it makes (what the builder exports and records), the build stage's venv, the context folders of
# the sdist and of the build stage's wheels, and the image's record of the built wheel's requirement line.
ENGINE_BUILD_STAGE = "skupin-engine-build"
ENGINE_WHEEL_STAGE = "skupin-engine-wheel"
BUILD_VENV = "/opt/skupin/build-venv"
SDIST_DIR = f"{WHEELS_DIR}/engine-sdist"
BUILD_STEP = "build"
BUILT_REQUIREMENTS = f"{REQUIREMENTS_DIR}/engine-built.txt"
BYTECODE_TOOL = Path(imagetools.__file__).with_name("bytecode.py")
INSTALL_TOOL = Path(imagetools.__file__).with_name("wheel_install.py")


@functools.cache
def _tools() -> dict[str, str]:
    """Context path -> text of every tool file, read once per process."""

    files = {f"{TOOLS_DIR}/{tool.name}": tool.read_text(encoding="utf-8") for tool in (BYTECODE_TOOL, INSTALL_TOOL)}
    package = Path(installer.__file__).parent
    for path in sorted(package.rglob("*.py")):  # not the Windows launchers (_scripts/*.exe)
        files[f"{TOOLS_DIR}/installer/{path.relative_to(package).as_posix()}"] = path.read_text(encoding="utf-8")
    return files


@functools.cache
def _tools_info() -> dict[str, str]:

    digest = hashlib.sha256()
    for rel, text in sorted(_tools().items()):
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return {"folder": TOOLS_DIR, "bytecode": BYTECODE_TOOL.name, "install": INSTALL_TOOL.name, "lazy": LAZY_BYTECODE,
            "installer": installer.__version__, "sha256": digest.hexdigest()}


class PipStep(Frozen):
    """One RUN step of a Python layer: a requirements file and, when locked, the folder of its wheels."""

    requirements: str  # context path of the requirements file
    wheels: str | None = None  # context folder bound at build time


class PipLayer(Frozen):
    """What one Python layer installs and from where (the template turns it into RUN lines)."""

    name: str
    steps: tuple[PipStep, ...] = ()  # dependencies first (their own cache step), then the pin
    wheels: str | None = None  # unlocked: a wheelhouse folder pip may take files from
    index: str
    extra_indexes: tuple[str, ...] = ()
    locked: bool
    git: GitSource | None = None


class RenderedDockerfile(Frozen):
    """The Dockerfile text, its hash, the files of its build context, and the stack it was rendered from."""

    sku: str
    text: str
    sha256: str
    files: dict[str, str]  # context-relative path -> text content
    wheels: dict[str, dict[str, str]]  # context folder (wheels/<step>) -> {wheel file name: sha256} it must hold
    locked: bool
    stack: ResolvedStack | None = None  # None for a bare manifest (`render_manifest`): such a render is never built


def _escape_dq(value: str) -> str:
    """Escape a value for a double-quoted Dockerfile string (LABEL/ENV)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")


def _environment() -> jinja2.Environment:
    return _environment_for(templates_dir())


@functools.cache
def _environment_for(folder: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(folder)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # Dockerfiles, not HTML; values are grammar-checked
    )
    env.filters["dq"] = _escape_dq
    env.globals["tools"] = _tools_info()
    return env


def _pin_requirement(pin: Pin) -> str:
    extras = f"[{','.join(pin.extras)}]" if pin.extras else ""
    return f"{pin.distribution}{extras}=={pin.version}"


def _layer_pins(manifest: SkuManifest) -> dict[str, list[Pin]]:
    stack = manifest.stack
    return {
        "framework": [stack.framework] if stack.framework.is_python else [],
        "compiler": [stack.compiler] if stack.compiler.is_python else [],
        "engine": [stack.engine] if stack.engine.is_python else [],
        "extras": [],
    }


def _index_of(manifest: SkuManifest, layer: str) -> tuple[str, tuple[str, ...]]:
    """Primary index for a layer (its pin's source) and PyPI-style extras for its dependencies."""
    if layer == "extras":
        return manifest.extras.index, ()
    pin = manifest.stack.pins()[layer]
    src = pin.source
    primary = getattr(src, "url", None) if src.kind == "index" else getattr(src, "index", None)
    primary = primary or manifest.extras.index
    extras = () if primary == manifest.extras.index else (manifest.extras.index,)
    return primary, extras


def _locked_layer(lock: Lock, layer: str) -> tuple[LockedPackage, ...]:
    """The packages the lock puts in `layer` (none when it names no such layer)."""
    return next((packages for name, packages in lock.layers.items() if name == layer), ())


def _plan(manifest: SkuManifest, lock: Lock | None) -> tuple[list[PipLayer], dict[str, str], dict[str, dict[str, str]]]:
    pins = _layer_pins(manifest)
    layers: list[PipLayer] = []
    files: dict[str, str] = dict(_tools())
    wheels: dict[str, dict[str, str]] = {}
    for name in PY_LAYERS:
        git = next((p.source for p in pins[name] if isinstance(p.source, GitSource)), None)
        steps = []
        if lock is not None:
            pkgs = sorted((p for p in _locked_layer(lock, name) if p.source != "sdist"), key=lambda p: p.name.lower())
            # The pin itself gets its own step after its dependencies, so a point release of the
            # pin that keeps its dependencies rebuilds only that small step (and the ones above);
            # each step binds only its own wheels, so its cache key does not see the others'.
            own = {canonicalize_name(p.distribution) for p in pins[name]}
            mine = [p for p in pkgs if canonicalize_name(p.name) in own]
            deps = [p for p in pkgs if canonicalize_name(p.name) not in own]
            if not mine:
                mine, deps = deps, []
            for stem, group in ((f"{name}-deps", deps), (name, mine)):
                if group:
                    files[f"{REQUIREMENTS_DIR}/{stem}.txt"] = "".join(f"{p.requirement()}\n" for p in group)
                    wheels[f"{WHEELS_DIR}/{stem}"] = {p.filename: p.sha256 for p in group}
                    steps.append(PipStep(requirements=f"{REQUIREMENTS_DIR}/{stem}.txt", wheels=f"{WHEELS_DIR}/{stem}"))
        else:
            lines = [_pin_requirement(p) for p in pins[name] if not isinstance(p.source, GitSource)]
            if name == "extras":
                lines = [f"{p.name}=={p.version}" for p in manifest.extras.python]
            if lines:
                files[f"{REQUIREMENTS_DIR}/{name}.txt"] = "\n".join(lines) + "\n"
                steps.append(PipStep(requirements=f"{REQUIREMENTS_DIR}/{name}.txt"))
        unlocked_wheels = None
        if lock is None and any(p.source.kind == "wheelhouse" for p in pins[name]):
            unlocked_wheels = f"{WHEELS_DIR}/{name}"
            wheels[unlocked_wheels] = {}
        index, extra = _index_of(manifest, name)
        layers.append(
            PipLayer(
                name=name, steps=tuple(steps), wheels=unlocked_wheels, index=index, extra_indexes=extra,
                locked=lock is not None, git=git if lock is None else None,
            )
        )
    if lock is not None and manifest.stack.engine.is_sdist:
        sdists = list(lock.sources().values())
        if len(sdists) != 1 or not lock.build:
            raise BuildError(f"the lock of {manifest.name} records {len(sdists)} engine sdist(s) and "
                             f"{len(lock.build)} build wheel(s); fix: skupin lock {manifest.name}")
        wheels[SDIST_DIR] = {sdists[0].filename: sdists[0].sha256}
        build = sorted(lock.build, key=lambda p: p.name.lower())
        files[f"{REQUIREMENTS_DIR}/{BUILD_STEP}.txt"] = "".join(f"{p.requirement()}\n" for p in build)
        wheels[f"{WHEELS_DIR}/{BUILD_STEP}"] = {p.filename: p.sha256 for p in build}
    return layers, files, wheels


_LAYER = re.compile(r"^# layer: ([a-z-]+)")
_APT_INSTALL = re.compile(r"(apt-get\s+install\s+)([^&|;\n]*)")


def apt_roots(dockerfile: str) -> dict[str, tuple[str, ...]]:
    """layer -> what its RUN lines `apt-get install` (name, or name=version as written), per `# layer:` section of a
    rendered Dockerfile; the build stage's (`# layer: engine-build`) under BUILD_STAGE."""
    out: dict[str, list[str]] = {}
    layer = "base"
    for line in dockerfile.replace("\\\n", " ").splitlines():
        if found := _LAYER.match(line):
            layer = BUILD_STAGE if found.group(1) == "engine-build" else found.group(1)
            continue
        if not line.startswith("RUN "):
            continue
        for match in _APT_INSTALL.finditer(line):
            for item in match.group(2).split():
                if not item.startswith("-") and item not in out.setdefault(layer, []):
                    out[layer].append(item)
    return {k: tuple(v) for k, v in out.items() if v}


APT_WRAP = 116  # the width of a closure's continuation lines in a locked render


def pin_apt(text: str, system: Mapping[str, tuple[str, ...]], *, sku: str,
            closure: Mapping[str, tuple[str, ...]] | None = None) -> str:
    """`text` with every package its RUN lines apt-install written name=version from the lock's `system` (each
    layer's own entries, then any layer's); BuildError naming those the lock has no version of. With the lock's apt
    `closure`, a layer's first apt-get install also names, on continuation lines, every other package of the layer's
    closure (its dependencies) as name=version, so apt takes nothing the lock does not say."""
    versions: dict[str, dict[str, str]] = {
        layer: dict(item.partition("=")[::2] for item in items) for layer, items in system.items()}
    anywhere = {name: v for layer in versions.values() for name, v in layer.items()}
    missing: list[str] = []
    closed: set[str] = set()  # layers whose closure is written
    layer = "base"
    out = []
    for line in text.splitlines(keepends=True):
        if found := _LAYER.match(line):
            layer = BUILD_STAGE if found.group(1) == "engine-build" else found.group(1)

        def pin(match: re.Match[str], layer: str = layer) -> str:
            words = []
            for item in match.group(2).split(" "):
                name = item.partition("=")[0]
                if item and not item.startswith("-") and item.rstrip("\\").strip():
                    version = versions.get(layer, {}).get(name) or anywhere.get(name)
                    if version is None:
                        missing.append(f"{name} ({layer} layer)")
                    else:
                        item = f"{name}={version}"
                words.append(item)
            if closure is None or layer in closed:
                return match.group(1) + " ".join(words)
            closed.add(layer)
            return match.group(1) + _with_closure(words, closure.get(layer, ()))

        out.append(_APT_INSTALL.sub(pin, line))
    if missing:
        raise BuildError(f"the lock of {sku} records no version of the apt package(s) {', '.join(missing)} the "
                         f"Dockerfile installs; fix: skupin lock {sku}")
    return "".join(out)


def _with_closure(words: list[str], closure: tuple[str, ...]) -> str:
    """An apt-get install's words followed by the packages of `closure` they do not name, wrapped on continuation
    lines before the line's own continuation (if it has one)."""
    tail = ""
    if words and words[-1] == "\\":
        words, tail = words[:-1], " \\"
    while words and not words[-1]:
        words = words[:-1]
    named = {w.partition("=")[0] for w in words}
    rows: list[list[str]] = []
    for item in closure:
        if item.partition("=")[0] in named:
            continue
        if not rows or len(" ".join([*rows[-1], item])) > APT_WRAP:
            rows.append([])
        rows[-1].append(item)
    return " ".join(words) + "".join(" \\\n    " + " ".join(row) for row in rows) + tail


def engine_build(manifest: SkuManifest, lock: Lock | None) -> dict[str, object] | None:
    """What the templates need to build a source-built engine in its own stage; None for an engine from a wheel."""
    pin = manifest.stack.engine
    src, compiler = pin.source, manifest.stack.compiler.source
    if not isinstance(src, SdistSource):
        return None
    if compiler.kind != "apt":  # the manifest's validator refuses this; a render never guesses a compiler
        raise BuildError(f"{manifest.name}: stack.engine.source kind sdist needs the compiler pin from apt")
    gcc = compiler.package.removeprefix("g++-")
    sdist = next(iter(lock.sources().values()), None) if lock is not None else None
    extras = f"[{','.join(pin.extras)}]" if pin.extras else ""
    return {
        "stage": ENGINE_BUILD_STAGE, "export_stage": ENGINE_WHEEL_STAGE, "venv": BUILD_VENV,
        "name": pin.distribution, "version": pin.version, "requirement": f"{pin.distribution}{extras}=={pin.version}",
        "index": src.index, "gcc": gcc,
        "apt": [f"{compiler.package}={compiler.version}" if compiler.version else compiler.package,
                *(f"{p.name}={p.version}" for p in src.build_packages)],
        "cmake_args": " ".join(src.cmake_args),
        "sdist": {"filename": sdist.filename, "sha256": sdist.sha256} if sdist is not None else None,
        "sdist_folder": SDIST_DIR, "wheels": f"{WHEELS_DIR}/{BUILD_STEP}",
        "requirements": f"{REQUIREMENTS_DIR}/{BUILD_STEP}.txt", "built_requirements": BUILT_REQUIREMENTS,
    }


def cuda_series(manifest: SkuManifest) -> str | None:
    """The CUDA series of the torch wheel's variant (cu130 -> "13.0", builder/data/compat.yaml `variants`), or None for a
    variant of no CUDA series (cpu, rocm*, xpu) or none at all."""
    variant = manifest.stack.framework.variant
    row = load_compat().variant(variant) if variant else None
    return row.series if row is not None and row.family == "cuda" else None


def render(stack: ResolvedStack) -> RenderedDockerfile:
    """The render stage: the stack's Dockerfile and context, from its lock when that lock is current (else the pins)."""
    rendered = render_manifest(manifest=stack.manifest, lock=stack.current_lock)
    return rendered.model_copy(update={"stack": stack})


def render_manifest(*, manifest: SkuManifest, lock: Lock | None = None) -> RenderedDockerfile:
    """Render a manifest's Dockerfile; with a lock each layer installs exactly its locked set.

    Without a lock this is the pins-only render (`skupin render --unlocked`); the locked render's hash goes into the
    image tag with the lock's (builder/catalog/lockfile.py: image_tag).
    """
    layers, files, wheels = _plan(manifest, lock)
    context = {
        "sku": manifest,
        "pins": manifest.stack.pins(),
        "python": manifest.base.python,
        "base_ref": manifest.base.reference,
        "locked": lock is not None,
        "layers": {layer.name: layer for layer in layers},
        "system_extras": [
            f"{p.name}={p.version}" if p.version else p.name for p in manifest.extras.system
        ],
        "env": sorted(manifest.runtime.env.items()),
        "venv": VENV,
        "serve": serve_launch(manifest=manifest),
        "engine_build": engine_build(manifest, lock),
        "tool_version": __version__,
        "layer_format": LAYER_FORMAT,  # a new rewrite makes new image ids: it makes a new Dockerfile hash, a new tag
        # OCI labels from the lock, never the wall clock (the same lock, the same label); the catalog's git revision
        # and source are not labels (every commit would make a new image): docs/CATALOG.md
        "created": lock.created if lock is not None else None,
        "source_date_epoch": IMAGE_EPOCH,  # not the lock's time: a step's output is a function of its inputs alone
        "base_digest": manifest.base.image.rsplit("@", 1)[1] if manifest.base.image else None,
        "base_diff_id": lock.base.diff_id if lock is not None else None,
        "cuda_series": cuda_series(manifest),
    }
    name = ALL_FAMILIES[manifest.base.family].template
    try:
        text = _environment().get_template(name).render(**context)
    except jinja2.TemplateError as exc:
        raise BuildError(f"{templates_dir() / name}: cannot render: {exc}") from exc
    text = "\n".join(line.rstrip() for line in text.strip().splitlines()) + "\n"
    if lock is not None and lock.apt_sources is not None:  # a lock that resolved every apt package's version
        text = pin_apt(text, lock.system, sku=manifest.name, closure=lock.apt_closure)
    return RenderedDockerfile(
        sku=manifest.name,
        text=text,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        files=files,
        wheels=wheels,
        locked=lock is not None,
    )


def write_context(*, rendered: RenderedDockerfile, out: Path, wheels: Mapping[str, Path] | None = None,
                  prune: bool = False) -> Path:
    """Write Dockerfile, requirement and tool files and each step's wheels into `out`.

    `wheels` maps sha256 -> a file holding it (the wheel store, `builder.wheels.fetch_wheels`).
    Unchanged files are left alone (same content, same mtime) and wheels are hard links where the
    filesystem allows, so a build context kept between builds (see `build_image`) is re-sent to
    BuildKit only where it changed: the 190 MB torch wheel is transferred once, not per build.
    With `prune`, everything in `out` that the rendered context does not name is removed (only
    for folders this tool owns). Every wheel is checked before anything is written.
    """
    wanted: dict[Path, str | Path] = {Path("Dockerfile"): rendered.text}
    wanted.update({Path(rel): content for rel, content in rendered.files.items()})
    missing = []
    for folder, names in rendered.wheels.items():
        if not names:
            wanted[Path(folder) / ".keep"] = ""
        for name, sha in names.items():
            stored = (wheels or {}).get(sha)
            if stored is None or not stored.is_file():
                missing.append(f"{folder}/{name}")
                continue
            wanted[Path(folder) / name] = stored
    if missing:
        raise BuildError(f"{len(missing)} locked wheel(s) not gathered for the context: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else "") + "; fix: fetch them first (builder.wheels.fetch_wheels)")
    out.mkdir(parents=True, exist_ok=True)
    if prune:
        _prune(out, keep=set(wanted))
    for rel, source in wanted.items():
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            _link_wheel(source, dest)
        elif not dest.is_file() or dest.read_text(encoding="utf-8") != source:
            dest.write_text(source, encoding="utf-8")
    return out


def _link_wheel(source: Path, dest: Path) -> None:
    src = source.stat()
    if dest.is_file():
        have = dest.stat()
        if (have.st_ino, have.st_dev) == (src.st_ino, src.st_dev) or (
            have.st_size == src.st_size and have.st_mtime_ns == src.st_mtime_ns
        ):
            return
        dest.unlink()
    try:
        dest.hardlink_to(source)
    except OSError:
        shutil.copy2(source, dest)


def _prune(out: Path, *, keep: set[Path]) -> None:
    """Remove files and folders under `out` that are not in `keep` (nor parents of it)."""
    parents = {parent for rel in keep for parent in rel.parents}
    for path in sorted(out.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        rel = path.relative_to(out)
        if rel in keep or rel in parents:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
