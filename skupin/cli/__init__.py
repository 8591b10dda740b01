"""The `skupin` command line: one parser, one module per command group, every error mapped to its exit code.

Command groups (each module adds its subcommands; a handler imports its stage only when it runs,
so `skupin --help` loads none of them):

    skupin/cli/build.py      check, render, lock, matrix, schema, docker up, base, build, wheels prune
    skupin/cli/reference.py  reference capture|verify, fixture generate
    skupin/cli/gate.py       gate, calibrate, ab
    skupin/cli/publish.py    registry up|down|status, keys, publish, verify, inspect, pull, run
    skupin/cli/releases.py   compat refresh, watch

Nothing imports this package: it sits on top of the build side (builder/), the gate side
(gates/) and the rooms they share (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from skupin.common import __version__
from skupin.common.errors import SkupinError

if TYPE_CHECKING:
    from types import FrameType

EPILOG = """\
the flow:  check -> lock -> render -> build -> gate -> publish
exit codes: 0 ok, 1 a file could not be read or written, 2 bad input (manifest or arguments),
            3 incompatible pins, 4 lock, 5 build, 6 docker, 7 reference bundle, 8 publish, 9 network/index,
            10 gate failed, 11 gate could not run,
            14 gate uncalibrated (never a pass); skupin ab: 0 promote, 12 hold, 13 reject;
            130 interrupted, 141 the output pipe closed
the catalog:  the folder holding skus/ (found from the current folder upwards, or --root / $SKUPIN_ROOT);
            templates, compatibility data, probe and default reference bundles ship with skupin, and a
            catalog's own templates/ or gate.reference folders take precedence (docs/CATALOG.md)
examples:
  skupin check                      check every manifest in the catalog's skus/
  skupin render cpu-x86_64          print the CPU SKU's Dockerfile (no Docker needed)
  skupin run cpu-x86_64             check, lock, build, gate, publish and verify the CPU SKU
  skupin matrix                     the CI matrix as JSON
  skupin ab cpu-x86_64 cpu-x86_64-vllm   A/B two runtimes on the same weights, with quality gates
"""


def build_parser() -> argparse.ArgumentParser:
    from skupin.cli import build, gate, publish, reference, releases

    parser = argparse.ArgumentParser(
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
    for group in (build, reference, gate, publish, releases):
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _sigterm_as_interrupt()
    try:
        if args.root is not None:
            from skupin.common.paths import use_root

            use_root(args.root)
        if args.install_missing:
            from skupin.common.apt import allow_installs

            allow_installs()
        return int(args.func(args))
    except SkupinError as exc:
        if args.traceback:
            raise
        for line in exc.lines():
            print(f"error: {line}" if not exc.problems else line, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`skupin matrix | head -3`): stop quietly, as `ls | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's last flush cannot raise
        return 141
    except OSError as exc:  # a file this host could not read or write (a full disk, a folder's permissions): one line
        if args.traceback:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return SkupinError.exit_code
    finally:
        if args.root is not None:  # main() may be called again in this process (tests): discovery is the default
            from skupin.common.paths import use_root

            use_root(None)
        if args.install_missing:
            from skupin.common.apt import allow_installs

            allow_installs(False)
