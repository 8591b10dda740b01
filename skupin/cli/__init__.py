"""The `skupin` command line: one parser, one module per command group, every error mapped to its exit code.

Command groups (each module adds its subcommands; a handler imports its stage only when it runs,
so `skupin --help` loads none of them):

    skupin/cli/build.py      check, render, lock, matrix, schema, docker up, base, build, wheels prune
    skupin/cli/reference.py  reference capture|verify, fixture generate
    skupin/cli/gate.py       gate, calibrate, ab
    skupin/cli/publish.py    registry up|down|status, keys, publish, verify, inspect, pull, run
    skupin/cli/releases.py   compat refresh, watch
    skupin/cli/init.py       init (a starter catalog)

Nothing imports this package: it sits on top of the build side (builder/), the gate side
(gates/) and the rooms they share (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from skupin.common import __version__
from skupin.common.errors import SkupinError, UsageError, exit_code_table

if TYPE_CHECKING:
    from types import FrameType

def _exit_codes() -> str:
    """The exit-code lines of `skupin --help`, from the error classes (skupin/common/errors.py)."""
    lines, line = [], "exit codes:"
    for code, what in exit_code_table().items():
        item = f" {code} {what},"
        if len(line) + len(item) > 112:
            lines.append(line)
            line = " " * 11
        line += item
    return "\n".join([*lines, line.rstrip(",")])


EPILOG = """\
the flow:  check -> lock -> render -> build -> gate -> publish
""" + _exit_codes() + """
            (12 hold and 13 reject are skupin ab's; with --json every command writes one JSON object on
            stdout: {"ok": true, "error": null, <its result>, "warnings": [...]} on success, and on failure
            {"ok": false, "error": {"code", "kind", "file", "field", "message", "fix"}, "warnings": [...]})
the catalog:  the folder holding skus/ (found from the current folder upwards, or --root / $SKUPIN_ROOT);
            templates, compatibility data, probe and default reference bundles ship with skupin, and a
            catalog's own templates/ or gate.reference folders take precedence (docs/CATALOG.md)
examples:
  skupin init my-catalog            a starter catalog: the CPU SKU's manifest, CI workflows, .gitignore
  skupin check                      check every manifest in the catalog's skus/
  skupin render cpu-x86_64          print the CPU SKU's Dockerfile (no Docker needed)
  skupin run cpu-x86_64             check, lock, build, gate, publish and verify the CPU SKU
  skupin matrix                     the CI matrix as JSON
  skupin ab cpu-x86_64 cpu-x86_64-vllm   A/B two runtimes on the same weights, with quality gates
"""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, remembering its last complaint (so that `--json` can say it as JSON: `main`)."""

    last_error = ""

    def error(self, message: str) -> NoReturn:
        _Parser.last_error = f"{self.prog}: {message}"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    from skupin.cli import build, gate, init, publish, reference, releases

    parser = _Parser(
        prog="skupin",
        description="Per-SKU LLM inference images: pin driver, framework, compiler and engine together, "
        "build, gate the outputs against NVIDIA reference tensors, publish by digest.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"skupin {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show Python tracebacks on errors")
    parser.add_argument("--install-missing", action="store_true",
                        help="let skupin apt-get install the Debian packages it needs and lacks (docker.io, debootstrap, "
                             "docker-registry); default: name them and stop ($SKUPIN_INSTALL_MISSING=1 does the same)")
    parser.add_argument("--root", metavar="DIR",
                        help="the catalog to act on (a folder holding skus/); default: $SKUPIN_ROOT, else the current "
                             "folder or its nearest parent holding skus/. verify, pull and inspect need none")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in (init, build, reference, gate, publish, releases):
        group.add_commands(sub)
    return parser


def _sigterm_as_interrupt() -> None:
    """A cancelled CI job sends SIGTERM: unwind like Ctrl-C so builds and containers are cleaned up."""
    import signal

    def handler(_signum: int, _frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a test's worker thread)
        pass


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; argparse's own refusal (exit 2) is also the `--json` failure object when asked for."""
    from skupin.cli.output import failure, out_json

    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # a malformed command line (2), --help or --version (0)
        if exc.code == 2 and "--json" in (sys.argv[1:] if argv is None else argv):
            out_json(failure(UsageError(_Parser.last_error or "malformed command line",
                                        fix="skupin COMMAND --help lists its arguments")))
        raise


def _failed(exc: BaseException, *, as_json: bool) -> int:
    """Say why the command failed (stderr; with `--json` also the failure object on stdout); its exit code."""
    from skupin.cli.output import failure, out_json

    if isinstance(exc, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        code, kind = 130, "interrupted"
    elif isinstance(exc, SkupinError):
        for line in exc.lines():
            print(f"error: {line}" if not exc.problems else line, file=sys.stderr)
        code, kind = exc.exit_code, exc.kind
    else:  # an OSError: a file this host could not read or write (a full disk, a folder's permissions): one line
        print(f"error: {exc}", file=sys.stderr)
        code, kind = SkupinError.exit_code, SkupinError.kind
    if as_json:
        out_json(failure(exc, code=code, kind=kind))
    return code


def main(argv: list[str] | None = None) -> int:
    from skupin.cli.output import reset_warnings

    reset_warnings()
    args = _parse(build_parser(), argv)
    _sigterm_as_interrupt()
    as_json = bool(getattr(args, "json", False))
    try:
        if args.root is not None:
            from skupin.common.paths import use_root

            use_root(args.root)
        if args.install_missing:
            from skupin.common.apt import allow_installs

            allow_installs()
        return int(args.func(args))
    except BrokenPipeError:  # the reader went away (`skupin matrix | head -3`): stop quietly, as `ls | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's last flush cannot raise
        return 141
    except (SkupinError, OSError) as exc:
        if args.traceback:
            raise
        return _failed(exc, as_json=as_json)
    except KeyboardInterrupt as exc:
        return _failed(exc, as_json=as_json)
    finally:
        if args.root is not None:  # main() may be called again in this process (tests): discovery is the default
            from skupin.common.paths import use_root

            use_root(None)
        if args.install_missing:
            from skupin.common.apt import allow_installs

            allow_installs(False)
