"""The `skupin` command line: parse arguments, call one stage per command, map errors to exit codes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from common import __version__
from common.errors import SkupinError

EPILOG = """\
the flow:  check -> lock -> render -> build -> gate -> publish
exit codes: 0 ok, 2 manifest error, 3 incompatible pins, 4 lock, 5 build, 6 docker engine,
            7 reference bundle, 8 publish, 9 network/index, 10 gate failed, 11 gate could not run
examples:
  skupin check                      check every manifest in skus/
  skupin render cpu-x86_64          print the CPU SKU's Dockerfile (no Docker needed)
  skupin matrix                     the CI matrix as JSON
"""

Handler = Callable[[argparse.Namespace], int]


def _out(line: str = "") -> None:
    print(line, flush=True)


# ------------------------------------------------------------------ check / render / matrix / schema


def cmd_check(args: argparse.Namespace) -> int:
    from builder.check import check_paths, raise_for

    reports = check_paths([Path(p) for p in args.paths], with_lock=not args.no_lock)
    if not reports:
        raise SkupinError(f"no manifests found in {', '.join(args.paths) or 'skus/'}")
    for report in reports:
        for problem in report.manifest_problems + report.compat_problems:
            _out(str(problem))
    try:
        raise_for(reports)
    except SkupinError as exc:
        bad = sum(1 for r in reports if r.manifest_problems or r.compat_problems)
        _out(f"{bad} of {len(reports)} manifest(s) have problems")
        return exc.exit_code
    for report in reports:
        stack = report.stack
        assert stack is not None
        note = f" ({stack.lock_note})" if stack.lock_note else ""
        _out(f"ok  {stack.manifest.name:<24} lock: {stack.lock_state}{note}")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from builder.check import resolve
    from common.paths import sku_path
    from builder.render import render, write_context

    stack = resolve(sku_path(args.sku))
    lock = None if args.unlocked else stack.lock if stack.lock_state == "ok" else None
    rendered = render(manifest=stack.manifest, lock=lock)
    if args.out:
        stored = {}
        if lock is not None:  # a locked context holds each step's wheels: `docker build DIR` needs no network
            from builder.wheels import fetch_wheels

            stored = fetch_wheels(lock.packages().values(), wheelhouse=args.wheelhouse,
                                  ca_bundle=args.ca_bundle, on_event=lambda line: print(line, file=sys.stderr))
        out = write_context(rendered=rendered, out=Path(args.out), wheels=stored)
        _out(f"wrote {out / 'Dockerfile'} and {len(rendered.files)} context file(s) and {len(stored)} wheel(s); "
             f"sha256 {rendered.sha256}")
    else:
        sys.stdout.write(rendered.text)
    return 0


def cmd_matrix(args: argparse.Namespace) -> int:
    from builder.check import check_paths, raise_for
    from builder.matrix import matrix

    reports = check_paths([Path(p) for p in args.paths], with_lock=False)
    raise_for(reports)
    entries = matrix(manifests=[r.stack.manifest for r in reports if r.stack])
    _out(json.dumps(entries, indent=None if args.compact else 2))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from builder.manifest import manifest_schema

    text = json.dumps(manifest_schema(), indent=2, sort_keys=True) + "\n"
    if args.write:
        from common.paths import SKUS

        (SKUS / "schema.json").write_text(text, encoding="utf-8")
        _out(f"wrote {SKUS / 'schema.json'}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_lock(args: argparse.Namespace) -> int:
    from builder.lock import relock
    from builder.lockfile import image_tag, lock_path
    from builder.manifest import load_manifest
    from common.paths import sku_path

    for sku in args.skus:
        path = sku_path(sku)
        manifest = load_manifest(path)
        lock = relock(
            manifest=manifest, manifest_path=path, wheelhouse=args.wheelhouse, index_url=args.index_url,
            ca_bundle=args.ca_bundle,
            progress=lambda line, name=manifest.name: print(f"{name}: {line}", file=sys.stderr, flush=True),
        )
        counts = ", ".join(f"{layer} {len(pkgs)}" for layer, pkgs in lock.layers.items())
        tag = image_tag(sku=manifest.name, engine_version=manifest.stack.engine.version, lock=lock)
        _out(f"locked {manifest.name}: {len(lock.packages())} packages ({counts}) -> {lock_path(path)}; image {tag}")
    return 0


# ------------------------------------------------------------------ engine / base / build


def _progress_printer(mode: str) -> Callable[[str], None]:
    """Progress to stderr: one rewritten status line on a terminal, plain lines otherwise."""
    if mode == "tty":
        def show(line: str) -> None:
            sys.stderr.write("\r\x1b[K" + line[:200])
            sys.stderr.flush()
        return show
    return lambda line: print(line, file=sys.stderr, flush=True)


def cmd_engine_up(args: argparse.Namespace) -> int:
    from dockerd.client import connect, ensure_engine

    status = ensure_engine(deadline_s=args.deadline, on_event=_progress_printer("plain"))
    engine = connect(socket=Path(status.socket))
    try:
        reaped = engine.reap_orphans()
    finally:
        engine.close()
    if args.json:
        _out(json.dumps({**status.model_dump(mode="json"), "reaped": [r.model_dump(mode="json") for r in reaped]}))
        return 0
    _out(f"engine {status.server_version} on {status.socket}: {status.action}")
    for leftover in reaped:
        _out(f"removed a leftover container: {leftover.describe()}")
    if not reaped:
        _out("no leftover containers of dead skupin runs")
    return 0


def cmd_base(args: argparse.Namespace) -> int:
    from builder.base import ensure_base
    from dockerd.client import connect
    from builder.manifest import load_manifest
    from common.paths import sku_path

    manifest = load_manifest(sku_path(args.sku))
    image_id = ensure_base(manifest=manifest, engine=connect(), on_event=_progress_printer("plain"))
    _out(image_id)
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from builder.build import build_image
    from dockerd.client import connect
    from builder.lockfile import lock_path, read_lock
    from builder.manifest import load_manifest
    from common.paths import STATE, sku_path

    path = sku_path(args.sku)
    manifest = load_manifest(path)
    lock = read_lock(lock_path(path))
    mode = args.progress if args.progress != "auto" else ("tty" if sys.stderr.isatty() else "plain")
    built = build_image(
        manifest=manifest, manifest_path=path, lock=lock, engine=connect(),
        wheelhouse=args.wheelhouse, ca_bundle=args.ca_bundle, progress=mode,
        on_line=_progress_printer(mode), no_cache=args.no_cache, records=STATE / "builds",
    )
    if mode == "tty":
        sys.stderr.write("\n")
    if args.json:
        _out(json.dumps(built.model_dump(mode="json"), indent=2, sort_keys=True))
    else:
        for layer in built.layers:
            _out(f"  {layer.name:<10} {layer.seconds:8.1f} s  {'cached' if layer.cached else 'built'}")
        _out(f"built {built.image} ({built.image_id[:19]}) in {built.total_s:.1f} s; record {STATE / 'builds' / (built.sku + '.json')}")
    return 0


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skupin",
        description="Per-SKU LLM inference images: pin driver, framework, compiler and engine together, "
        "build, gate the outputs against NVIDIA reference tensors, publish by digest.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"skupin {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("check", help="validate manifests, pin compatibility and locks; report every problem")
    p.add_argument("paths", nargs="*", default=[], help="manifest files or folders (default: skus/)")
    p.add_argument("--no-lock", action="store_true", help="skip the lock freshness check")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("render", help="print a SKU's Dockerfile (no Docker daemon needed)")
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--out", metavar="DIR", help="write the Dockerfile and its context files to DIR instead")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR",
                   help="with --out: take locked wheels from DIR first; the rest are downloaded into the wheel store "
                        "(.skupin/wheels), checked against the lock")
    p.add_argument("--ca-bundle", type=Path, metavar="FILE", help="with --out: CA bundle the wheel downloads trust")
    p.add_argument("--unlocked", action="store_true", help="render from the pins alone, ignoring the lock")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("lock", help="resolve each layer's Python packages (pip, hashed) into skus/<sku>.lock.json")
    p.add_argument("skus", nargs="+", metavar="SKU", help="SKU names (skus/<name>.yaml) or manifest paths")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", help="local wheels, preferred over the index (e.g. /opt/wheels)")
    p.add_argument("--index-url", metavar="URL", help="a mirror used instead of PyPI")
    p.add_argument("--ca-bundle", type=Path, metavar="FILE", help="CA bundle pip trusts (default: SSL_CERT_FILE or the system's)")
    p.set_defaults(func=cmd_lock)

    p = sub.add_parser("matrix", help="the CI matrix as JSON: one entry per SKU with runner labels")
    p.add_argument("paths", nargs="*", default=[], help="manifest files or folders (default: skus/)")
    p.add_argument("--compact", action="store_true", help="one line (for GITHUB_OUTPUT)")
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("schema", help="the manifest's JSON Schema (for editors)")
    p.add_argument("--write", action="store_true", help="write skus/schema.json instead of printing")
    p.set_defaults(func=cmd_schema)

    from skupin.cli import commands  # the other stages' commands, each with a lazily imported handler

    commands.add_commands(sub)
    return parser


def _sigterm_as_interrupt() -> None:
    """A cancelled CI job sends SIGTERM: unwind like Ctrl-C so builds and containers are cleaned up."""
    import signal

    def handler(_signum, _frame):
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
        return args.func(args)
    except SkupinError as exc:
        if args.traceback:
            raise
        for line in exc.lines():
            print(f"error: {line}" if not exc.problems else line, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
