"""How the command line speaks: results on stdout, progress on stderr (one rewritten line on a terminal), lazy
handlers, and the flags several commands share."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

Handler = Callable[[argparse.Namespace], int]


def out(line: str = "") -> None:
    """One line of a command's result, on stdout."""
    print(line, flush=True)


def err(line: str) -> None:
    """One line of progress or of an error, on stderr."""
    print(line, file=sys.stderr, flush=True)


def progress_printer(mode: str) -> Callable[[str], None]:
    """Progress to stderr: one rewritten status line on a terminal (`tty`), plain lines otherwise."""
    if mode == "tty":
        def show(line: str) -> None:
            sys.stderr.write("\r\x1b[K" + line[:200])
            sys.stderr.flush()
        return show
    return err


def lazy(module: str, name: str) -> Handler:
    """The handler `module.name`, imported only when its command runs (`skupin --help` stays light)."""

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), name)(args))

    return run


def install_missing_flag(parser: argparse.ArgumentParser) -> None:
    """Accept the global `--install-missing` after a subcommand that installs Debian packages too (`skupin docker up
    --install-missing` as well as `skupin --install-missing docker up`); absent there, the global value stands."""
    parser.add_argument("--install-missing", action="store_true", default=argparse.SUPPRESS,
                        help="let skupin apt-get install the Debian packages this command needs (same as the global "
                             "flag before the command)")
