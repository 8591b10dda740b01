"""Check manifests: parse, validate the pins' compatibility and the lock's freshness, report every problem."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from skupin.builder.catalog.compat import check_accelerator, check_compat
from skupin.builder.catalog.lockfile import Lock
from skupin.builder.catalog.manifest import SkuManifest, display_path, parse_manifest
from skupin.builder.catalog.stack import LockState, ResolvedStack
from skupin.builder.lock import lock_status
from skupin.common.errors import CompatError, LockError, ManifestError, Problem
from skupin.common.model import Frozen
from skupin.common.paths import manifest_files

__all__ = ["GateCheck", "ResolvedStack", "SkuReport", "check_file", "check_paths", "raise_for", "resolve"]

# What the gate side adds to a check (skupin.gates.preflight: gate_checker()): for a manifest and its file as messages name
# it, the problems that make its gate unable to run (bad input, exit 2) and the warnings (its gate would end
# 'uncalibrated'). The build side cannot import the gate side, so the caller passes it in.
GateCheck = Callable[[SkuManifest, str], tuple[list[Problem], list[Problem]]]


class SkuReport(Frozen):
    """What check found for one manifest file."""

    file: str
    stack: ResolvedStack | None
    manifest: SkuManifest | None = None  # parsed, even when the file has other problems (its name)
    manifest_problems: tuple[Problem, ...] = ()
    compat_problems: tuple[Problem, ...] = ()
    gate_problems: tuple[Problem, ...] = ()
    warnings: tuple[Problem, ...] = ()

    @property
    def problems(self) -> tuple[Problem, ...]:
        """Every problem, bad input first (the manifest's, then the gate's), then the pins' compatibility."""
        return self.manifest_problems + self.gate_problems + self.compat_problems


def _lock_state(manifest: SkuManifest, path: Path) -> tuple[Lock | None, LockState, str]:
    """(lock, state, note); stale locks are returned too so callers can say what moved."""

    state, note, lock = lock_status(manifest=manifest, manifest_path=path)
    return lock, state, note


def check_file(path: Path, *, with_lock: bool = True, gate_check: GateCheck | None = None) -> SkuReport:
    """Check one manifest file: grammar, the accelerator, compatibility, lock; with `gate_check`, what its gate needs."""

    manifest, problems = parse_manifest(path, keep_valid=True)
    if manifest is None:
        return SkuReport(file=str(path), stack=None, manifest_problems=tuple(problems))
    file = display_path(path)
    problems += check_accelerator(manifest=manifest, file=file)
    compat = check_compat(manifest=manifest, file=file)
    gate, warnings = gate_check(manifest, file) if gate_check is not None else ([], [])
    found = {"manifest": manifest, "manifest_problems": tuple(problems), "compat_problems": tuple(compat),
             "gate_problems": tuple(gate), "warnings": tuple(warnings)}
    if problems or gate:  # every problem at once: the file's, the gate's and the pins' compatibility
        return SkuReport(file=str(path), stack=None, **found)
    lock: Lock | None = None
    state: LockState = "unlocked"
    note = ""
    if with_lock and not compat:
        lock, state, note = _lock_state(manifest, path)
    stack = ResolvedStack(manifest=manifest, manifest_path=path, lock=lock, lock_state=state, lock_note=note)
    return SkuReport(file=str(path), stack=stack, **found)


def check_paths(paths: list[Path], *, with_lock: bool = True, gate_check: GateCheck | None = None) -> list[SkuReport]:
    """Check every manifest under `paths` (files or folders)."""

    return [check_file(p, with_lock=with_lock, gate_check=gate_check) for p in manifest_files(paths)]


def raise_for(reports: list[SkuReport]) -> None:
    """Raise the error of the worst class found: ManifestError (2: the manifest's or its gate's) before CompatError (3)."""
    manifest = tuple(p for r in reports for p in r.manifest_problems + r.gate_problems)
    compat = tuple(p for r in reports for p in r.compat_problems)
    if manifest:
        raise ManifestError(f"{len(manifest)} manifest problem(s)", manifest + compat)
    if compat:
        raise CompatError(f"{len(compat)} compatibility problem(s)", compat)


def resolve(path: Path, *, require_lock: bool = False) -> ResolvedStack:
    """The first stage: check one SKU's manifest, its pins' compatibility and its lock; raise on any problem.

    A stale or missing lock is reported in the stack (`lock_state`), not raised, unless `require_lock`.
    """

    report = check_file(path)
    raise_for([report])
    if report.stack is None:  # not reached: raise_for raised for a report without a stack
        raise ManifestError(f"{report.file}: not a manifest")
    if require_lock and report.stack.lock_state != "ok":
        name = report.stack.manifest.name
        raise LockError(f"{report.file}: lock is {report.stack.lock_state}: {report.stack.lock_note}; "
                        f"fix: skupin lock {name}")
    return report.stack
