"""Render a SKU's Dockerfile and its build-context files from templates/, without a Docker daemon."""

from __future__ import annotations

import functools
import hashlib
import shutil
from pathlib import Path

import jinja2

from builder import __version__
from builder.errors import BuildError
from builder.grammar import URL_RE
from builder.lockfile import PY_LAYERS, Lock, LockedPackage
from builder.manifest import GitSource, Pin, SkuManifest
from builder.model import Frozen
from builder.paths import TEMPLATES

WHEELS_DIR = "wheels"
REQUIREMENTS_DIR = "requirements"


class PipLayer(Frozen):
    """What one Python layer installs and from where (the template turns it into RUN lines)."""

    name: str
    deps_requirements: str | None = None  # locked dependencies of the layer's pin, installed first (own cache step)
    requirements: str | None = None  # context path of the requirements file, None if nothing to install
    wheels: str | None = None  # context folder bound at build time (wheelhouse files of this layer)
    index: str
    extra_indexes: tuple[str, ...] = ()
    locked: bool
    git: GitSource | None = None


class RenderedDockerfile(Frozen):
    """The Dockerfile text, its hash, and the files that go into its build context."""

    sku: str
    text: str
    sha256: str
    files: dict[str, str]  # context-relative path -> text content
    wheels: dict[str, tuple[str, ...]]  # context folder (wheels/<layer>) -> wheel file names from the wheelhouse
    locked: bool


def _escape_dq(value: str) -> str:
    """Escape a value for a double-quoted Dockerfile string (LABEL/ENV)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - Dockerfiles, not HTML; values are grammar-checked
    )
    env.filters["dq"] = _escape_dq
    return env


def _requirement(pkg: LockedPackage) -> str:
    if pkg.url and pkg.source != "wheelhouse" and URL_RE.fullmatch(pkg.url.split("#")[0]):
        return f"{pkg.name} @ {pkg.url.split('#')[0]} --hash=sha256:{pkg.sha256}"
    return pkg.requirement()


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


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


def _plan(manifest: SkuManifest, lock: Lock | None) -> tuple[list[PipLayer], dict[str, str], dict[str, tuple[str, ...]]]:
    pins = _layer_pins(manifest)
    layers: list[PipLayer] = []
    files: dict[str, str] = {}
    wheels: dict[str, tuple[str, ...]] = {}
    for name in PY_LAYERS:
        git = next((p.source for p in pins[name] if isinstance(p.source, GitSource)), None)
        deps: list[str] = []
        if lock is not None:
            pkgs = sorted(lock.layers.get(name, ()), key=lambda p: p.name.lower())
            # The pin itself gets its own step after its dependencies, so a point release of the
            # pin that keeps its dependencies rebuilds only that small step (and the ones above).
            own = {_norm(p.distribution) for p in pins[name]}
            lines = [_requirement(p) for p in pkgs if _norm(p.name) in own]
            deps = [_requirement(p) for p in pkgs if _norm(p.name) not in own]
            if not lines:
                lines, deps = deps, []
            local = tuple(sorted(p.filename for p in pkgs if p.source == "wheelhouse"))
        else:
            lines = [_pin_requirement(p) for p in pins[name] if not isinstance(p.source, GitSource)]
            if name == "extras":
                lines = [f"{p.name}=={p.version}" for p in manifest.extras.python]
            local = ()
        uses_wheelhouse = any(p.source.kind == "wheelhouse" for p in pins[name])
        req_path = f"{REQUIREMENTS_DIR}/{name}.txt" if lines else None
        if req_path:
            files[req_path] = "\n".join(lines) + "\n"
        deps_path = f"{REQUIREMENTS_DIR}/{name}-deps.txt" if deps else None
        if deps_path:
            files[deps_path] = "\n".join(deps) + "\n"
        wheel_dir = f"{WHEELS_DIR}/{name}" if (local or uses_wheelhouse) else None
        if wheel_dir:
            wheels[wheel_dir] = local
        index, extra = _index_of(manifest, name)
        layers.append(
            PipLayer(
                name=name, requirements=req_path, deps_requirements=deps_path, wheels=wheel_dir, index=index,
                extra_indexes=extra, locked=lock is not None, git=git if lock is None else None,
            )
        )
    return layers, files, wheels


def base_reference(manifest: SkuManifest) -> str:
    """The FROM reference: the pinned image, or the local tag of the bootstrap recipe."""
    if manifest.base.image:
        return manifest.base.image
    assert manifest.base.bootstrap is not None  # guaranteed by Base's validator
    return manifest.base.bootstrap.local_tag()


def render(*, manifest: SkuManifest, lock: Lock | None = None) -> RenderedDockerfile:
    """Render the Dockerfile of a SKU; with a lock each layer installs exactly its locked set."""
    layers, files, wheels = _plan(manifest, lock)
    context = {
        "sku": manifest,
        "pins": manifest.stack.pins(),
        "python": manifest.base.python,
        "base_ref": base_reference(manifest),
        "locked": lock is not None,
        "layers": {layer.name: layer for layer in layers},
        "system_extras": [
            f"{p.name}={p.version}" if p.version else p.name for p in manifest.extras.system
        ],
        "env": sorted(manifest.runtime.env.items()),
        "tool_version": __version__,
    }
    try:
        template = _environment().get_template(f"{manifest.base.family}.Dockerfile.j2")
        text = template.render(**context)
    except jinja2.TemplateError as exc:
        raise BuildError(f"templates/{manifest.base.family}.Dockerfile.j2: cannot render: {exc}") from exc
    text = "\n".join(line.rstrip() for line in text.strip().splitlines()) + "\n"
    return RenderedDockerfile(
        sku=manifest.name,
        text=text,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        files=files,
        wheels=wheels,
        locked=lock is not None,
    )


def write_context(*, rendered: RenderedDockerfile, out: Path, wheelhouse: Path | None = None) -> Path:
    """Write Dockerfile, requirement files and the layer's wheelhouse wheels into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "Dockerfile").write_text(rendered.text, encoding="utf-8")
    for rel, content in rendered.files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    for folder, names in rendered.wheels.items():
        target = out / folder
        target.mkdir(parents=True, exist_ok=True)
        (target / ".keep").write_text("", encoding="utf-8")
        for name in names:
            if wheelhouse is None or not (wheelhouse / name).is_file():
                where = wheelhouse or "(no --wheelhouse given)"
                raise BuildError(f"wheel {name} of {folder} is locked from a wheelhouse but not in {where}; "
                                 "fix: pass --wheelhouse DIR holding it")
            dest = target / name
            if not dest.exists():
                try:
                    dest.hardlink_to(wheelhouse / name)
                except OSError:
                    shutil.copy2(wheelhouse / name, dest)
    return out
