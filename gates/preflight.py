"""Check statically what a SKU's gate will need: its model fixture, its reference bundles and their fit, its tolerances.

`skupin check` and `skupin matrix` call `gate_checker()` for every manifest (builder/check.py: GateCheck), so a
manifest whose gate could not run is refused before any build: a `gate.model` that is no fixture, a
`gate.reference` that is missing, does not verify, or was recorded for another model or dtype, and the float32
bundle the float32 pass needs beside it. Each problem names the field and its fix, with a did-you-mean where the
value is one of a known set. Warnings say when the gate would end `uncalibrated` (exit 14, never a pass);
`uncalibrated` says why, for the matrix to keep such a SKU off a GPU runner.
"""

from __future__ import annotations

import functools
from pathlib import Path, PurePosixPath
from typing import Any

from skupin.builder.catalog.manifest import SkuManifest
from skupin.builder.check import GateCheck
from skupin.common.errors import BundleError, Problem
from skupin.common.paths import PACKAGE_ROOT, data_path, find_catalog
from skupin.common.suggest import did_you_mean
from skupin.engines import engine_float32
from skupin.gates.judge import tolerance as tolerance_file
from skupin.gates.judge.tolerance import Tolerances, calibration_warning, float32_pass_warning, load_tolerances
from skupin.gates.refdata import fixture
from skupin.gates.refdata.bundle import check_fits, float32_manifest, float32_reference, verify

REFERENCES = "gates/references"  # where bundles live, in a catalog and in the package
CAPTURE = "capture one on NVIDIA hardware (docs/REFERENCES.md, `skupin reference capture`)"


def known_bundles() -> tuple[str, ...]:
    """Every bundle folder (catalog-relative, e.g. gates/references/tiny-llama/h200-float32) in the catalog and the
    package: the values a gate.reference can take here."""
    roots = [root for root in (find_catalog(), PACKAGE_ROOT) if root is not None]
    found = {(PurePosixPath(REFERENCES) / sums.parent.parent.name / sums.parent.name).as_posix()
             for root in roots for sums in (root / REFERENCES).glob("*/*/SHA256SUMS")}
    return tuple(sorted(found))


@functools.cache
def _verified(folder: Path) -> dict[str, Any] | BundleError:
    """The bundle's meta.json after every hash checked, or why it does not verify (once per folder and process)."""
    try:
        return verify(folder=folder)
    except BundleError as exc:
        return exc


def _model(manifest: SkuManifest, file: str) -> list[Problem]:
    model = manifest.gate.model
    if model not in fixture.SPECS:
        known = sorted(fixture.SPECS)
        return [Problem(file, "gate.model", f"{model!r} is no model fixture the gate can run (known: {', '.join(known)})",
                        did_you_mean(model, known) or "name one of them, or add its FixtureSpec to "
                        "gates/refdata/fixture.py: SPECS with its recorded sha256 (EXPECTED)")]
    if not fixture.EXPECTED.get(model):
        return [Problem(file, "gate.model", f"fixture {model} has no recorded sha256 yet, so the gate cannot check it",
                        f"skupin fixture generate --name {model} and record its hashes in gates/refdata/fixture.py")]
    return []


def _bundle(manifest: SkuManifest, file: str, rel: str, *, what: str, fits: bool = True) -> list[Problem]:
    """Problems of the bundle at catalog-relative `rel` for `manifest` (whose gate.dtype is the bundle's dtype); with
    `fits` false (gate.model is no fixture, already reported) only whether it is there and verifies."""
    gate = manifest.gate
    if ".." in PurePosixPath(rel).parts:
        return [Problem(file, "gate.reference", f"{rel!r} leaves the catalog ('..')", "name a folder under gates/references")]
    folder = data_path(rel)
    known = known_bundles()
    wanted = [b for b in known if PurePosixPath(b).parent.name == gate.model and gate.dtype in PurePosixPath(b).name]
    if not folder.is_dir():
        fix = did_you_mean(rel, known) or (f"set gate.reference: {wanted[0]}" if wanted else CAPTURE)
        return [Problem(file, "gate.reference", f"{what} {rel} does not exist (in the catalog or the installed "
                        f"package; known bundles: {', '.join(known) or 'none'})", fix)]
    meta = _verified(folder)
    if isinstance(meta, BundleError):
        return [Problem(file, "gate.reference", f"{what} {rel} does not verify: {meta}",
                        "restore it (git checkout) or " + CAPTURE)]
    if not fits:
        return []
    problems = []
    recorded = meta.get("model", {}).get("name") if isinstance(meta.get("model"), dict) else None
    if recorded != gate.model:
        problems.append(Problem(file, "gate.model", f"{what} {rel} records model {recorded!r}, not {gate.model!r}",
                                f"set gate.reference to a bundle of {gate.model}"
                                + (f" ({wanted[0]})" if wanted else f", or gate.model: {recorded}")))
    if meta.get("dtype") != gate.dtype:
        problems.append(Problem(file, "gate.dtype", f"{what} {rel} records dtype {meta.get('dtype')!r}, not "
                                f"{gate.dtype!r}", f"set gate.reference to a {gate.dtype} bundle"
                                + (f" ({wanted[0]})" if wanted else f", or gate.dtype: {meta.get('dtype')}")))
    if not problems:
        try:
            check_fits(meta=meta, manifest=manifest)
        except BundleError as exc:
            problems.append(Problem(file, "gate.reference", f"{what} {rel}: {exc}", CAPTURE))
    return problems


def gate_problems(manifest: SkuManifest, file: str) -> list[Problem]:
    """Every reason the SKU's gate could not run, found without running it (empty when there is none)."""
    model = _model(manifest, file)
    problems = model + _bundle(manifest, file, manifest.gate.reference, what="reference bundle", fits=not model)
    if problems or manifest.gate.dtype == "float32" or not engine_float32(manifest.stack.engine.name):
        return problems
    try:  # the float32 pass compares with the float32 bundle beside the reference (docs/GATE.md, "The float32 pass")
        rel = float32_reference(Path(manifest.gate.reference), dtype=manifest.gate.dtype).as_posix()
    except BundleError as exc:
        return [Problem(file, "gate.reference", str(exc), f"rename the folder so it names {manifest.gate.dtype}")]
    return _bundle(float32_manifest(manifest), file, rel, what="the float32 pass's bundle")


def uncalibrated(manifest: SkuManifest, *, tolerances: Tolerances, path: Path) -> str | None:
    """Why the SKU's gate would end 'uncalibrated' (exit 14, never a pass): no calibrated entry for its key (class,
    dtype, model and, on an accelerator, engine and engine release) against its bundle, or none for its float32 pass;
    None when calibrated. The gate's own decision (gates/judge/tolerance.py: calibration_for), so the matrix keeps off
    GPU runners exactly the SKUs whose gate would end 'uncalibrated'."""
    reference = data_path(manifest.gate.reference)
    return (calibration_warning(manifest=manifest, tolerances=tolerances, reference=reference, path=path)
            or float32_pass_warning(manifest=manifest, tolerances=tolerances, reference=reference, path=path))


def _as_problem(file: str, text: str) -> Problem:
    message, _, fix = text.partition("; fix: ")
    return Problem(file, "gate.tolerance_class", message, fix)


def gate_checker() -> GateCheck:
    """builder/check.py's GateCheck for this catalog: (problems, warnings) of a SKU's gate; the tolerance file is read
    once, when a manifest first needs it."""
    path = tolerance_file.catalog_tolerances()

    @functools.cache
    def tolerances() -> Tolerances:
        return load_tolerances(path)

    def check(manifest: SkuManifest, file: str) -> tuple[list[Problem], list[Problem]]:
        problems = gate_problems(manifest, file)
        if problems:
            return problems, []
        why = uncalibrated(manifest, tolerances=tolerances(), path=path)
        return [], [_as_problem(file, why)] if why else []

    return check
