"""One error hierarchy for the whole tool; each class carries the CLI exit code it maps to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one field of one file, with the fix when one is known."""

    file: str
    field: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.file}: {self.field}: {self.message}"
        return f"{text}; fix: {self.fix}" if self.fix else text


class SkupinError(Exception):
    """Base of every error the CLI turns into an exit code instead of a traceback.

    Each class carries its `exit_code`, a `kind` (the word `--json` reports as `error.kind`) and a `summary` (what
    the code means, as README.md's exit-code paragraph and `skupin --help` say it: tests/unit/test_exit_codes.py
    holds the README to these). `file`, `field` and `fix` name the file, the field and the fix when they are known."""

    exit_code = 1
    kind = "file"
    summary = "a file could not be read or written"

    def __init__(self, message: str, problems: tuple[Problem, ...] = (), *, file: str = "", field: str = "",
                 fix: str = "") -> None:
        super().__init__(message)
        self.problems = tuple(problems)
        self.file, self.field, self.fix = file, field, fix

    def lines(self) -> list[str]:
        """The lines the CLI prints: every problem, or the message when there are none."""
        return [str(p) for p in self.problems] or [f"{self}; fix: {self.fix}" if self.fix else str(self)]


class ManifestError(SkupinError):
    """A manifest is malformed: unknown key, wrong type, value outside its grammar."""

    exit_code = 2
    kind = "manifest"
    summary = "bad input"


class CatalogError(ManifestError):
    """The catalog holds nothing to act on (no manifests in skus/): bad input, exit 2, with the fix."""

    kind = "catalog"


class UsageError(SkupinError):
    """A command-line argument cannot be used (an --out target that is a file or a system folder): exit 2, as argparse
    answers a malformed command line."""

    exit_code = 2
    kind = "usage"
    summary = "bad input"


class CompatError(SkupinError):
    """The pins of a manifest do not fit together (torch/triton, engine/torch, driver/runtime)."""

    exit_code = 3
    kind = "compat"
    summary = "incompatible pins"


class LockError(SkupinError):
    """A lock cannot be made, is missing, or no longer matches its manifest."""

    exit_code = 4
    kind = "lock"
    summary = "lock"


class BuildError(SkupinError):
    """An image build failed or produced an image that does not match its lock."""

    exit_code = 5
    kind = "build"
    summary = "build"


class DockerError(SkupinError):
    """No Docker daemon answers, or one cannot be started."""

    exit_code = 6
    kind = "docker"
    summary = "Docker"


class BundleError(SkupinError):
    """A reference bundle is missing, tampered with, or does not fit the SKU."""

    exit_code = 7
    kind = "bundle"
    summary = "reference bundle"


class PublishError(SkupinError):
    """A publish was refused or failed; nothing was tagged."""

    exit_code = 8
    kind = "publish"
    summary = "publish or verification refused"


class NetworkError(SkupinError):
    """A package index or OCI registry could not be reached or answered wrongly (after retries); a registry that
    answers that a tag or manifest does not exist raises `NotFoundError` instead."""

    exit_code = 9
    kind = "network"
    summary = "registry or index unreachable"


class NotFoundError(NetworkError):
    """A registry that answers says the tag, digest or repository does not exist (HTTP 404): the registry was reached,
    so this is not exit 9 (a registry that cannot be reached, or answers wrongly)."""

    exit_code = 15
    kind = "absent"
    summary = "absent from a registry that answers"


class ImageRefError(UsageError):
    """An image reference (host/repo:tag or host/repo@sha256:...) that is not one: bad input, exit 2."""

    kind = "image_reference"


class GateFailed(SkupinError):
    """The gate ran and the image failed it."""

    exit_code = 10
    kind = "gate_failed"
    summary = "gate failed"


class GateCouldNotRun(SkupinError):
    """The gate could not reach a verdict (image did not boot, deadline, bad bundle)."""

    exit_code = 11
    kind = "gate_could_not_run"
    summary = "gate could not run"


class GateUncalibrated(SkupinError):
    """The gate ran every check it can without calibration and none failed, but the SKU's tolerance key has no
    calibrated entry for its reference bundle: a verdict that is never a pass (fix: skupin calibrate SKU)."""

    exit_code = 14
    kind = "gate_uncalibrated"
    summary = "gate uncalibrated"


# the codes the CLI answers that no error class carries: `skupin ab`'s decisions and the ways a run ends early
OTHER_EXIT_CODES = {0: "ok", 12: "hold", 13: "reject", 130: "interrupted", 141: "the output pipe closed"}


def error_classes() -> list[type[SkupinError]]:
    """Every error class (SkupinError and its subclasses, depth first), for the exit-code table and its test."""
    out: list[type[SkupinError]] = []
    todo: list[type[SkupinError]] = [SkupinError]
    while todo:
        cls = todo.pop(0)
        if cls not in out:
            out.append(cls)
            todo += cls.__subclasses__()
    return out


def exit_code_table() -> dict[int, str]:
    """Exit code -> what it means (the error classes' summaries, then the other codes), by code."""
    table: dict[int, str] = {}
    for cls in error_classes():
        table.setdefault(cls.exit_code, cls.summary)
    return dict(sorted({**table, **OTHER_EXIT_CODES}.items()))
