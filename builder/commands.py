"""Registers the CLI commands of the later stages (lock, engine, base, build, reference, gate, ...)."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add every stage's subcommands; each stage module owns its own arguments and handler."""
    from builder.compat_refresh import add_commands as add_compat_refresh
    from builder.publish_cli import add_commands as add_publish
    from builder.watch import add_commands as add_watch
    from gates.gate_cli import add_commands as add_gate
    from gates.reference_cli import add_commands as add_reference

    _engine_base_build(sub)
    add_reference(sub)
    add_gate(sub)
    add_publish(sub)
    add_compat_refresh(sub)
    add_watch(sub)


def _engine_base_build(sub: argparse._SubParsersAction) -> None:
    """`engine up`, `base SKU`, `build SKU` (builder/engine.py, base.py, build.py)."""
    from pathlib import Path

    from builder import cli

    p = sub.add_parser("engine", help="the Docker engine: `engine up` starts (and if needed installs) it")
    esub = p.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    q = esub.add_parser("up", help="make sure a Docker engine answers; never touches a running one")
    q.add_argument("--deadline", type=float, default=60, metavar="S", help="seconds to wait for the socket (default 60)")
    q.add_argument("--json", action="store_true", help="print what was done as JSON")
    q.set_defaults(func=cli.cmd_engine_up)

    p = sub.add_parser("base", help="make the SKU's base image locally (debootstrap + docker import) or pull it by digest")
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.set_defaults(func=cli.cmd_base)

    p = sub.add_parser(
        "build", help="build, verify (image's pip list == lock) and tag a SKU's image",
        description="Render the SKU's Dockerfile from its lock and build it with BuildKit, one step per pin "
                    "after its locked dependencies (pip --no-deps --require-hashes), so a point release "
                    "rebuilds only its own step and those above. Each pip step compiles bytecode for the "
                    "files it installed with builder/bytecode.py, reusing unchanged files' code from a "
                    "BuildKit cache mount. The build context is kept in .skupin/contexts/<sku> (locked "
                    "while a build uses it) so BuildKit re-sends only what changed. After the build the "
                    "image's own Python must report exactly the locked set; only then is the image "
                    "tagged and the record written to .skupin/builds/<sku>.json (with per-layer and "
                    "per-phase times).",
    )
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", help="local wheels the lock takes from a wheelhouse")
    p.add_argument("--ca-bundle", type=Path, metavar="FILE", help="extra CA bundle trusted by pip during the build only")
    p.add_argument("--json", action="store_true", help="print the build record as JSON")
    p.add_argument("--progress", choices=("auto", "tty", "plain"), default="auto", help="live view on a terminal or plain lines (default auto)")
    p.add_argument("--no-cache", action="store_true", help="build every layer again")
    p.set_defaults(func=cli.cmd_build)
