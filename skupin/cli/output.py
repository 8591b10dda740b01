"""How the command line speaks: results on stdout, progress on stderr (one rewritten line on a terminal), lazy
handlers, the flags several commands share, and the machine-output contract of `--json`.

The `--json` contract, for every command that takes `--json`: stdout holds one JSON object (a command that writes one
line per item, such as `lock --json`, ends with it), with the same three keys whatever happened. On success

    {"ok": true, "error": null, <the command's result fields>, "warnings": [<each warning the command gave>, ...]}

where a result that is an object (a build record, `verify`'s answer, a verdict) keeps its fields at the top level,
and a result that is a list is under the key its command names (`keys list`: "keys"; `check`: "manifests"). On
failure it is

    {"ok": false,
     "error": {"code": <the exit code>, "kind": <the error class's kind: manifest, usage, catalog, image_reference,
               compat, lock, build, docker, bundle, publish, network, absent, gate_failed, ...>,
               "file": <the file, or null>, "field": <the field, or null>, "message": <why>, "fix": <the fix, or null>,
               "problems": [{"file", "field", "message", "fix"}, ...]},
     "warnings": [<each warning the command gave>, ...]}

with the command's own fields beside them where it has a partial result (`verify`'s answer, `run`'s stages).
`emit()` writes a command's result under the contract (success, or `failure()` merged in when the command fails
without raising); `skupin.cli.main` writes `failure()` for every error raised. The human lines still go to stderr.
tests/unit/test_json_contract.py holds every `--json` command to it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

from skupin.common.errors import SkupinError

Handler = Callable[[argparse.Namespace], int]
_WARNINGS: list[str] = []


def out(line: str = "") -> None:
    """One line of a command's result, on stdout."""
    print(line, flush=True)


def err(line: str) -> None:
    """One line of progress or of an error, on stderr; a line that starts with "warning: " is also kept for the
    `warnings` of the `--json` failure object."""
    if line.startswith("warning: "):
        _WARNINGS.append(line.removeprefix("warning: "))
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


def warn(line: str) -> None:
    """A warning: on stderr now ("warning: ..."), and in the `warnings` of the `--json` failure object."""
    err(f"warning: {line}")


def warnings() -> list[str]:
    """The warnings given since the command started."""
    return list(_WARNINGS)


def reset_warnings() -> None:
    _WARNINGS.clear()


def _split_fix(text: str) -> tuple[str, str]:
    """A message that carries its fix ("...; fix: ...") split into (message, fix)."""
    message, sep, fix = text.partition("; fix: ")
    return (message, fix) if sep else (text, "")


def error_json(exc: BaseException, *, code: int | None = None, kind: str | None = None) -> dict[str, Any]:
    """The `error` object of the contract (see the module doc) for an error: a SkupinError with its class's code and
    kind, an OSError (a file this host could not read or write: code 1, kind "file"), or anything else as `code`/`kind`
    say (KeyboardInterrupt: 130, "interrupted")."""
    problems = [{"file": p.file, "field": p.field, "message": p.message, "fix": p.fix or None}
                for p in getattr(exc, "problems", ())]
    if isinstance(exc, SkupinError):
        message, fix = _split_fix(str(exc))
        first = exc.problems[0] if exc.problems else None
        return {"code": exc.exit_code if code is None else code, "kind": kind or exc.kind,
                "file": exc.file or (first.file if first else None) or None,
                "field": exc.field or (first.field if first else None) or None,
                "message": message,
                "fix": exc.fix or fix or (first.fix if first else None) or None, "problems": problems}
    if isinstance(exc, OSError):
        return {"code": SkupinError.exit_code if code is None else code, "kind": kind or SkupinError.kind,
                "file": str(exc.filename) if exc.filename is not None else None, "field": None,
                "message": str(exc), "fix": None, "problems": []}
    return {"code": 1 if code is None else code, "kind": kind or type(exc).__name__.lower(), "file": None,
            "field": None, "message": str(exc), "fix": None, "problems": []}


def failure(exc: BaseException, *, code: int | None = None, kind: str | None = None) -> dict[str, Any]:
    """The whole failure object of the contract: {"ok": false, "error": {...}, "warnings": [...]}."""
    return {"ok": False, "error": error_json(exc, code=code, kind=kind), "warnings": warnings()}


CONTRACT_KEYS = ("ok", "error", "warnings")


def contract(result: Mapping[str, Any] | None = None, failed: BaseException | None = None, *,
             code: int | None = None, kind: str | None = None) -> dict[str, Any]:
    """A command's result under the contract: "ok", "error" and "warnings" around the result's own fields (the
    success object), or `failure(failed)` with them beside it. A result's own "ok" (verify's) is the contract's."""
    status = failure(failed, code=code, kind=kind) if failed is not None else \
        {"ok": True, "error": None, "warnings": warnings()}
    fields = {k: v for k, v in (result or {}).items() if k not in CONTRACT_KEYS}
    return {"ok": status["ok"], "error": status["error"], **fields, "warnings": status["warnings"]}


def emit(result: Mapping[str, Any] | None = None, failed: BaseException | None = None, *, indent: int | None = None,
         sort_keys: bool = False, code: int | None = None, kind: str | None = None) -> None:
    """Write a command's `--json` result under the contract (see `contract`) as one JSON object on stdout."""
    out(json.dumps(contract(result, failed, code=code, kind=kind), indent=indent, sort_keys=sort_keys))


def out_json(data: Any) -> None:
    """One JSON object on stdout."""
    out(json.dumps(data, indent=None, sort_keys=False))
