"""Commands of point releases: `watch` (coupled bumps the update policies allow) and `compat refresh`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from skupin.cli.output import emit, out
from skupin.common.paths import PYPI_SIMPLE, env_wheelhouse

if TYPE_CHECKING:
    from skupin.builder.catalog.manifest import SkuManifest


def cmd_watch(args: argparse.Namespace) -> int:
    from skupin.builder.lock import default_ca_bundle
    from skupin.releases.watch import markdown, relock, text_report, watch

    relock_fn = None
    if args.apply and not args.no_lock:
        from skupin.builder.aptlock import host_facts
        from skupin.dockerd import connect

        def relock_fn(manifest: SkuManifest,
                      path: Path) -> None:  # as `skupin lock` does: the base's layer and apt versions recorded
            docker = connect()
            try:
                relock(manifest, path, wheelhouse=args.wheelhouse, index_url=args.index_url,
                       host=host_facts(manifest=manifest, docker=docker, on_event=lambda _msg: None))
            finally:
                docker.close()
    report = watch(paths=[Path(p) for p in args.paths], index_url=args.index_url, registry_url=args.registry_url,
                   apply=args.apply, relock_fn=relock_fn, ca_bundle=default_ca_bundle(),
                   compat_path=Path(args.compat) if args.compat else None)
    if args.json:
        emit(report.model_dump(mode="json"), indent=2)
    elif args.markdown:
        out(markdown(report).rstrip("\n"))
    else:
        out("\n".join(text_report(report)))
    return 9 if any(p.state == "error" for p in report.proposals) else 0


def cmd_refresh(args: argparse.Namespace) -> int:
    from skupin.builder.catalog.compat import COMPAT_PATH
    from skupin.builder.lock import default_ca_bundle
    from skupin.releases.compat_refresh import refresh

    compat = Path(args.compat) if args.compat else COMPAT_PATH
    report = refresh(index_url=args.index_url, out=Path(args.out) if args.out else compat, compat_path=compat,
                     ca_bundle=default_ca_bundle())
    if args.json:
        emit(report.model_dump(mode="json"), indent=2)
        return 0
    for line in report.skipped:
        out(f"skipped: {line}")
    out(f"{'wrote' if report.changed else 'unchanged'} {report.out}: {report.torch_rows} torch rows, "
        f"{report.engine_rows} engine rows from {args.index_url} in {report.seconds:.1f} s")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`compat refresh` and `watch`."""
    p = sub.add_parser("compat", help="compatibility data: regenerate it from the packages' own metadata")
    csub = p.add_subparsers(dest="compat_command", metavar="SUBCOMMAND", required=True)
    r = csub.add_parser("refresh", help="rewrite the torch->triton/CUDA and engine->torch rows from wheel metadata")
    r.add_argument("--index-url", default=PYPI_SIMPLE, help="PEP 691 index (default: PyPI; a mirror works)")
    r.add_argument("--out", metavar="FILE", help="write here instead of builder/data/compat.yaml")
    r.add_argument("--compat", metavar="FILE", help="the compatibility file to start from (default: builder/data/compat.yaml)")
    r.add_argument("--json", action="store_true", help="a JSON report")
    r.set_defaults(func=cmd_refresh)

    p = sub.add_parser("watch", help="find point releases the update policies allow; propose (or apply) coupled bumps")
    p.add_argument("paths", nargs="*", default=[], help="manifest files or folders (default: skus/)")
    p.add_argument("--index-url", help="PEP 691 index for every pin, and for the relock with --apply (a mirror; default: "
                                       "each pin's own source)")
    p.add_argument("--registry-url", help="registry for base-image tags (default: the image's own registry)")
    p.add_argument("--apply", action="store_true", help="rewrite the manifests (comments kept) and relock them")
    p.add_argument("--no-lock", action="store_true", help="with --apply: do not relock; list the locks as stale")
    p.add_argument("--compat", metavar="FILE",
                   help="the compatibility file a bump's missing rows are read from and, with --apply, added to (derived "
                        "from the release's own Requires-Dist, as `compat refresh` does; default: builder/data/compat.yaml)")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", default=env_wheelhouse(),
                   help="wheelhouse for relocking wheelhouse pins (default $SKUPIN_WHEELHOUSE)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the report as JSON")
    out.add_argument("--markdown", action="store_true", help="the report as a pull-request body")
    p.set_defaults(func=cmd_watch)
