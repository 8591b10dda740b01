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
    """Base of every error the CLI turns into an exit code instead of a traceback."""

    exit_code = 1

    def __init__(self, message: str, problems: tuple[Problem, ...] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)

    def lines(self) -> list[str]:
        """The lines the CLI prints: every problem, or the message when there are none."""
        return [str(p) for p in self.problems] or [str(self)]


class ManifestError(SkupinError):
    """A manifest is malformed: unknown key, wrong type, value outside its grammar."""

    exit_code = 2


class UsageError(SkupinError):
    """A command-line argument cannot be used (an --out target that is a file or a system folder): exit 2, as argparse
    answers a malformed command line."""

    exit_code = 2


class CompatError(SkupinError):
    """The pins of a manifest do not fit together (torch/triton, engine/torch, driver/runtime)."""

    exit_code = 3


class LockError(SkupinError):
    """A lock cannot be made, is missing, or no longer matches its manifest."""

    exit_code = 4


class BuildError(SkupinError):
    """An image build failed or produced an image that does not match its lock."""

    exit_code = 5


class DockerError(SkupinError):
    """No Docker daemon answers, or one cannot be started."""

    exit_code = 6


class BundleError(SkupinError):
    """A reference bundle is missing, tampered with, or does not fit the SKU."""

    exit_code = 7


class PublishError(SkupinError):
    """A publish was refused or failed; nothing was tagged."""

    exit_code = 8


class NetworkError(SkupinError):
    """A package index or OCI registry could not be reached or answered wrongly (after retries)."""

    exit_code = 9


class GateFailed(SkupinError):
    """The gate ran and the image failed it."""

    exit_code = 10


class GateCouldNotRun(SkupinError):
    """The gate could not reach a verdict (image did not boot, deadline, bad bundle)."""

    exit_code = 11


class GateUncalibrated(SkupinError):
    """The gate ran every check it can without calibration and none failed, but the SKU's tolerance key has no
    calibrated entry for its reference bundle: a verdict that is never a pass (fix: skupin calibrate SKU)."""

    exit_code = 14
