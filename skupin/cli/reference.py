"""CLI commands for reference bundles and fixtures: `reference capture|verify` and `fixture generate`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from skupin.cli.output import emit
from skupin.common.errors import SkupinError
from skupin.engines import ALL_ENGINES, DEFAULT_ENGINE, probe_adapter

if TYPE_CHECKING:
    from skupin.builder.catalog.manifest import SkuManifest


def _sku_manifest(sku: str) -> SkuManifest:
    """Load a SKU given by name (skus/<name>.yaml) or by path; ManifestError (with a hint) when there is none."""
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.common.paths import sku_path

    return load_manifest(sku_path(sku))


def cmd_reference_capture(args: argparse.Namespace) -> int:
    from skupin.gates.refdata.bundle import capture

    manifest = _sku_manifest(args.sku)
    out = capture(manifest=manifest, out=Path(args.out), dtype=args.dtype, batch_size=args.batch_size,
                  model_dir=Path(args.model_dir) if args.model_dir else None, engine=probe_adapter(args.engine),
                  full_logprobs=args.full_logprobs, threads=args.threads, model=args.model, command=["skupin", *sys.argv[1:]])
    meta = json.loads((out / "meta.json").read_text())  # capture() has just verified the bundle
    if args.json:
        emit({"bundle": str(out), "meta": meta})
        return 0
    gpu = meta["gpu"]
    print(f"captured {out}: {meta['model']['name']} {meta['dtype']} batch {meta['batch_size']} on {gpu['name']} "
          f"(driver {meta['driver']}, cuda {meta['cuda']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"{meta['engine']['name']} {meta['engine']['version']})")
    return 0


def bundle_folder(folder: str) -> Path:
    """The bundle a `reference verify` argument names: the folder as given when it exists, else a catalog-relative path
    ("gates/references/tiny-llama/h200-bfloat16") read as a manifest's gate.reference is: the catalog's copy when the
    catalog holds one, else the bundle shipped inside skupin (skupin.common.paths.data_path)."""
    from skupin.common.paths import data_path

    given = Path(folder)
    if given.exists() or given.is_symlink() or given.is_absolute():
        return given
    return data_path(given)


def cmd_reference_verify(args: argparse.Namespace) -> int:
    from skupin.gates.refdata.bundle import check_fits, verify

    folder = bundle_folder(args.folder)
    meta = verify(folder=folder)
    if args.sku:
        check_fits(meta=meta, manifest=_sku_manifest(args.sku))
    if args.json:
        emit({"bundle": str(folder), "meta": meta})
        return 0
    print(f"ok  {folder}: {meta['model']['name']} {meta['dtype']} on {meta['gpu']['name']} "
          f"(driver {meta['driver']}, torch {meta['torch']}, {meta['engine']['name']} {meta['engine']['version']}, "
          f"captured {meta['created']})")
    return 0


def fixture_destination(name: str, out: str | None, *, check: bool) -> Path:
    """Where `fixture generate` writes (or `--check` reads): `--out`, else the catalog's gates/fixtures/<name>, never the
    installed package's folder. `--check` without `--out` checks the catalog's copy when it holds one, else the shipped one."""
    from skupin.common.errors import UsageError
    from skupin.common.paths import NO_CATALOG_FIX, data_path, find_catalog

    if out:
        return Path(out)
    rel = Path("gates") / "fixtures" / name
    if check:
        return data_path(rel)
    found = find_catalog()
    if found is None:
        raise UsageError(f"no catalog to write gates/fixtures/{name} into (no skus/ folder in {Path.cwd()} or any parent)",
                         fix=f"pass --out DIR, or {NO_CATALOG_FIX}")
    return found / rel


def cmd_fixture_generate(args: argparse.Namespace) -> int:
    from skupin.gates.refdata import fixture

    out = fixture_destination(args.name, args.out, check=args.check)
    if args.check:
        hashes = fixture.check_fixture(name=args.name, folder=out)
        if args.json:
            emit({"fixture": args.name, "folder": str(out), "files": hashes, "written": False})
            return 0
        print(f"ok  {out}: fixture {args.name} matches its recorded sha256 ({fixture.digest_of(hashes)})")
        return 0
    hashes = fixture.generate_fixture(name=args.name, out=out)
    if args.json:
        emit({"fixture": args.name, "folder": str(out), "files": hashes, "written": True})
        return 0
    for name, digest in sorted(hashes.items()):
        print(f"{digest}  {name}")
    print(f"wrote {out}: fixture {args.name}, digest {fixture.digest_of(hashes)} (matches the recorded sha256)")
    return 0


# The fixtures of gates.refdata.fixture.SPECS, named here so that building the CLI does not import numpy
# (tests/unit/test_fixture.py checks the two agree).
FIXTURE_NAMES = ("deep-llama", "llama-1k", "peaked-moe", "tiny-llama", "tiny-moe")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `reference capture`, `reference verify` and `fixture generate` to the skupin CLI."""

    ref = subparsers.add_parser("reference", help="capture and verify NVIDIA reference bundles")
    ref_sub = ref.add_subparsers(dest="reference_command", metavar="ACTION", required=True)
    p = ref_sub.add_parser("capture", help="run the probe on this host and write a reference bundle (no Docker)")
    p.add_argument("--sku", required=True, help="SKU name (skus/<name>.yaml) or manifest path: gives model, dtype, batch")
    p.add_argument("--out", required=True, metavar="DIR", help="new bundle folder")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="override the SKU's gate dtype")
    p.add_argument("--batch-size", type=int, help="override the SKU's gate batch size")
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=tuple(ALL_ENGINES))
    p.add_argument("--model", choices=FIXTURE_NAMES, help="fixture to capture (default: the SKU's gate.model)")
    p.add_argument("--model-dir", metavar="DIR", help="fixture folder (default: committed or freshly generated)")
    p.add_argument("--full-logprobs", type=int, help="prompts whose full-vocab logprobs are stored (default: the "
                   "fixture's own count, 4, or 1 for peaked-moe; the gate's probe stores as many)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for the probe (0: default)")
    p.add_argument("--json", action="store_true", help="print the bundle's folder and meta.json as JSON")
    p.set_defaults(func=cmd_reference_capture)
    p = ref_sub.add_parser("verify", help="check a bundle's SHA256SUMS (and optionally its fit to a SKU)")
    p.add_argument("folder", metavar="DIR", help="the bundle's folder; a catalog-relative path that is not here "
                   "(gates/references/<model>/<bundle>) is the catalog's, else the one shipped with skupin")
    p.add_argument("--sku", help="also check model, prompt set and dtype against this SKU's gate")
    p.add_argument("--json", action="store_true", help="print the bundle's meta.json as JSON")
    p.set_defaults(func=cmd_reference_verify)

    fx = subparsers.add_parser("fixture", help="generate or check the seeded model fixtures")
    fx_sub = fx.add_subparsers(dest="fixture_command", metavar="ACTION", required=True)
    p = fx_sub.add_parser("generate", help="regenerate a fixture bit-identically (sha256 checked)")
    p.add_argument("--name", default="tiny-llama", choices=FIXTURE_NAMES)
    p.add_argument("--out", metavar="DIR", help="folder (default: the catalog's gates/fixtures/<name>; "
                   "with --check, the catalog's copy when it has one, else the shipped one)")
    p.add_argument("--check", action="store_true", help="only check an existing folder against the recorded sha256")
    p.add_argument("--json", action="store_true", help="print the fixture's files and their sha256 as JSON")
    p.set_defaults(func=cmd_fixture_generate)


def main(argv: list[str] | None = None) -> int:
    """Run these commands without the skupin CLI (e.g. on a reference machine): python3 -m skupin.cli.reference."""
    parser = argparse.ArgumentParser(prog="python3 -m skupin.cli.reference")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SkupinError as exc:
        for line in exc.lines():
            print(f"error: {line}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
