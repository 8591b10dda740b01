"""Registers the CLI commands of the later stages (lock, engine, base, build, reference, gate, ...)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from common.paths import PYPI_SIMPLE


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add every stage's subcommands. Only argument parsers are built here: a handler imports
    its stage module when the command runs, so `skupin --help` or `skupin check` does not load
    pydantic models, the index client or packaging for commands it does not run."""
    from skupin.cli.publish import add_commands as add_publish
    from skupin.cli.gate import add_commands as add_gate
    from skupin.cli.reference import add_commands as add_reference

    _engine_base_build(sub)
    add_reference(sub)
    add_gate(sub)
    add_publish(sub)
    _compat(sub)
    _watch(sub)
    _wheels(sub)


def _wheels(sub: argparse._SubParsersAction) -> None:
    """`skupin wheels prune` (builder/wheels.py)."""
    p = sub.add_parser("wheels", help="the wheel store (.skupin/wheels) that builds gather locked wheels into")
    wsub = p.add_subparsers(dest="wheels_command", metavar="SUBCOMMAND", required=True)
    r = wsub.add_parser("prune", help="remove stored wheels that no lock names",
                        description="Remove every wheel in the store whose sha256 is in none of the locks next to "
                                    "the given manifests (default: skus/), and partial downloads. The next build of "
                                    "a SKU whose lock names a removed wheel downloads it again.")
    r.add_argument("paths", nargs="*", default=[], help="manifest files or folders whose locks keep their wheels (default: skus/)")
    r.add_argument("--store", metavar="DIR", help="the store (default: .skupin/wheels, or $SKUPIN_STATE/wheels)")
    r.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    r.set_defaults(func=_lazy("builder.wheels", "cmd_wheels"))


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The handler `module.name`, imported only when its command runs."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    return run


def _watch(sub: argparse._SubParsersAction) -> None:
    """`skupin watch` (releases/watch.py)."""
    p = sub.add_parser("watch", help="find point releases the update policies allow; propose (or apply) coupled bumps")
    p.add_argument("paths", nargs="*", default=[], help="manifest files or folders (default: skus/)")
    p.add_argument("--index-url", help="PEP 691 index for every pin (default: each pin's own source)")
    p.add_argument("--registry-url", help="registry for base-image tags (default: the image's own registry)")
    p.add_argument("--apply", action="store_true", help="rewrite the manifests (comments kept) and relock them")
    p.add_argument("--no-lock", action="store_true", help="with --apply: do not relock; list the locks as stale")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", help="wheelhouse for relocking wheelhouse pins")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the report as JSON")
    out.add_argument("--markdown", action="store_true", help="the report as a pull-request body")
    p.set_defaults(func=_lazy("releases.watch", "cmd_watch"))


def _compat(sub: argparse._SubParsersAction) -> None:
    """`skupin compat refresh` (releases/compat_refresh.py)."""
    p = sub.add_parser("compat", help="compatibility data: regenerate it from the packages' own metadata")
    csub = p.add_subparsers(dest="compat_command", metavar="SUBCOMMAND", required=True)
    r = csub.add_parser("refresh", help="rewrite the torch->triton/CUDA and engine->torch rows from wheel metadata")
    r.add_argument("--index-url", default=PYPI_SIMPLE, help="PEP 691 index (default: PyPI; a mirror works)")
    r.add_argument("--out", metavar="FILE", help="write here instead of builder/data/compat.yaml")
    r.add_argument("--compat", metavar="FILE", help="the compatibility file to start from (default: builder/data/compat.yaml)")
    r.add_argument("--json", action="store_true", help="a JSON report")
    r.set_defaults(func=_lazy("releases.compat_refresh", "cmd_refresh"))


def _engine_base_build(sub: argparse._SubParsersAction) -> None:
    """`engine up`, `base SKU`, `build SKU` (dockerd/client.py, base.py, build.py)."""
    from skupin import cli

    p = sub.add_parser("engine", help="the Docker engine: `engine up` starts (and if needed installs) it")
    esub = p.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    q = esub.add_parser("up", help="make sure a Docker engine answers (never touches a running one) and remove the "
                                   "sandbox containers of dead skupin runs",
                        description="Start (and if needed install) dockerd when nothing answers on the socket; an "
                                    "engine that answers is left as it is. Then remove the sandbox containers whose "
                                    "owner process is gone (killed gate, lost Docker API) and say which.")
    q.add_argument("--deadline", type=float, default=60, metavar="S", help="seconds to wait for the socket (default 60)")
    q.add_argument("--json", action="store_true", help="print what was done as JSON")
    q.set_defaults(func=cli.cmd_engine_up)

    p = sub.add_parser("base", help="make the SKU's base image locally (debootstrap + docker import) or pull it by digest")
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.set_defaults(func=cli.cmd_base)

    p = sub.add_parser(
        "build", help="build, verify (image's pip list == lock) and tag a SKU's image",
        description="Gather every locked wheel in the host's wheel store (.skupin/wheels: taken from "
                    "--wheelhouse or downloaded, each checked against the lock's sha256), render the SKU's "
                    "Dockerfile from its lock and build it with BuildKit, one step per pin after its locked "
                    "dependencies, so a point release rebuilds only its own step and those above. Each step "
                    "binds exactly its wheels and installs them with imagetools/wheel_install.py (hashes checked "
                    "again, pypa installer, no resolver, no network), compiling each Python file as it is "
                    "written with imagetools/bytecode.py (unchanged files' code comes from a BuildKit cache "
                    "mount). The build context is kept in .skupin/contexts/<sku> (locked while a build uses it) so BuildKit re-sends only what changed. After the build the "
                    "image's own Python must report exactly the locked set; only then is the image "
                    "tagged and the record written to .skupin/builds/<sku>.json (with per-layer and "
                    "per-phase times).",
    )
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR",
                   help="local wheels, used before any download (needed for wheels locked from a wheelhouse; "
                        "holding every locked wheel means no network at all)")
    p.add_argument("--ca-bundle", type=Path, metavar="FILE",
                   help="extra CA bundle trusted by the wheel downloads (never by the image)")
    p.add_argument("--json", action="store_true", help="print the build record as JSON")
    p.add_argument("--progress", choices=("auto", "tty", "plain"), default="auto", help="live view on a terminal or plain lines (default auto)")
    p.add_argument("--no-cache", action="store_true", help="build every layer again")
    p.set_defaults(func=cli.cmd_build)
