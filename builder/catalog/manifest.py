"""The SKU manifest: a frozen pydantic model of skus/*.yaml and the loader that reports every problem."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from packaging.utils import canonicalize_name
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from skupin.builder.catalog.families import ALL_FAMILIES, Family, Vendor, sdist_families
from skupin.builder.catalog.grammar import (
    DebName,
    DebVersion,
    EnvName,
    GitRef,
    ImageRef,
    MemSize,
    Name,
    Pep440,
    SafeValue,
    Sha256,
    Text,
    Url,
    has_control_chars,
)
from skupin.common.errors import ManifestError, Problem
from skupin.common.model import Frozen, canonical_json
from skupin.common.paths import PYPI_SIMPLE
from skupin.common.suggest import did_you_mean
from skupin.common.untrusted import printable

SCHEMA_VERSION = 1
PYPI = PYPI_SIMPLE


# Base of every manifest object: immutable, unknown keys rejected.
Model = Frozen


# ---------------------------------------------------------------- accelerator and base


class Accelerator(Model):
    """What the image runs on."""

    vendor: Vendor
    device: SafeValue = Field(description="Marketing name, e.g. H200, MI355X, x86_64 CPU")
    arch: Name = Field(description="ISA the kernels are built for: sm_90, gfx942, gfx950, xe-hpc, x86_64")
    hardware_class: Name = Field(description="Tolerance class the gate calibrates per, e.g. nvidia-hopper")
    count: int = Field(1, ge=1, le=64, description="Devices per node")


GitCommit = Annotated[str, Field(pattern=r"^[0-9a-f]{40}$")]
KeyringPath = Annotated[str, Field(pattern=r"^/[A-Za-z0-9._+/-]{1,200}\.(gpg|asc)$")]


class Bootstrap(Model):
    """A base image made locally with debootstrap, for air-gapped builders."""

    tool: Literal["debootstrap"] = "debootstrap"
    suite: Name = Field(description="Debian suite, e.g. bookworm")
    variant: Literal["minbase", "buildd"] = "minbase"
    mirror: Url = Field("http://deb.debian.org/debian", description=(
        "The archive debootstrap reads (http is fine: its signed Release file is verified against `keyring`). "
        "For exact versions across time, a snapshot: http://snapshot.debian.org/archive/debian/20261201T000000Z"))
    include: tuple[Name, ...] = Field((), description="Extra packages debootstrap installs")
    keyring: KeyringPath = Field(
        "/usr/share/keyrings/debian-archive-keyring.gpg",
        description="The keyring debootstrap verifies the archive's Release signature with (--force-check-gpg); "
                    "Debian's debian-archive-keyring package installs it")
    layout: Literal["sorted-clamped/1"] = Field(
        "sorted-clamped/1", description="How the tree becomes the base's one layer (builder/base.py): files sorted by "
        "name, mtimes clamped to SOURCE_DATE_EPOCH, logs, caches and host files dropped; part of the recipe's hash")

    def recipe_sha256(self) -> str:
        """sha256 of the recipe's canonical JSON: the same recipe names the same local base."""

        return hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()

    def local_tag(self) -> str:
        """The local image tag `skupin base` gives this recipe, e.g. skupin-base/debian-bookworm-minbase:1a2b3c4d5e6f."""
        return f"skupin-base/debian-{self.suite}-{self.variant}:{self.recipe_sha256()[:12]}"


class Base(Model):
    """Where the image starts: a registry image pinned by digest, or a local bootstrap recipe."""

    family: Family = Field(description="Selects templates/<family>.Dockerfile.j2")
    image: ImageRef | None = None
    bootstrap: Bootstrap | None = None
    os: Name = Field(description="Distribution of the base, e.g. debian-12, ubuntu-24.04")
    python: Annotated[str, Field(pattern=r"^3\.[0-9]{1,2}$")] = Field(description="Python of the image, e.g. 3.12")
    platform: Literal["linux/amd64", "linux/arm64"] = "linux/amd64"

    @model_validator(mode="after")
    def _one_origin(self) -> Base:
        if (self.image is None) == (self.bootstrap is None):
            raise ValueError("give exactly one of base.image (pinned by digest) or base.bootstrap")
        return self

    @property
    def reference(self) -> str:
        """What the Dockerfile's FROM uses: the pinned image, or the bootstrap recipe's local tag."""
        return self.image if self.image is not None else self.bootstrap.local_tag()  # type: ignore[union-attr]


# ---------------------------------------------------------------- where a pin comes from


class IndexSource(Model):
    """A PEP 503/691 package index (PyPI or a vendor's wheel index)."""

    kind: Literal["index"]
    url: Url = PYPI


class WheelhouseSource(Model):
    """A local folder of wheels passed at build time (--wheelhouse), preferred over the index."""

    kind: Literal["wheelhouse"]
    index: Url = Field(PYPI, description="Where the rest of the layer's packages come from")
    url: Url | None = Field(
        None, description="The pinned wheel's own home, a folder of wheels (e.g. https://download.pytorch.org/whl/cpu): "
        "the lock records <url>/<file name> with the file's sha256, so a builder without the wheelhouse downloads it "
        "and refuses a file that does not hash to the lock's sha256; the wheelhouse wins when it holds the file")


class WheelUrlSource(Model):
    """One wheel at a fixed URL with its hash."""

    kind: Literal["url"]
    url: Url
    sha256: Sha256


class GitSource(Model):
    """Built from source at a git ref (e.g. vLLM on ROCm)."""

    kind: Literal["git"]
    repo: Url
    ref: GitRef
    commit: GitCommit | None = Field(
        None, description="The commit `ref` names (40 hex): the build clones the ref and refuses any other commit "
                          "(a tag can be moved); without it the render marks the layer UNPINNED")


class AptSource(Model):
    """A distribution package installed with apt."""

    kind: Literal["apt"]
    package: DebName
    version: DebVersion | None = None


class BuildPackage(Model):
    """A Debian package the build stage of a source-built engine installs, at an exact version."""

    name: DebName
    version: DebVersion


CMakeArg = Annotated[str, Field(pattern=r"^-D[A-Za-z_][A-Za-z0-9_]{0,63}=[A-Za-z0-9_.,;+-]{0,128}$")]


class SdistSource(Model):
    """The engine built from its source distribution inside the image (a build stage), for engines with no wheel.

    The lock records the sdist (URL and sha256 from the index), the wheels that build it (its
    build-system requirements) and the wheels it needs to run; the build stage installs the apt
    compiler pin and `build_packages`, builds a wheel from the hashed sdist offline and the served
    image installs only that wheel (docs/GATE.md: how the gate verifies its files).
    """

    kind: Literal["sdist"]
    index: Url = Field(PYPI, description="The index the sdist and its build and run requirements come from")
    build_packages: tuple[BuildPackage, ...] = Field(
        (), description="Debian packages of the build stage beside the compiler pin (cmake, make), exact versions")
    cmake_args: tuple[CMakeArg, ...] = Field(
        (), max_length=32, description="CMAKE_ARGS of the build, -DNAME=VALUE each (e.g. -DGGML_NATIVE=OFF)")

    @model_validator(mode="after")
    def _unique_packages(self) -> SdistSource:
        names = [p.name for p in self.build_packages]
        if len(set(names)) != len(names):
            raise ValueError("build_packages names a package twice")
        return self


class BaseImageSource(Model):
    """Comes with the base image (e.g. ROCm userspace in rocm/dev-ubuntu)."""

    kind: Literal["base"]


class HostSource(Model):
    """Provided by the host at run time (the kernel driver); checked by the gate, never installed."""

    kind: Literal["host"]


class NoSource(Model):
    """The pin does not apply to this SKU."""

    kind: Literal["none"]


Source = Annotated[
    IndexSource | WheelhouseSource | WheelUrlSource | GitSource | SdistSource | AptSource | BaseImageSource | HostSource
    | NoSource,
    Field(discriminator="kind"),
]


class Pin(Model):
    """One of the four pinned components: name, exact version and where it comes from."""

    name: Name = Field(description="Component name, or 'none' when it does not apply")
    version: Annotated[str, Field(pattern=r"^(none|[0-9][A-Za-z0-9.+!-]{0,63})$")] = Field(
        description="Exact version, or 'none'"
    )
    source: Source
    package: Name | None = Field(None, description="Python distribution name when it differs from name")
    variant: Name | None = Field(None, description="Accelerator build of the wheel: cpu, cu130, rocm7.2, xpu")
    extras: tuple[Name, ...] = Field((), description="Python extras, e.g. [serving]")
    reason: Text | None = Field(None, description="Why the pin is 'none' (required then)")

    @model_validator(mode="after")
    def _none_is_explicit(self) -> Pin:
        if self.name == "none":
            if self.version != "none" or self.source.kind != "none" or not self.reason:
                raise ValueError("a pin named 'none' needs version: none, source: {kind: none} and a reason")
        elif self.version == "none":
            raise ValueError(f"pin {self.name!r} needs an exact version (or name: none with a reason)")
        return self

    @property
    def distribution(self) -> str:
        """The Python distribution name installed for this pin."""
        return self.package or self.name

    @property
    def is_python(self) -> bool:
        """True when pip installs this pin."""
        return self.source.kind in ("index", "wheelhouse", "url", "git")

    @property
    def is_sdist(self) -> bool:
        """True when the pin is built from its source distribution inside the image (stack.engine only)."""
        return self.source.kind == "sdist"


class Omission(Model):
    """A declared requirement of a locked distribution that the image leaves out, and why."""

    name: Name = Field(description="The distribution left out (as Requires-Dist names it)")
    reason: Text = Field(min_length=10, description="Why the image is right without it (checked by nobody else)")


class Stack(Model):
    """The four pins that move together."""

    driver: Pin
    framework: Pin
    compiler: Pin
    engine: Pin
    omit: tuple[Omission, ...] = Field(
        (), description="Requirements of locked distributions left out of the image, each with its reason; "
                        "the lock records them and the gate's pins check accepts exactly these")

    @model_validator(mode="after")
    def _omissions_are_not_pins(self) -> Stack:
        pinned = {canonicalize_name(p.distribution) for p in self.pins().values() if p.name != "none"}
        names = [canonicalize_name(o.name) for o in self.omit]
        for name in names:
            if name in pinned:
                raise ValueError(f"omit names {name}, which is one of the four pins")
        if len(set(names)) != len(names):
            raise ValueError("omit names a distribution twice")
        return self

    @model_validator(mode="after")
    def _sdist_is_the_engine(self) -> Stack:
        for layer, pin in self.pins().items():
            if pin.is_sdist and layer != "engine":
                raise ValueError(f"stack.{layer}.source: kind sdist (built from source in the image) is for the "
                                 "engine only")
        if self.engine.is_sdist and self.compiler.source.kind != "apt":
            raise ValueError("stack.engine.source: kind sdist is built with the compiler pin, which must then come "
                             "from apt (stack.compiler.source: {kind: apt, package: g++-12, version: ...})")
        return self

    def pins(self) -> dict[str, Pin]:
        return {"driver": self.driver, "framework": self.framework, "compiler": self.compiler, "engine": self.engine}


class Package(Model):
    """An extra package at an exact version."""

    name: Name
    version: Pep440


class SystemPackage(Model):
    """An extra distribution package (apt), optionally at an exact version."""

    name: DebName
    version: DebVersion | None = None


class Extras(Model):
    """Packages beyond the four pins."""

    python: tuple[Package, ...] = ()
    system: tuple[SystemPackage, ...] = ()
    index: Url = PYPI


# Variables that decide what code the interpreter, the dynamic linker or a compiler cache loads: set in an image, each
# could make production import or link code the gate never saw (a path the sandbox hides, or files no lock owns).
STEERING_PREFIXES = ("LD_", "DYLD_", "PYTHON")
STEERING_NAMES = frozenset({"HOME", "BASH_ENV", "ENV", "PERL5LIB", "PERLLIB", "RUBYLIB", "NODE_OPTIONS", "NODE_PATH",
                            "GCONV_PATH", "HF_HOME", "HF_MODULES_CACHE", "XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR",
                            "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "TORCH_HOME"})
# PYTHON* variables that only change output buffering, encodings, hashing or bytecode writing, never what is imported.
HARMLESS_PYTHON = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "PYTHONIOENCODING",
                             "PYTHONUTF8", "PYTHONFAULTHANDLER", "PYTHONNOUSERSITE", "PYTHONSAFEPATH"})
STEERING_WHY = "import paths, preloaded or searched libraries, start-up files, caches of compiled code"


def steers_loading(name: str) -> bool:
    """Whether environment variable `name` can change which code a process of the image loads."""
    if name in HARMLESS_PYTHON:
        return False
    return name in STEERING_NAMES or name.startswith(STEERING_PREFIXES)


class Runtime(Model):
    """What a container of this image needs to run."""

    gpus: Literal["all", "none"] = "none"
    devices: tuple[Annotated[str, Field(pattern=r"^/dev/[A-Za-z0-9/_-]+$")], ...] = ()
    group_add: tuple[Name, ...] = ()
    shm_size: MemSize = "1g"
    ipc: Literal["private", "host"] = "private"
    env: dict[EnvName, SafeValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _no_loader_steering(self) -> Runtime:
        for name in self.env:
            if steers_loading(name):
                raise ValueError(f"env {name}: steers what code the image loads ({STEERING_WHY}), so the gate could "
                                 "not vouch for what production runs; fix: install what it points at as a locked "
                                 "package (extras.python) and drop the variable")
        return self


class ServeGate(Model):
    """The serve check's settings: load levels and the bound on a runtime regression vs a baseline image."""

    concurrency: tuple[Annotated[int, Field(ge=1, le=4096)], ...] = Field(
        (1, 2, 4), min_length=1, max_length=16, description="Concurrent requests per load level")
    max_decode_regression: float | None = Field(
        None, gt=0, lt=1, description="Fail when decode tok/s drops by more than this fraction vs the baseline image")
    primary_kpi: Literal["decode", "prefill", "aggregate", "ttft_p50"] = Field(
        "decode", description="The KPI `skupin ab` judges per slice (prompt length x concurrency) when this SKU is the "
        "candidate: a slice worse beyond its 95% interval on it blocks a promote")


class Gate(Model):
    """How the gate checks images of this SKU."""

    reference: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$")] = Field(
        description="Reference bundle folder, relative to the repository root"
    )
    model: Name = Field(description="Model fixture name, e.g. tiny-llama")
    dtype: Literal["float32", "bfloat16", "float16"]
    batch_size: int = Field(8, ge=1, le=1024)
    tolerance_class: Name
    tolerance_per_engine: bool = Field(
        False, description="Key this SKU's tolerance entries to its engine too (class/dtype/model/engine), as every "
        "accelerator SKU's are. On a CPU class the engine-free entry holds for every engine whose honest noise it "
        "admits (gates/data/evidence/); a SKU whose engine's it does not (vLLM's CPU router at bfloat16 rounds its "
        "top-k weights, which transformers' bounds reject) sets this and is calibrated with its own engine")
    checks: tuple[Literal["boot", "kernels", "model", "serve"], ...] = ("boot", "kernels", "model", "serve")
    reduced_precision: tuple[Literal["tf32"], ...] = Field(
        (), description="Reduced-precision float32 arithmetic the SKU's engine is allowed: tf32 (TF32 tensor-core "
        "products, e.g. torch.backends.cuda.matmul.allow_tf32). Undeclared, the op battery fails an image that uses it, "
        "naming it; declared, the float32 op bounds and the float32 pass's hard logprob bound allow TF32's rounding")
    bit_exact: bool = False
    deadline_s: int = Field(900, ge=10, le=86400)
    memory: MemSize = "8g"
    cpus: float | None = Field(None, gt=0, le=4096, description="CPUs each gate container may use "
                                                                "(default: the host's CPUs - 0.5, at least 1)")
    serve: ServeGate | None = Field(None, description="Serve check settings (gates/serving/serve.py); default ServeGate()")
    weights: Literal["full", "q8_0"] = Field(
        "full", description="Which weights the engine runs: full (the fixture at the gate dtype; for a GGUF engine "
                            "such as llamacpp the f32 GGUF for float32, bf16 for bfloat16) or q8_0 (a Q8_0-quantized "
                            "GGUF, a different model version that the model check is expected to fail against the "
                            "full-precision reference); an engine that loads the fixture folder takes only full")


UpdateLevel = Literal["none", "patch", "minor", "major"]


class UpdatePolicy(Model):
    """Which releases CI may take for each pin: none, patch (x.y.Z), minor (x.Y) or major."""

    driver: UpdateLevel
    framework: UpdateLevel
    compiler: UpdateLevel
    engine: UpdateLevel


class Cost(Model):
    """What one device of this SKU costs, for cost-per-token reports."""

    hourly_usd: float = Field(gt=0, le=1000, description="On-demand price of one device-hour, USD")
    utilisation: float = Field(0.6, gt=0, le=1, description="Assumed busy fraction for cost per token")


class SkuManifest(Model):
    """One SKU: accelerator, base, four pins, extras, runtime, gate, update policy and cost."""

    schema_version: Literal[1] = Field(description="Manifest schema version")
    name: Name
    description: Text = ""
    accelerator: Accelerator
    base: Base
    stack: Stack
    extras: Extras = Extras()
    runtime: Runtime = Runtime()
    gate: Gate
    update_policy: UpdatePolicy
    cost: Cost

    @model_validator(mode="after")
    def _omissions_are_not_extras(self) -> SkuManifest:
        pinned = {canonicalize_name(p.name) for p in self.extras.python}
        clash = sorted({str(canonicalize_name(o.name)) for o in self.stack.omit} & pinned)
        if clash:
            raise ValueError(f"stack.omit names {', '.join(clash)}, which extras.python pins: leave it out or pin it")
        if self.stack.engine.is_sdist and not ALL_FAMILIES[self.base.family].builds_sdist:
            able = sdist_families()
            raise ValueError(f"stack.engine.source: kind sdist is built by the {' or '.join(able)} family's template "
                             f"only, not {self.base.family}'s "
                             f"({', '.join(f'templates/{name}.Dockerfile.j2' for name in able)})")
        return self


# ---------------------------------------------------------------- loading with every problem named


def display_path(path: Path) -> str:
    """`path` relative to the working folder when it lies below it (for messages), else as given."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top)"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class whose fields live at `loc` (for 'did you mean')."""
    cls: Any = SkuManifest
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(str(part)) if hasattr(cls, "model_fields") else None
        if field is None:
            return None
        cls = _first_model(field.annotation)
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _first_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _problem(file: str, err: ErrorDetails) -> Problem:
    """One pydantic error as a skupin problem: the dotted field, a message in our words and always a fix (with a
    did-you-mean where the value is one of a known set)."""
    raw = err["loc"]
    # pydantic inserts the discriminator tag after `source` (source.index.url); drop only those.
    loc = tuple(p for i, p in enumerate(raw) if not (i and raw[i - 1] == "source" and p in _SOURCE_TAGS))
    field = _dotted(loc)
    kind = err["type"]
    ctx: dict[str, Any] = dict(err.get("ctx") or {})
    value = err.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        known = list(parent.model_fields) if parent else []
        fix = did_you_mean(str(loc[-1]), known) or f"remove it (known keys: {', '.join(known)})"
        return Problem(file, field, "unknown key", fix)
    if kind == "missing":
        return Problem(file, field, "required key is missing", f"add it{_described(loc)} (see `skupin schema`)")
    if kind in ("literal_error", "enum"):
        choices = _quoted(str(ctx.get("expected", ""))) or [str(ctx.get("expected", ""))]
        return Problem(file, field, f"{value!r} is not one of {ctx.get('expected')}",
                       did_you_mean(str(value), choices) or f"set {field} to one of: {', '.join(choices)}")
    if kind == "union_tag_invalid":
        choices = _quoted(str(ctx.get("expected_tags", "")))
        tag = ctx.get("tag")
        return Problem(file, f"{field}.kind", f"{tag!r} is not a kind of source (known: {', '.join(choices)})",
                       did_you_mean(str(tag), choices) or f"set {field}.kind to one of: {', '.join(choices)}")
    if kind == "union_tag_not_found":
        choices = list(_SOURCE_TAGS)
        return Problem(file, f"{field}.kind", "required key is missing",
                       f"add kind: one of {', '.join(sorted(choices))}")
    if kind in _BOUNDS:
        return Problem(file, field, f"{value!r} is not {_BOUNDS[kind]} {ctx.get(_BOUND_KEYS[kind])}",
                       _fix_for(kind, field, ctx, loc))
    if kind == "string_pattern_mismatch":
        return Problem(file, field, f"{value!r} should match pattern {ctx.get('pattern')}", _fix_for(kind, field, ctx, loc))
    if kind in _TYPES:
        what, fix = _TYPES[kind]
        return Problem(file, field, f"{value!r} is not {what}", f"{fix}{_described(loc)}")
    message = err["msg"].removeprefix("Value error, ")
    if value is not None and not isinstance(value, (dict, list)) and repr(value) not in message:
        message += f" (got {value!r})"
    return Problem(file, field, message, _fix_for(kind, field, ctx, loc))


# pydantic's type errors of scalar fields: (what the value is not, the fix)
_TYPES = {
    "int_type": ("an integer", "write a whole number, e.g. 8"),
    "int_parsing": ("an integer", "write a whole number, e.g. 8"),
    "int_from_float": ("an integer", "write a whole number, e.g. 8"),
    "float_type": ("a number", "write a number, e.g. 0.5"),
    "float_parsing": ("a number", "write a number, e.g. 0.5"),
    "bool_type": ("true or false", "write true or false"),
    "bool_parsing": ("true or false", "write true or false"),
    "string_type": ("a string", "write a string (quoted in YAML when it looks like a number, e.g. \"3.11\")"),
}


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_BOUND_KEYS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def _fix_for(kind: str, field: str, ctx: dict[str, Any], loc: tuple[Any, ...]) -> str:
    """The fix for a pydantic error that is no choice among known values."""
    if kind in _BOUNDS:
        return f"set {field} to a value {_BOUNDS[kind]} {ctx.get(_BOUND_KEYS[kind])}{_described(loc)}"
    if kind == "string_pattern_mismatch":
        return f"write {field} to match {ctx.get('pattern')}{_described(loc)}"
    if kind in ("too_short", "too_long", "string_too_short", "string_too_long"):
        return f"give {field} {'more' if 'short' in kind else 'fewer'} items or characters{_described(loc)}"
    if kind.startswith(("dict_", "list_", "tuple_", "model_", "dataclass_")):
        return f"give {field} the shape `skupin schema` names (a mapping or a list){_described(loc)}"
    if kind == "value_error":
        return f"write {field} as the message says{_described(loc)}"
    return f"correct {field}{_described(loc)} (see `skupin schema`)"


def _described(loc: tuple[Any, ...]) -> str:
    """': <the field's description>' from the manifest model, or '' when it has none."""
    names = [p for p in loc if not isinstance(p, int)]
    if not names:
        return ""
    parent = _model_at(tuple(names[:-1]))
    info = parent.model_fields.get(str(names[-1])) if parent is not None else None
    return f" ({info.description})" if info is not None and info.description else ""


def _quoted(text: str) -> list[str]:
    """The values of pydantic's "'a', 'b' or 'c'"."""
    return re.findall(r"'([^']*)'", text)


_SOURCE_TAGS = {"index", "wheelhouse", "url", "git", "sdist", "apt", "base", "host", "none"}


def _control_char_problems(file: str, data: Any, loc: tuple[Any, ...] = ()) -> list[Problem]:
    """Every string (key or value) that carries a newline or another control character."""
    found: list[Problem] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(key, str) and has_control_chars(key):
                found.append(Problem(file, _dotted(loc + (key,)), "key carries a control character", "remove it"))
            found += _control_char_problems(file, value, loc + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += _control_char_problems(file, value, loc + (i,))
    elif isinstance(data, str) and has_control_chars(data):
        found.append(
            Problem(file, _dotted(loc), "value carries a newline or control character", "write it on one line")
        )
    return found


_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: ~10x faster


class _UniqueKeyLoader(_SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


MAX_MANIFEST_BYTES = 256 * 1024  # the largest shipped manifest is ~4 KB


def _references(text: str, file: str) -> list[Problem]:
    """Anchors and aliases, refused before anything is built from the text: one alias can stand for a whole subtree,
    so a few hundred bytes of nested aliases expand to billions of nodes (a YAML "billion laughs"). A manifest has
    no use for them. Found by scanning tokens, which takes time linear in the text."""
    found: dict[int, Problem] = {}
    for token in yaml.scan(text, Loader=_SafeLoader):
        if isinstance(token, yaml.AliasToken | yaml.AnchorToken):
            line = token.start_mark.line + 1
            sign = "*" if isinstance(token, yaml.AliasToken) else "&"
            found.setdefault(line, Problem(file, f"(yaml) line {line}",
                                           f"{sign}{printable(str(token.value), 40)}: manifests take no anchors or "
                                           f"aliases", "write the value out where it is used"))
            if len(found) >= 5:
                break
    return list(found.values())


def parse_manifest(path: Path, *, keep_valid: bool = False) -> tuple[SkuManifest | None, list[Problem]]:
    """Parse one manifest; return it (or None) and every problem found, never raising. With `keep_valid`, a manifest
    that validates is returned even when the file has other problems (its name), so that `check` can report its
    compatibility problems in the same run."""
    file = display_path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            return None, [Problem(file, "(file)", f"larger than {MAX_MANIFEST_BYTES // 1024} KiB: not a manifest")]
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, [Problem(file, "(file)", f"cannot read: {printable(str(exc), 200)}")]
    try:
        references = _references(text, file)
        if references:
            return None, references
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # SafeLoader subclass
    except (yaml.YAMLError, RecursionError) as exc:
        why = " ".join(str(exc).split()) if isinstance(exc, yaml.YAMLError) else "nested too deeply"
        return None, [Problem(file, "(yaml)", printable(why, 300), "fix the YAML syntax")]
    if not isinstance(data, dict):
        return None, [Problem(file, "(top)", "a manifest is a YAML mapping", "see skus/cpu-x86_64.yaml")]
    problems = _control_char_problems(file, data)
    try:
        manifest = SkuManifest.model_validate(data)
    except ValidationError as exc:
        problems += [_problem(file, e) for e in exc.errors()]
        return None, _dedupe(problems)
    if manifest.name != path.stem:
        problems.append(Problem(file, "name", f"{manifest.name!r} differs from the file name", f"name: {path.stem}"))
    return (None if problems and not keep_valid else manifest), problems


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: dict[tuple[str, str, str], Problem] = {}
    for p in problems:
        seen.setdefault((p.file, p.field, p.message), p)
    return list(seen.values())


def load_manifest(path: Path) -> SkuManifest:
    """Load one manifest or raise ManifestError listing every problem."""
    manifest, problems = parse_manifest(path)
    if manifest is None:
        raise ManifestError(f"{display_path(path)}: invalid manifest", tuple(problems))
    return manifest


def manifest_schema() -> dict[str, Any]:
    """JSON Schema of a manifest, for editors (committed as skus/schema.json)."""
    schema = SkuManifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://skupin.dev/schema/sku-manifest-v1.json"
    return schema


# What the image is built from. Gate settings, cost and update policy are not build inputs, so
# changing them leaves the lock fresh; the description reaches only a label, which the lock's
# Dockerfile hash covers.
BUILD_INPUTS = ("schema_version", "name", "accelerator", "base", "stack", "extras", "runtime")


def manifest_digest(manifest: SkuManifest) -> str:
    """sha256 of the canonical JSON of the manifest's build inputs: comments and key order do not change it."""

    data = manifest.model_dump(mode="json", include=set(BUILD_INPUTS))
    if not manifest.stack.omit:  # a manifest without omissions keeps the digest it had before the field existed
        del data["stack"]["omit"]
    for pin in data["stack"].values():  # a wheelhouse source without a home URL keeps the digest it had before the field
        if isinstance(pin, dict) and isinstance(pin.get("source"), dict) and pin["source"].get("kind") == "wheelhouse" \
                and pin["source"].get("url") is None:
            pin["source"].pop("url", None)
    if manifest.gate.weights != "full":  # the weights name the file the image's CMD serves (skupin/engines/llamacpp.py)
        data["gate"] = {"weights": manifest.gate.weights}
    return hashlib.sha256(canonical_json(data)).hexdigest()
