"""Tolerances as data: per hardware class x dtype x model thresholds with their provenance (gates/data/tolerances.yaml).

An entry holds, for one key, a maximum scale-normalised error per kernel op, a per-prompt
threshold and an aggregate (mean over prompts) threshold per model statistic, the honest
per-prompt exceedance rate the binomial test assumes, and where all of it came from. Hard bounds
that need no calibration (any NaN/Inf, mean KL > 0.5, top-1 agreement < 80%, and in float32 the mean
logprob L2 above float32 noise) are global.
`merge_entry` is the only way an entry is written: it replaces the entry of its own key only and
refuses to touch any other class's.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from packaging.version import InvalidVersion, Version
from pydantic import Field, SerializerFunctionWrapHandler, ValidationError, model_serializer

from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.builder.catalog.grammar import Name
from skupin.builder.catalog.manifest import SkuManifest
from skupin.common.errors import BundleError, GateCouldNotRun
from skupin.common.files import write_atomic
from skupin.common.model import Frozen
from skupin.common.untrusted import UntrustedInputError, load_yaml, read_regular_file
from skupin.engines import engine_module_inputs
from skupin.gates.judge.compare import DECISION_STATS
from skupin.gates.refdata.bundle import bundle_sha256, float32_reference
from skupin.imagetools.probe import skupin_probe_ops as ops_spec

FORMAT = "skupin-tolerances/1"
DEFAULT_PATH = Path(__file__).parents[1] / "data" / "tolerances.yaml"  # gates/data/: the entries shipped with skupin
CATALOG_PATH = "gates/data/tolerances.yaml"  # a catalog's own entries, relative to its root
MAX_TOLERANCES_BYTES = 8 << 20  # the shipped file is ~25 KB


def catalog_tolerances() -> Path:
    """The tolerance file the gate reads: the catalog's gates/data/tolerances.yaml when it has one, else the shipped
    one (skupin/common/paths.py: data_path). `skupin calibrate` writes the catalog's (`writable_tolerances`)."""
    from skupin.common.paths import data_path

    return data_path(CATALOG_PATH)


def writable_tolerances() -> Path:
    """Where `skupin calibrate` writes: the catalog's gates/data/tolerances.yaml (started from the shipped entries when
    the catalog has none yet), never into the installed package."""
    from skupin.common.paths import catalog

    return catalog() / CATALOG_PATH
# A threshold is a finite positive number: `.inf` would let anything pass, `.nan` compares false with everything.
Threshold = Annotated[float, Field(gt=0, allow_inf_nan=False)]
ENGINE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ENGINE_VERSION = r"^[A-Za-z0-9][A-Za-z0-9.+!_-]{0,127}$"
Measured = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class HardBounds(Frozen):
    """Bounds that catch nonsense without any calibration."""

    max_mean_kl: float = Field(0.5, gt=0, allow_inf_nan=False,
                               description="Fail when the mean KL over prompts exceeds this")
    min_top1_agree: float = Field(0.8, gt=0, le=1, allow_inf_nan=False,
                                  description="Fail when top-1 agreement over all positions is lower")
    max_fp32_elementwise_error: float = Field(
        1e-4, gt=0, allow_inf_nan=False,
        description="Fail when a float32 elementwise op of the kernel battery (SiLU, softmax, RMSNorm) or "
        "the 4-bit dequantize is off by more than this, relative to the reference's max |value|; honest hardware "
        "lands near 1e-7 (float32 rounding), a kernel off by one part in 128 at 8e-3")
    max_fp32_mean_logprob_l2: float = Field(
        4e-5, gt=0, allow_inf_nan=False,
        description="Fail a float32 model run (the float32 pass, or a SKU that serves float32) whose mean over prompts "
        "of logprob_l2 exceeds this. Measured on the H200 (bench/results/calibration/h200-calibration.json): honest "
        "runs of every fixture at most 7.8e-6 (llama-1k), the smallest fault of the bench, an attention scale 1% "
        "off, at least 2.0e-4 (deep-llama): the bound sits at their geometric mean, 5x from each; float32 rounding does "
        "not hide a 1% kernel error the way bf16 does. It assumes float32 computed in float32 (no TF32/XF32)")


class ToleranceKey(Frozen):
    """What an entry applies to."""

    hardware_class: Name
    dtype: str = Field(pattern=r"^(float32|bfloat16|float16)$")
    model: Name
    engine: str = Field("", pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})?$", description=(
        "The engine whose honest runs the entry was calibrated from, on a class whose SKUs need an accelerator: there "
        "every engine brings its own kernels (attention, MoE, norms) and so its own honest noise, and an entry holds "
        "for that engine alone; also on a CPU class for a SKU that says gate.tolerance_per_engine. Empty on a CPU "
        "class otherwise: that entry holds for every engine not keyed per engine (its cross-engine evidence: "
        "docs/GATE.md, 'Engines and the tolerance key'). Left out of the key when empty"))

    @model_serializer(mode="wrap")
    def _without_empty_engine(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A key without an engine serialises as keys did before: the same entries' tolerance_sha256."""
        data = handler(self)
        if not self.engine:
            data.pop("engine", None)
        return data

    @classmethod
    def of(cls, manifest: SkuManifest, *, float32: bool = False) -> ToleranceKey:
        """The key of `manifest`'s gate: its hardware class, its gate dtype (float32 for the float32 pass of a SKU
        that serves another dtype), its model and, where its family needs an accelerator or its gate says
        `tolerance_per_engine`, its engine."""
        per_engine = ALL_FAMILIES[manifest.base.family].accelerated or manifest.gate.tolerance_per_engine
        return cls(hardware_class=manifest.accelerator.hardware_class,
                   dtype="float32" if float32 else manifest.gate.dtype, model=manifest.gate.model,
                   engine=manifest.stack.engine.name if per_engine else "")

    def label(self) -> str:
        base = f"{self.hardware_class}/{self.dtype}/{self.model}"
        return f"{base}/{self.engine}" if self.engine else base


class ModelThresholds(Frozen):
    """Per-prompt and aggregate thresholds of the model statistics and the binomial test's parameters."""

    per_prompt: dict[str, Threshold] = Field(description="Statistic -> per-prompt threshold (a prompt exceeds above it)")
    mean: dict[str, Threshold] = Field(description="Statistic -> threshold on the mean over all prompts")
    honest_rate: float = Field(gt=0, lt=1, allow_inf_nan=False,
                               description="Per-prompt exceedance rate of honest runs (upper bound)")
    alpha: float = Field(1e-3, gt=0, lt=0.5, allow_inf_nan=False,
                         description="Family-wise false-reject level of the binomial tests")
    omitted: dict[str, Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict, description="Decision statistic -> why the entry has no threshold for it (e.g. the "
        "honest runs had no final hidden states); the gate reports the reason. Left out of the entry when empty")
    mean_center: dict[str, Measured] = Field(
        default_factory=dict, description="Statistic -> the honest runs' pooled mean over prompts (the centre the mean "
        "bound narrows towards as a run has more prompts; mean_bound). Left out of the entry when empty")

    @model_serializer(mode="wrap")
    def _without_empty_optional(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """An entry that omits nothing and has no centres serialises as it did before those fields existed: the same
        YAML, the same canonical JSON and so the same tolerance_sha256 in signed attestations
        (skupin/publishing/attest.py)."""
        data = handler(self)
        for name in ("omitted", "mean_center"):
            if not getattr(self, name):
                data.pop(name, None)
        return data

    def mean_bound(self, stat: str, *, prompts: int, calibrated_prompts: int, floor: float = 0.0) -> float:
        """The bound on the mean of `stat` over a run of `prompts` prompts, from `mean[stat]` calibrated on runs of
        `calibrated_prompts`. The mean of n prompts scatters as 1/sqrt(n) about its centre, so the bound's distance
        from the centre scales by sqrt(calibrated_prompts / prompts): wider for fewer prompts (an honest 8-prompt run
        is not rejected for its noise), narrower for more, so detection never gets worse as prompts are added. An
        entry without a centre (calibrated before centres were kept) is widened below its calibration's prompt
        count and kept as it is above it (narrowing towards 0 would reject an honest offset). Narrowing stops at
        `floor` (the statistic's dtype floor: offsets between honest hosts and paths do not shrink with n)."""
        bound = self.mean[stat]
        if prompts <= 0 or calibrated_prompts <= 0 or prompts == calibrated_prompts:
            return bound
        scale = math.sqrt(calibrated_prompts / prompts)
        center = self.mean_center.get(stat)
        if center is None or not 0 <= center < bound:
            return bound * scale if prompts < calibrated_prompts else bound
        narrowed = center + (bound - center) * scale
        return max(narrowed, min(floor, bound)) if prompts > calibrated_prompts else narrowed


class Provenance(Frozen):
    """Where an entry came from."""

    runs: int = Field(ge=1, description="Honest runs (boots) the thresholds were derived from")
    prompts_per_run: int = Field(ge=1)
    hosts: tuple[str, ...]
    versions: dict[str, str]
    engines: dict[Annotated[str, Field(pattern=ENGINE_NAME)], Annotated[str, Field(pattern=ENGINE_VERSION)]] = Field(
        default_factory=dict, description="Engine -> the exact version the honest runs were computed with (what the "
        "probe reported: its checks.model engine and engine_version). On a class whose SKUs need an accelerator the "
        "entry holds for that engine's release series alone (`same_engine_release`); empty in an entry calibrated "
        "before engines were recorded, which then holds for no accelerated gate. Left out of the entry when empty")
    variations: tuple[str, ...] = Field(description="What varied between the honest runs (batch size, threads, boots)")
    date: str
    method: str
    margin: float = Field(gt=1, allow_inf_nan=False)
    reference_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Bundle the honest runs were compared with")
    image: str = Field(description="Image id the honest runs used")
    honest_max: dict[str, Measured] = Field(description="Largest honest value per statistic and per kernel op")

    @model_serializer(mode="wrap")
    def _without_empty_engines(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """An entry calibrated before engines were recorded serialises as it did: the same tolerance_sha256."""
        data = handler(self)
        if not self.engines:
            data.pop("engines", None)
        return data


class ToleranceEntry(Frozen):
    """The calibrated tolerance of one hardware class x dtype x model."""

    key: ToleranceKey
    kernels: dict[str, Threshold] = Field(description="Kernel op -> max scale-normalised error")
    model: ModelThresholds
    provenance: Provenance
    ops: dict[str, dict[Literal["rms", "max", "bias"], Threshold]] = Field(
        default_factory=dict, description="Engine op battery: <op>.<dtype> -> measure -> calibrated bound in units of "
        "the dtype's rounding (gates/judge/ops.py). Left out of the entry when empty (the hard bounds alone apply)")
    ops_spec: str = Field("", pattern=r"^([0-9a-f]{64})?$", description="sha256 of the op battery's spec the `ops` "
                          "bounds were calibrated on (gates/judge/ops.py: spec_sha256); bounds of another spec are not "
                          "applied. Left out when empty")

    @model_serializer(mode="wrap")
    def _without_empty_ops(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """An entry calibrated before the op battery serialises as it did: the same tolerance_sha256."""
        data = handler(self)
        for name in ("ops", "ops_spec"):
            if not getattr(self, name):
                data.pop(name, None)
        return data


class Tolerances(Frozen):
    """The whole tolerance file."""

    format: str = Field(FORMAT, pattern=r"^skupin-tolerances/1$")
    hard_bounds: HardBounds = HardBounds()
    entries: tuple[ToleranceEntry, ...] = ()

    def find(self, key: ToleranceKey) -> ToleranceEntry | None:
        return next((e for e in self.entries if e.key == key), None)

    def missing(self, key: ToleranceKey) -> str:
        """Why `key` has no entry, when entries of the same class, dtype and model exist for other engines."""
        others = sorted(_engines_label(e) for e in self.entries if e.key.engine and e.key != key and
                        e.key.model_copy(update={"engine": key.engine}) == key)
        if not others:
            return ""
        return (f" (calibrated with {', '.join(others)} only: every engine brings its own "
                f"kernels and its own honest noise, so an entry holds for the engine it was calibrated with)")


def _engines_label(entry: ToleranceEntry) -> str:
    """`vllm 0.32.0`: the engine of an engine-keyed entry with the version its honest runs used, where recorded."""
    version = entry.provenance.engines.get(entry.key.engine)
    return f"{entry.key.engine} {version}" if version else entry.key.engine


def engine_release(version: str) -> str:
    """The release series of an engine version: its PEP 440 major.minor (`0.32.0` and `0.32.1.post1` -> `0.32`), or the
    version itself when it is not PEP 440 (then only the same version is the same series)."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return version
    return ".".join(str(part) for part in (*release, 0)[:2])


def same_engine_release(calibrated: str, running: str) -> bool:
    """Whether an entry calibrated with engine version `calibrated` holds for a gate of engine version `running` on an
    accelerator: the same release series (major.minor), point releases included.

    Why the series and not the exact version: the gate exists to judge a point release against a fixed bound (a point
    release of the engine, torch or the compiler can change kernel selection and with it the numbers: DESIGN.md).
    Keyed by exact version, every point-release bump would end 'uncalibrated' and its fix, `skupin calibrate` on the
    bumped image, would derive the bound from the very candidate it should judge, calibrating a regression in. Why
    not the name alone: a new minor series brings new default kernels (attention backends, MoE and quantized paths,
    compiled graphs), so its honest noise is its own, as another engine's is. Recalibrating a new series replaces the
    entry of the same key (the key names the engine, not its version), so `merge_entry` refuses a looser bound than
    the previous series' without --allow-looser: a new series cannot silently widen the class."""
    return bool(calibrated and running) and engine_release(calibrated) == engine_release(running)


def calibrate_command(sku: str, *, float32: bool = False, image: str | None = None) -> str:
    """The exact `skupin calibrate` command line that calibrates the entry `sku`'s gate lacks, to run on the hardware
    that gates it: `--float32` for its float32 pass, `--image` the image the gate ran (without it, calibrate takes the
    SKU's build record, as the gate does)."""
    words = ["skupin", "calibrate", sku, *(["--float32"] if float32 else []), *(["--image", image] if image else [])]
    return shlex.join(words)


@dataclass(frozen=True)
class Calibration:
    """Whether a SKU's gate (or its float32 pass) is calibrated: the key and its entry when that holds for the SKU,
    else None, what is missing (`problem`) and the command that fixes it (`skupin check`, the matrix and the gate all
    say both)."""

    key: ToleranceKey
    entry: ToleranceEntry | None
    problem: str
    command: str

    @property
    def fix(self) -> str:
        return f"{self.command} on that hardware (an honest image of the SKU)"

    @property
    def why(self) -> str:
        """Why the gate has no entry, with the fix; empty when it has one."""
        return f"{self.problem}; fix: {self.fix}" if self.entry is None else ""


def calibration_for(manifest: SkuManifest, tolerances: Tolerances, *, reference_sha256: str | None,
                    float32: bool = False, image: str | None = None, path: Path = DEFAULT_PATH) -> Calibration:
    """The one decision "is this SKU's gate calibrated", shared by the gate (`gates/gate.py: _entry_for`), `skupin
    check` (`calibration_warning`, `float32_pass_warning`) and the matrix (through gates/preflight.py: uncalibrated).

    An entry holds for the SKU when its key (class, dtype, model and, on an accelerator or with
    gate.tolerance_per_engine, engine) has one, it was
    measured against the SKU's bundle (`reference_sha256`; None: not checked, the bundle is not at hand) and, on an
    accelerator, its honest runs used the SKU's engine in the same release series (`same_engine_release`). The CPU
    class's engine-free entries hold for every engine whose SKU does not say `gate.tolerance_per_engine`: their
    cross-engine evidence is gates/data/evidence/."""
    key = ToleranceKey.of(manifest, float32=float32)
    command = calibrate_command(manifest.name, float32=float32, image=image)
    entry = tolerances.find(key)
    if entry is None:
        return Calibration(key, None, f"no calibrated tolerance for {key.label()} in {path}{tolerances.missing(key)}",
                           command)
    if reference_sha256 is not None and entry.provenance.reference_sha256 != reference_sha256:
        return Calibration(key, None, f"the tolerance of {key.label()} was calibrated against bundle "
                                      f"{entry.provenance.reference_sha256[:12]}, not {reference_sha256[:12]}", command)
    version = manifest.stack.engine.version
    calibrated = entry.provenance.engines.get(key.engine, "")
    if key.engine and not same_engine_release(calibrated, version):
        was = (f"{key.engine} {calibrated} (release {engine_release(calibrated)})" if calibrated
               else "an engine version it does not record")
        return Calibration(key, None, (
            f"the tolerance of {key.label()} was calibrated with {was}, not {key.engine} {version} (release "
            f"{engine_release(version)}): an engine's release series brings its own kernels "
            f"and its own honest noise, so an entry holds for the series it was calibrated with"), command)
    return Calibration(key, entry, "", command)


def statistics_problems(entry: ToleranceEntry) -> list[str]:
    """What is wrong with the statistics of `entry` against the registry (gates/judge/compare.py: STATISTICS): every
    decision statistic has a per-prompt and a mean threshold, or the entry says why not (`model.omitted`); nothing
    else is named. Empty when the entry is whole."""
    model, out = entry.model, []
    for name in DECISION_STATS:
        sides = [side for side, table in (("per_prompt", model.per_prompt), ("mean", model.mean)) if name in table]
        if name in model.omitted and sides:
            out.append(f"{name} has a threshold ({', '.join(sides)}) and is omitted")
        elif name not in model.omitted and len(sides) < 2:
            missing = " and ".join(side for side in ("per_prompt", "mean") if side not in sides)
            out.append(f"{name} has no {missing} threshold and the entry says not why (model.omitted)")
    for name in sorted({*model.per_prompt, *model.mean, *model.omitted} - set(DECISION_STATS)):
        out.append(f"{name} is not a decision statistic (known: {', '.join(DECISION_STATS)})")
    return [f"{entry.key.label()}: {line}" for line in out]


def load_tolerances(path: Path = DEFAULT_PATH) -> Tolerances:
    """Read and validate the tolerance file (an absent file has no entries)."""
    path = Path(path)
    if not os.path.lexists(path):
        return Tolerances()
    try:
        # a trust input: no link, no FIFO, bounded, and no YAML anchors/aliases (a few hundred bytes of aliases
        # expand to gigabytes) nor deep nesting
        data = load_yaml(read_regular_file(path, max_bytes=MAX_TOLERANCES_BYTES), source=str(path),
                         max_bytes=MAX_TOLERANCES_BYTES) or {}
        tolerances = Tolerances.model_validate(data)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']} (got {e.get('input')!r})"
                           for e in exc.errors()[:10])
        raise GateCouldNotRun(f"{path}: invalid tolerance file: {fields}") from exc
    except (OSError, UntrustedInputError, yaml.YAMLError) as exc:
        raise GateCouldNotRun(f"{path}: invalid tolerance file: {exc}") from exc
    keys = [e.key for e in tolerances.entries]
    if len(keys) != len(set(keys)):
        raise GateCouldNotRun(f"{path}: an entry key appears twice")
    # An engine-free entry and engine-keyed ones of one class, dtype and model may stand side by side: a SKU's key
    # (ToleranceKey.of) names its engine on an accelerator or with gate.tolerance_per_engine, and takes that entry
    # alone; the engine-free one holds for the other SKUs of a CPU class (docs/GATE.md, "Engines and the tolerance key").
    # merge_entry refuses an engine-keyed entry looser than its class's engine-free one unless told (--allow-looser).
    foreign = [f"{e.key.label()}: provenance.engines names {', '.join(sorted(e.provenance.engines))}, not its key's "
               f"engine {e.key.engine}" for e in tolerances.entries
               if e.key.engine and e.provenance.engines and e.key.engine not in e.provenance.engines]
    if foreign:
        raise GateCouldNotRun(f"{path}: invalid tolerance file: {'; '.join(foreign)}; fix: an entry keyed by an engine "
                              "records the version of that engine its honest runs used (skupin calibrate writes it)")
    problems = [line for e in tolerances.entries for line in statistics_problems(e)]
    if problems:
        raise GateCouldNotRun(f"{path}: invalid tolerance file: {'; '.join(problems)}; fix: skupin calibrate the "
                              f"entry's class, or say in model.omitted why a statistic has no threshold")
    return tolerances


def lookup(tolerances: Tolerances, key: ToleranceKey, *, path: Path = DEFAULT_PATH) -> ToleranceEntry:
    """The entry of `key`, or GateCouldNotRun saying how to calibrate it."""
    entry = tolerances.find(key)
    if entry is None:
        known = ", ".join(e.key.label() for e in tolerances.entries) or "none"
        raise GateCouldNotRun(f"{path}: no calibrated tolerance for {key.label()} (known: {known}); "
                              f"fix: skupin calibrate <sku> on an honest image of that class")
    return entry


def calibration_warning(*, manifest: SkuManifest, tolerances: Tolerances, reference: Path, path: Path = DEFAULT_PATH
                        ) -> str | None:
    """Why the gate of `manifest` would end `uncalibrated` (`calibration_for`: no entry for its key, one measured
    against another reference bundle than the SKU's, or on an accelerator one of another engine release), with the
    exact command that fixes it; None when its entry holds (`skupin check` warns, the matrix keeps it off GPU runners)."""
    folder = Path(reference)
    sha = bundle_sha256(folder) if (folder / "SHA256SUMS").is_file() else None
    found = calibration_for(manifest, tolerances, reference_sha256=sha, path=path)
    if found.entry is not None:
        return None
    return (f"{found.problem}: its gate runs the calibration-free checks only and ends 'uncalibrated' (exit 14), never "
            f"pass; fix: {found.fix}")


def float32_pass_warning(*, manifest: SkuManifest, tolerances: Tolerances, reference: Path, path: Path = DEFAULT_PATH
                         ) -> str | None:
    """What weakens the float32 pass of a SKU that serves another dtype (docs/GATE.md, "The float32 pass"): no float32
    bundle beside its reference (the gate then ends 'could not run'), or no calibrated float32 entry for it
    (`calibration_for`; the pass then runs its hard bounds only and the gate ends 'uncalibrated' at best); None when
    nothing does."""
    from skupin.engines import engine_float32

    if manifest.gate.dtype == "float32" or not engine_float32(manifest.stack.engine.name):
        return None
    try:
        folder = float32_reference(Path(reference), dtype=manifest.gate.dtype)
    except BundleError as exc:
        return f"its float32 pass has no bundle to compare with: {exc}"
    if not (folder / "SHA256SUMS").is_file():
        return (f"its float32 pass needs the bundle {folder} "
                f"beside its reference, which is missing: its gate would end 'could not run' (exit 11); fix: capture it "
                f"(docs/REFERENCES.md)")
    found = calibration_for(manifest, tolerances, reference_sha256=bundle_sha256(folder), float32=True, path=path)
    if found.entry is not None:
        return None
    return (f"{found.problem} (float32 bundle {folder.name}): its float32 pass runs the hard bounds only and the gate "
            f"ends 'uncalibrated' (exit 14) at best; fix: {found.fix}")


def looser(new: ToleranceEntry, old: ToleranceEntry) -> list[str]:
    """Thresholds of `new` that are looser than `old`'s (for the same key)."""
    found = [f"kernels.{op}" for op, v in new.kernels.items() if op in old.kernels and v > old.kernels[op]]
    found += [
        f"per_prompt.{s}" for s, v in new.model.per_prompt.items() if s in old.model.per_prompt and v > old.model.per_prompt[s]
    ]
    found += [f"mean.{s}" for s, v in new.model.mean.items() if s in old.model.mean and v > old.model.mean[s]]
    found += [f"omitted.{s}" for s in new.model.omitted if s in old.model.per_prompt]  # a statistic no longer judged
    if new.model.honest_rate > old.model.honest_rate:
        found.append("honest_rate")
    return found


def looser_ops(new: ToleranceEntry, old: ToleranceEntry) -> list[str]:
    """Op bounds of `new` looser than `old`'s (op battery and module ops, on the same battery spec)."""
    if not new.ops or not old.ops or new.ops_spec != old.ops_spec:
        return []
    return [f"ops.{op}.{m}" for op, row in new.ops.items() for m, v in row.items()
            if op in old.ops and m in old.ops[op] and v > old.ops[op][m]]


def class_ruler(tolerances: Tolerances, key: ToleranceKey) -> ToleranceEntry | None:
    """The engine-free entry of an engine-keyed key's class, dtype and model (a CPU class's one ruler for every engine
    not keyed per engine), or None."""
    return tolerances.find(key.model_copy(update={"engine": ""})) if key.engine else None


# An op's calibrated bound = margin x the class's largest honest value, per measure (gates/judge/ops.py derive_bounds,
# raised to its floors): rms is a mean over thousands of values and moves little between honest runs; max and bias are
# extremes of one row and move more. The module ops (gates/judge/modules.py) are modules of several products whose
# rounding a kernel choice moves more than one op's: a wider margin. Every layer fault of the bench that needs
# calibration stands >= 4x over the honest value (an RMSNorm without its upcast, a router softmax in bfloat16;
# docs/BENCHMARKS.md "The module ops"). So bound / margin is never below the honest value (within_ruler).
OP_MARGINS: Final = {"rms": 1.1, "max": 1.5, "bias": 2.0}
MODULE_MARGINS: Final = {"rms": 2.0, "max": 2.0, "bias": 2.0}


def op_margins(op_key: str) -> dict[str, float]:
    """The margins of an op bound's key (`rmsnorm.bfloat16`: the battery's; `layer.1.router.bfloat16`: a module's)."""
    return OP_MARGINS if op_key.rsplit(".", 1)[0] in ops_spec.OUTPUTS else MODULE_MARGINS


def captured_ops(key: ToleranceKey) -> bool:
    """Whether an entry's op bounds are of modules captured from its engine's own forward (an engine-keyed entry of
    llama.cpp's: skupin/engines MODULE_INPUTS), not of the seeded inputs every other entry's were measured on: such
    bounds are compared with no other entry's."""
    return bool(key.engine) and engine_module_inputs(key.engine) == "captured"


def within_ruler(entry: ToleranceEntry, ruler: ToleranceEntry) -> ToleranceEntry:
    """`entry` (an engine's own, on a class with an engine-free ruler) with every threshold the ruler admits the engine
    under taken from the ruler where it is tighter: a threshold stays looser than the ruler's only where the engine's
    own honest runs exceed the ruler's bound (AN-001: a new engine loosens the class where its numerics need it, and
    only there). Model and kernel thresholds compare the entry's recorded honest maxima; op bounds the largest honest
    value a bound can stand for (bound / its margin, op_margins), on the same battery spec and seeded inputs only
    (captured_ops: an engine's captured modules keep the bounds of its own forward)."""
    honest = entry.provenance.honest_max

    def tight(table: dict, theirs: dict, prefix: str) -> dict:
        out = dict(table)
        for name, value in table.items():
            bound = theirs.get(name)
            seen = honest.get(f"{prefix}{name}")
            if bound is not None and seen is not None and float(seen) <= float(bound) < float(value):
                out[name] = bound
        return out

    ops = {op: {m: (ruler.ops[op][m] if op in ruler.ops and m in ruler.ops[op]
                    and float(v) / op_margins(op)[m] <= float(ruler.ops[op][m]) < float(v) else v)
                for m, v in row.items()}
           for op, row in entry.ops.items()} if entry.ops_spec == ruler.ops_spec and not captured_ops(entry.key) \
        else entry.ops
    model = entry.model.model_copy(update={"per_prompt": tight(entry.model.per_prompt, ruler.model.per_prompt,
                                                               "per_prompt."),
                                           "mean": tight(entry.model.mean, ruler.model.mean, "mean.")})
    note = f"; bounded by {ruler.key.label()} wherever its honest runs fit that entry (within_ruler)"
    provenance = entry.provenance.model_copy(update={"method": entry.provenance.method.removesuffix(note) + note})
    return entry.model_copy(update={"model": model, "kernels": tight(entry.kernels, ruler.kernels, "kernels."),
                                    "ops": ops, "provenance": provenance})


def merge_entry(tolerances: Tolerances, entry: ToleranceEntry, *, allow_looser: bool = False) -> Tolerances:
    """A copy with `entry` written under its own key; every other class's entry is left exactly as it was.

    Replacing an existing entry of the same key with looser thresholds needs `allow_looser`. So does a first
    engine-keyed entry beside its class's engine-free one (a CPU SKU with gate.tolerance_per_engine) that is looser than
    that ruler anywhere, op bounds included, after `within_ruler` took the ruler's thresholds wherever the engine's
    honest runs fit them: a new engine never loosens the class's ruler unasked (AN-001, docs/GATE.md "Engines and the
    tolerance key"). Recalibrating such an entry compares it with the entry it replaces, and the op bounds that entry
    cannot rule (ones it had none of, or all of them after a battery spec change) with the ruler; an engine's captured
    module ops (captured_ops) are compared only with its own earlier entry's. An entry without kernel thresholds (its
    SKU runs no kernel battery) keeps the existing entry's, else the ruler's, and one without some op bounds the
    existing entry's for those (on the same battery spec): a recalibration by a SKU that runs fewer checks never drops
    the class's.
    """
    old = tolerances.find(entry.key)
    ruler = class_ruler(tolerances, entry.key)
    first_ops: list[str] = []  # an engine-keyed recalibration's op bounds the entry it replaces cannot rule
    if ruler is not None:  # an engine's own entry on a CPU class: the class's ruler wherever it admits the engine
        entry = within_ruler(entry, ruler)
        if old is not None and not captured_ops(entry.key):  # those the old entry had none of, or of another spec
            fresh = entry.ops if old.ops_spec != entry.ops_spec else {
                op: row for op, row in entry.ops.items() if op not in old.ops}
            first_ops = looser_ops(entry.model_copy(update={"ops": fresh}), ruler)
        ruler = ruler if old is None else None
    base = old or ruler
    if base is not None and not entry.kernels:  # calibrated without a kernel battery (llama.cpp): keep the class's
        entry = entry.model_copy(update={"kernels": base.kernels})
    if old is not None and old.ops and (not entry.ops or old.ops_spec == entry.ops_spec):
        # ops or measures this calibration did not measure keep the old bounds (all of them when it measured none: a
        # class-keyed llama.cpp SKU runs no battery)
        entry = entry.model_copy(update={"ops_spec": old.ops_spec, "ops": {
            op: {**old.ops.get(op, {}), **entry.ops.get(op, {})} for op in {**old.ops, **entry.ops}}})
    if base is not None and not allow_looser:
        compared = None if captured_ops(entry.key) and base is ruler else base  # captured ops rule no seeded ones
        loosened = looser(entry, base) + (looser_ops(entry, compared) if compared is not None else []) + first_ops
        if loosened:
            what = (f"the class's engine-free entry {base.key.label()}" if ruler is not None
                    else "the entry it replaces" + (" (and its class's ruler, for op bounds it had none of)"
                                                    if first_ops else ""))
            raise GateCouldNotRun(f"calibration of {entry.key.label()} would loosen {len(loosened)} thresholds of "
                                  f"{what} ({', '.join(loosened[:12])}"
                                  f"{', ...' if len(loosened) > 12 else ''}); fix: pass --allow-looser if the honest "
                                  "runs really are noisier, and say where and why in the commit that adds the entry")
    others = tuple(e for e in tolerances.entries if e.key != entry.key)
    merged = tolerances.model_copy(update={"entries": tuple(sorted((*others, entry), key=lambda e: e.key.label()))})
    for before in tolerances.entries:  # structural guarantee: other classes byte-for-byte unchanged
        if before.key != entry.key and merged.find(before.key) != before:
            raise GateCouldNotRun(f"refusing to change the entry of another class ({before.key.label()})")
    return merged


def dump_tolerances(tolerances: Tolerances) -> str:
    """The YAML text of the tolerance file (stable order, with a header comment)."""
    header = ("# Gate tolerances per hardware class x dtype x model, written by `skupin calibrate` (see docs/GATE.md).\n"
              "# Each entry records its provenance; calibrating one class never changes another's entry.\n")
    body = yaml.safe_dump(tolerances.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=120)
    return header + body


def write_tolerances(tolerances: Tolerances, path: Path = DEFAULT_PATH) -> None:
    """Write the tolerance file atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dump_tolerances(tolerances))  # a unique temporary beside it, renamed over it
