"""Commands of the build side: `check`, `render`, `lock`, `matrix`, `schema`, `docker up`, `base`, `build`, `wheels prune`."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from skupin.cli.output import emit, err, failure, install_missing_flag, out, progress_printer, warnings
from skupin.common.errors import SkupinError

if TYPE_CHECKING:
    from collections.abc import Callable

    from skupin.builder.catalog.stack import ResolvedStack
    from skupin.builder.check import SkuReport
    from skupin.common.errors import Problem

# ------------------------------------------------------------------ check / render / matrix / schema


def cmd_check(args: argparse.Namespace) -> int:
    """Every problem of every manifest at once: exit 2 (the manifest, or a field its gate cannot use), 3
    (compatibility) or 4 (a stale lock), else 0; warnings (a gate that would end 'uncalibrated') never change it."""
    from skupin.builder.check import check_paths, raise_for
    from skupin.common.errors import CatalogError, LockError
    from skupin.common.paths import skus_dir
    from skupin.gates.preflight import gate_checker

    reports = check_paths([Path(p) for p in args.paths], with_lock=not args.no_lock, gate_check=gate_checker())
    if not reports:
        raise CatalogError(f"no manifests (*.yaml) in {', '.join(args.paths) or skus_dir()}: nothing to check",
                           fix="write skus/<name>.yaml (docs/guide-new-accelerator.md), or name the catalog that "
                               "holds them with --root DIR")
    stale = [r.stack for r in reports if r.stack is not None and r.stack.lock_state == "stale"]
    failed: SkupinError | None = None
    try:
        raise_for(reports)
        if stale:
            raise LockError(f"{len(stale)} stale lock(s)", fix=f"skupin lock {' '.join(s.manifest.name for s in stale)}")
        code = 0
    except SkupinError as exc:
        code, failed = exc.exit_code, exc
    if args.json:  # the --json contract (skupin/cli/output.py): ok, error (every problem in error.problems), warnings
        outcome = failure(failed) if failed is not None else {"ok": True, "error": None, "warnings": warnings()}
        outcome["warnings"] = [*warnings(), *(  # each manifest's too (also under its own entry)
            f"{r.manifest.name if r.manifest else r.file}: {w.message}" + (f"; fix: {w.fix}" if w.fix else "")
            for r in reports for w in r.warnings)]
        out(json.dumps({"exit_code": code, **outcome, "manifests": [_check_json(r) for r in reports]}, indent=2))
        return code
    for report in reports:
        for problem in report.problems:
            out(str(problem))
    for report in reports:
        for warning in report.warnings:
            err(f"warning: {report.manifest.name if report.manifest else report.file}: {warning.message}"
                + (f"; fix: {warning.fix}" if warning.fix else ""))
    bad = sum(1 for r in reports if r.problems)
    if bad:
        out(f"{bad} of {len(reports)} manifest(s) have problems")
        return code
    for report in reports:
        stack = report.stack
        assert stack is not None
        note = f" ({stack.lock_note})" if stack.lock_note else ""
        out(f"{'ok ' if stack.lock_state != 'stale' else 'bad'} {stack.manifest.name:<24} lock: {stack.lock_state}{note}")
    if stale:
        out(f"{len(stale)} of {len(reports)} lock(s) are stale: a build would refuse them; fix: "
            f"skupin lock {' '.join(s.manifest.name for s in stale)}")
    return code


def _problem_json(problem: Problem) -> dict:
    return {"file": problem.file, "field": problem.field, "message": problem.message, "fix": problem.fix}


def _check_json(report: SkuReport) -> dict:
    stack = report.stack
    return {"file": report.file, "sku": report.manifest.name if report.manifest else None,
            "lock": stack.lock_state if stack else None, "lock_note": stack.lock_note if stack else "",
            "problems": [_problem_json(p) for p in report.problems],
            "warnings": [_problem_json(w) for w in report.warnings]}


def cmd_render(args: argparse.Namespace) -> int:
    from skupin.builder.check import resolve
    from skupin.builder.render import render, render_manifest, write_context
    from skupin.common.paths import sku_path

    if args.out:
        _writable_folder(Path(args.out))
    stack = resolve(sku_path(args.sku))
    lock = None if args.unlocked else stack.current_lock
    rendered = render_manifest(manifest=stack.manifest) if args.unlocked else render(stack)
    if args.out:
        stored = {}
        if lock is not None:  # a locked context holds each step's wheels: `docker build DIR` needs no network
            from skupin.builder.wheels import fetch_wheels

            stored = fetch_wheels((*lock.packages().values(), *lock.build), wheelhouse=args.wheelhouse,
                                  ca_bundle=args.ca_bundle, on_event=lambda line: print(line, file=sys.stderr))
        folder = write_context(rendered=rendered, out=Path(args.out), wheels=stored)
        if args.json:
            emit({"sku": stack.manifest.name, "dockerfile": str(folder / "Dockerfile"), "sha256": rendered.sha256,
                  "files": len(rendered.files), "wheels": len(stored)})
            return 0
        out(f"wrote {folder / 'Dockerfile'} and {len(rendered.files)} context file(s) and {len(stored)} wheel(s); "
             f"sha256 {rendered.sha256}")
    else:
        sys.stdout.write(rendered.text)
    return 0


def _writable_folder(path: Path) -> None:
    """--out must be a folder (made when missing) this user can write, outside /proc, /sys and /dev: checked before
    anything is rendered or fetched, so a bad target costs nothing."""
    from skupin.common.errors import UsageError

    resolved = path.resolve()
    if any(resolved.is_relative_to(system) for system in ("/proc", "/sys", "/dev")):
        raise UsageError(f"--out {path}: a system folder, not a build context; fix: name a folder of your own")
    if resolved.exists() and not resolved.is_dir():
        raise UsageError(f"--out {path}: exists and is not a folder; fix: name a folder (it is made when missing)")
    existing = next(p for p in (resolved, *resolved.parents) if p.exists())
    import os

    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: {existing} cannot be written here; fix: name a folder you can write")


def cmd_matrix(args: argparse.Namespace) -> int:
    from skupin.builder.check import check_paths, raise_for
    from skupin.builder.matrix import plan_matrix, summary_markdown
    from skupin.gates.preflight import gate_checker

    reports = check_paths([Path(p) for p in args.paths], gate_check=gate_checker())
    raise_for(reports)
    stacks = [r.stack for r in reports if r.stack]
    # the gate's own warning: no calibrated tolerance for the SKU's key, so its gate would end 'uncalibrated'
    why = {r.stack.manifest.name: "; ".join(f"{w.message}; fix: {w.fix}" if w.fix else w.message for w in r.warnings)
           for r in reports if r.stack and r.warnings}
    version_tag = published = None
    if args.skip_published:
        version_tag, published = _published_probe(args.skip_published)
    wheelhouse = Path(args.wheelhouse) if args.wheelhouse else None
    plan = plan_matrix(stacks, wheelhouse=wheelhouse, version_tag=version_tag, published=published,
                       uncalibrated=lambda stack: why.get(stack.manifest.name),
                       include_uncalibrated=args.include_uncalibrated)
    data = {"matrix": plan.strategy(), "excluded": [e.model_dump() for e in plan.excluded],
            "current": [c.model_dump() for c in plan.current]}
    if args.github_output:
        with open(args.github_output, "a", encoding="utf-8") as handle:
            handle.write(f"matrix={json.dumps(plan.strategy(), separators=(',', ':'))}\n")
            handle.write(f"count={len(plan.include)}\n")
    if args.summary:
        with open(args.summary, "a", encoding="utf-8") as handle:
            handle.write(summary_markdown(plan))
    out(json.dumps(data, indent=None if args.compact else 2))
    return 0


def _published_probe(registry: str) -> tuple[Callable[[ResolvedStack], str], Callable[[str, str], bool]]:
    """(version_tag(stack), published(sku, tag)) against REGISTRY: a version tag is published only when the registry
    holds it and its digest carries a verification attestation a trusted key signed for that SKU and lock. Anyone who
    may push can put something under the next tag (it can be computed from the repository): such a squatted tag is
    not published, so the SKU is built, gated and published over it (publish replaces it, saying so)."""
    from skupin.builder.render import render
    from skupin.clients.oci import RegistryClient
    from skupin.common.errors import NetworkError
    from skupin.publishing.attest import trusted_keys
    from skupin.publishing.publish import attested_for, parse_target, version_tag

    target = parse_target(registry)
    client = RegistryClient(target.url)
    trusted = trusted_keys()
    locks: dict[tuple[str, str], str] = {}  # (sku, version tag) -> the lock hash it was computed from

    def tag_of(stack: ResolvedStack) -> str:
        rendered = render(stack)
        assert stack.lock is not None
        tag = version_tag(sku=stack.manifest.name, engine_version=stack.manifest.stack.engine.version,
                          lock=stack.lock, dockerfile_sha256=rendered.sha256)
        locks[(stack.manifest.name, tag)] = stack.lock.content_hash()
        return tag

    def published(sku: str, tag: str) -> bool:
        repository = target.repository(sku)
        try:
            held = client.find_manifest(repository, tag)
            if held is None or (sku, tag) not in locks:
                return False
            return attested_for(client=client, repository=repository, held=held, sku=sku,
                                lock_sha256=locks[(sku, tag)], trusted=trusted)
        except NetworkError as exc:
            raise NetworkError(f"--skip-published {registry}: cannot ask for {sku}:{tag}: {exc}") from exc

    return tag_of, published


def cmd_schema(args: argparse.Namespace) -> int:
    from skupin.builder.catalog.manifest import manifest_schema

    text = json.dumps(manifest_schema(), indent=2, sort_keys=True) + "\n"
    if args.write:
        from skupin.common.paths import skus_dir

        (skus_dir() / "schema.json").write_text(text, encoding="utf-8")
        out(f"wrote {skus_dir() / 'schema.json'}")
    else:
        sys.stdout.write(text)
    return 0


def _prefixed(name: str, line: str) -> None:
    print(f"{name}: {line}", file=sys.stderr, flush=True)


def cmd_lock(args: argparse.Namespace) -> int:
    from skupin.builder.catalog.lockfile import lock_path, sku_image_tag
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.builder.lock import default_ca_bundle, default_resolver, relock, relock_host
    from skupin.builder.render import render_manifest
    from skupin.common.errors import UsageError
    from skupin.common.paths import sku_path

    if args.keep_python and args.apt != "resolve":
        raise UsageError("--keep-python remakes only the lock's apt part and base layer, which --apt manifest does not "
                         "read; fix: drop one of them")
    resolve = default_resolver(ca_bundle=args.ca_bundle or default_ca_bundle(), prefer=args.resolver)
    docker = None
    if args.apt == "resolve":
        from skupin.dockerd import connect

        docker = connect()
    for sku in args.skus:
        path = sku_path(sku)
        manifest = load_manifest(path)
        say = functools.partial(_prefixed, manifest.name)
        host = None
        if docker is not None:
            from skupin.builder.aptlock import host_facts

            host = host_facts(manifest=manifest, docker=docker, on_event=say)
        if args.keep_python:
            assert host is not None
            lock = relock_host(manifest=manifest, manifest_path=path, host=host)
        else:
            lock = relock(
                manifest=manifest, manifest_path=path, wheelhouse=args.wheelhouse, index_url=args.index_url,
                ca_bundle=args.ca_bundle, resolve=resolve, progress=say, host=host,
            )
        counts = ", ".join(f"{layer} {len(pkgs)}" for layer, pkgs in lock.layers.items())
        tag = sku_image_tag(manifest, lock=lock, dockerfile_sha256=render_manifest(manifest=manifest, lock=lock).sha256)
        if args.json:
            emit({"sku": manifest.name, "lock": str(lock_path(path)), "lock_sha256": lock.content_hash(),
                  "packages": len(lock.packages()), "layers": {k: len(v) for k, v in lock.layers.items()},
                  "image": tag})  # one object per SKU, each under the contract
        else:
            out(f"locked {manifest.name}: {len(lock.packages())} packages ({counts}) -> {lock_path(path)}; image {tag}")
    return 0


# ------------------------------------------------------------------ engine / base / build


def cmd_docker_up(args: argparse.Namespace) -> int:
    from skupin.dockerd import connect, ensure_dockerd

    status = ensure_dockerd(deadline_s=args.deadline, on_event=progress_printer("plain"))
    docker = connect()
    try:
        reaped = docker.reap_orphans()
    finally:
        docker.close()
    if args.json:
        emit({**status.model_dump(mode="json"), "reaped": [r.model_dump(mode="json") for r in reaped]})
        return 0
    out(f"engine {status.server_version} on {status.socket}: {status.action}")
    for leftover in reaped:
        out(f"removed a leftover container: {leftover.describe()}")
    if not reaped:
        out("no leftover containers of dead skupin runs")
    return 0


def cmd_base(args: argparse.Namespace) -> int:
    from skupin.builder.base import ensure_base
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.common.paths import sku_path
    from skupin.dockerd import connect

    manifest = load_manifest(sku_path(args.sku))
    image_id = ensure_base(manifest=manifest, docker=connect(), on_event=progress_printer("plain"))
    if args.json:
        emit({"sku": manifest.name, "base": manifest.base.reference, "image_id": image_id})
    else:
        out(image_id)
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from skupin.builder.build import build
    from skupin.builder.check import resolve
    from skupin.builder.render import render
    from skupin.common.paths import ensure_state, sku_path, state_dir
    from skupin.dockerd import connect

    stack = resolve(sku_path(args.sku))
    ensure_state()
    mode: Literal["tty", "plain"] = "tty" if args.progress == "tty" or (args.progress == "auto" and sys.stderr.isatty()) \
        else "plain"
    built = build(
        render(stack), connect(),
        wheelhouse=args.wheelhouse, ca_bundle=args.ca_bundle, progress=mode,
        on_line=progress_printer(mode), no_cache=args.no_cache, records=state_dir() / "builds", cache=args.cache,
    )
    if mode == "tty":
        sys.stderr.write("\n")
    if args.json:
        emit(built.model_dump(mode="json"), indent=2, sort_keys=True)
    else:
        for layer in built.layers:
            out(f"  {layer.name:<10} {layer.seconds:8.1f} s  {'cached' if layer.cached else 'built'}")
        made = f"reused {built.fetched} as" if built.fetched else "built"
        out(
            f"{made} {built.image} ({built.image_id[:19]}) in {built.total_s:.1f} s; "
            f"record {state_dir() / 'builds' / (built.sku + '.json')}"
        )
    return 0


def cmd_wheels(args: argparse.Namespace) -> int:
    """`skupin wheels prune`: drop stored wheels that no lock under the given paths names."""
    from skupin.builder.catalog.lockfile import lock_path, read_lock
    from skupin.builder.sourcebuild import read_built
    from skupin.builder.wheels import prune_store, wheel_store
    from skupin.common.paths import manifest_files

    keep: set[str] = set()
    locks = [lock_path(m) for m in manifest_files([Path(p) for p in args.paths])]
    for path in locks:
        if path.is_file():
            lock = read_lock(path)
            keep |= {p.sha256 for p in (*lock.packages().values(), *lock.build)}
            built = read_built(lock) if lock.sources() else None  # the wheel this host built from its sdist
            if built is not None:
                keep.add(built.wheel.sha256)
    store = Path(args.store) if args.store else wheel_store()
    stored = sum(1 for _ in store.glob("??/*/*"))
    removed, size = prune_store(store, keep=keep, dry_run=args.dry_run)
    if args.json:
        emit({"store": str(store), "dry_run": args.dry_run, "removed": [p.name for p in removed], "bytes": size,
              "kept": stored - len(removed), "locks": sum(1 for p in locks if p.is_file())})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        out(f"{verb} {path.name}")
    out(f"{verb} {len(removed)} file(s), {size / 1e6:.1f} MB; {stored - len(removed)} wheel(s) kept in {store}, "
        f"named by {sum(1 for p in locks if p.is_file())} lock(s)")
    return 0


# ------------------------------------------------------------------ parsers


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add the build side's commands to the `skupin` parser."""
    from skupin.common.paths import env_wheelhouse

    p = sub.add_parser("check", help="validate manifests, pin compatibility and locks; report every problem "
                                     "(exit 2 manifest, 3 compatibility, 4 a stale lock)")
    p.add_argument("paths", nargs="*", default=[],
                   help="SKU names, manifest files or folders (default: the catalog's skus/)")
    p.add_argument("--no-lock", action="store_true", help="skip the lock freshness check")
    p.add_argument("--json", action="store_true", help="print every manifest's problems and lock state as JSON")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("render", help="print a SKU's Dockerfile (no Docker daemon needed)")
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--out", metavar="DIR", help="write the Dockerfile and its context files to DIR instead")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", default=env_wheelhouse(),
                   help="with --out: take locked wheels from DIR first (default $SKUPIN_WHEELHOUSE); the rest are "
                        "downloaded into the wheel store (.skupin/wheels), checked against the lock")
    p.add_argument("--ca-bundle", type=Path, metavar="FILE", help="with --out: CA bundle the wheel downloads trust")
    p.add_argument("--unlocked", action="store_true", help="render from the pins alone, ignoring the lock")
    p.add_argument("--json", action="store_true", help="with --out: print what was written as JSON")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("lock", help="resolve each layer's Python packages (uv or pip, every file hashed) into "
                                    "skus/<sku>.lock.json")
    p.add_argument("skus", nargs="+", metavar="SKU", help="SKU names (skus/<name>.yaml) or manifest paths")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", default=env_wheelhouse(),
                   help="local wheels, preferred over the index (e.g. /opt/wheels; default $SKUPIN_WHEELHOUSE)")
    p.add_argument("--index-url", metavar="URL", help="a mirror used instead of PyPI")
    p.add_argument("--ca-bundle", type=Path, metavar="FILE", help="CA bundle pip trusts (default: SSL_CERT_FILE or the system's)")
    p.add_argument("--resolver", choices=("uv", "pip"), default="uv",
                   help="uv (default; 1.67x uv pip compile's own time, pip's resolver 4.9x: docs/BENCHMARKS.md) or pip's "
                        "own resolver; direct URL requirements always go to pip")
    p.add_argument("--apt", choices=("resolve", "manifest"), default="resolve",
                   help="resolve (default): make or find the base on the Docker engine, record a bootstrapped base's "
                        "layer diff id and the exact version of every apt package the Dockerfile installs (apt-cache "
                        "policy in the base) and of every package they pull in, per layer (the apt closure: apt-get "
                        "install -s in the base); manifest: no Docker, only the manifest's apt versions (older locks' "
                        "form)")
    p.add_argument("--keep-python", action="store_true",
                   help="remake only what the host decides (the bootstrapped base's layer, the apt versions and "
                        "closure) and keep the current lock's Python packages as they are, no resolver run (after a "
                        "Debian point release); refused when the lock is stale for another reason")
    p.add_argument("--json", action="store_true", help="print one JSON line per lock written")
    install_missing_flag(p)
    p.set_defaults(func=cmd_lock)

    p = sub.add_parser("matrix", help="the CI matrix as JSON: the SKUs to build with their runner labels; the others "
                                      "with why they are left out")
    p.add_argument("paths", nargs="*", default=[], help="manifest files or folders (default: skus/)")
    p.add_argument("--compact", action="store_true", help="one line")
    p.add_argument("--wheelhouse", metavar="DIR", help="a wheelhouse the runners have (default: none, as on GitHub-hosted "
                                                      "runners): wheels locked without a URL are found there")
    p.add_argument("--skip-published", metavar="REGISTRY",
                   help="leave out (as `current`) every SKU whose version tag REGISTRY already holds with an "
                        "attestation a trusted key signed for that SKU and lock (an unattested tag is squatted: rebuilt)")
    p.add_argument("--github-output", metavar="FILE", help="append matrix=<strategy JSON> and count=N (for $GITHUB_OUTPUT)")
    p.add_argument("--summary", metavar="FILE", help="append the plan as a Markdown table (for $GITHUB_STEP_SUMMARY)")
    p.add_argument("--include-uncalibrated", action="store_true",
                   help="also send SKUs whose gate would end 'uncalibrated' (no calibrated tolerance for their key: exit "
                        "14, never a pass) to their GPU runners, e.g. to build them for `skupin calibrate`; by default "
                        "they are left out, with why")
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("schema", help="the manifest's JSON Schema (for editors)")
    p.add_argument("--write", action="store_true", help="write skus/schema.json instead of printing")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("docker", aliases=["engine"],
                       help="the Docker daemon: `docker up` starts it (installs it with --install-missing) and removes leftovers")
    esub = p.add_subparsers(dest="docker_command", metavar="ACTION", required=True)
    q = esub.add_parser("up", help="make sure a Docker daemon answers (never touches a running one) and remove the "
                                   "sandbox containers of dead skupin runs",
                        description="Start dockerd when nothing answers on /var/run/docker.sock (installing Debian's "
                                    "docker.io first only with --install-missing); a daemon that answers is left as it "
                                    "is, and an engine named by DOCKER_HOST or a Docker context is only asked. "
                                    "Then remove the sandbox containers whose "
                                    "owner process is gone (killed gate, lost Docker API) and say which.")
    q.add_argument("--deadline", type=float, default=60, metavar="S", help="seconds to wait for the socket (default 60)")
    q.add_argument("--json", action="store_true", help="print what was done as JSON")
    install_missing_flag(q)
    q.set_defaults(func=cmd_docker_up)

    p = sub.add_parser("base", help="make the SKU's base image locally (debootstrap + docker import) or pull it by digest")
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    install_missing_flag(p)
    p.add_argument("--json", action="store_true", help="print the SKU, its base reference and the image id as JSON")
    p.set_defaults(func=cmd_base)

    p = sub.add_parser(
        "build",
        help="build, verify (image's pip list == lock) and tag a SKU's image",
        description="Gather every locked wheel in the host's wheel store (.skupin/wheels: taken from "
        "--wheelhouse or downloaded, each checked against the lock's sha256), render the SKU's "
        "Dockerfile from its lock and build it with BuildKit, one step per pin after its locked "
        "dependencies, so a point release rebuilds only its own step and those above. Each step "
        "binds exactly its wheels and installs them with skupin/imagetools/wheel_install.py (hashes checked "
        "again, pypa installer, no resolver, no network), compiling each Python file as it is "
        "written with skupin/imagetools/bytecode.py (unchanged files' code comes from a BuildKit cache "
        "mount). The build context is kept in .skupin/contexts/<sku> (locked while a build uses it) so BuildKit "
        "re-sends only what changed. BuildKit's image is then normalised (every mtime clamped to one epoch, "
        "one config `created`), so the same lock gives the same image id on any machine (docs/REPRODUCIBLE.md). "
        "After the build the image's own Python must report exactly the locked set; only then is the image "
        "tagged and the record written to .skupin/builds/<sku>.json (with per-layer and "
        "per-phase times).",
    )
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", default=env_wheelhouse(),
                   help="local wheels, used before any download (needed for wheels locked from a wheelhouse; "
                        "holding every locked wheel means no network at all; default $SKUPIN_WHEELHOUSE)")
    p.add_argument(
        "--ca-bundle", type=Path, metavar="FILE", help="extra CA bundle trusted by the wheel downloads (never by the image)"
    )
    p.add_argument("--json", action="store_true", help="print the build record as JSON")
    p.add_argument("--progress", choices=("auto", "tty", "plain"), default="auto",
                   help="live view on a terminal or plain lines (default auto)")
    p.add_argument("--no-cache", action="store_true", help="build every layer again")
    p.add_argument("--cache", metavar="REF",
                   help="a registry cache for runners without local state, e.g. ghcr.io/acme/skupin-staging/"
                        "cpu-x86_64:buildcache: the image a build of the same inputs pushed to REF-<input hash> is "
                        "pulled and nothing is built; else BuildKit reuses the steps REF's inline cache holds (a point "
                        "release: every layer below the changed pin). After a verified build both are pushed there. "
                        "The image is the same with or without it; trusted as far as whoever can write REF "
                        "(docs/REPRODUCIBLE.md)")
    install_missing_flag(p)
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("wheels", help="the wheel store (.skupin/wheels) that builds gather locked wheels into")
    wsub = p.add_subparsers(dest="wheels_command", metavar="SUBCOMMAND", required=True)
    r = wsub.add_parser(
        "prune",
        help="remove stored wheels that no lock names",
        description="Remove every wheel in the store whose sha256 is in none of the locks next to "
        "the given manifests (default: skus/), and partial downloads. The next build of "
        "a SKU whose lock names a removed wheel downloads it again.",
    )
    r.add_argument("paths", nargs="*", default=[],
                   help="manifest files or folders whose locks keep their wheels (default: skus/)")
    r.add_argument("--store", metavar="DIR", help="the store (default: .skupin/wheels, or $SKUPIN_STATE/wheels)")
    r.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    r.add_argument("--json", action="store_true", help="print what was (or would be) removed and kept as JSON")
    r.set_defaults(func=cmd_wheels)
