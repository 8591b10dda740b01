"""CLI commands of the gate: `skupin gate SKU` and `skupin calibrate SKU` ."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

from skupin.cli.output import err, out


def _stack_and_docker(sku: str):
    from builder.check import resolve
    from common.paths import sku_path
    from dockerd import connect

    stack = resolve(sku_path(sku))
    return stack, connect()


def _default_out(kind: str, sku: str) -> Path:
    from common.paths import STATE

    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path(STATE) / kind / sku / stamp


def cmd_gate(args: argparse.Namespace) -> int:
    from gates.gate import gate_image, image_from_build_record
    from gates.tolerance import DEFAULT_PATH

    stack, docker = _stack_and_docker(args.sku)
    image = args.image or image_from_build_record(stack.manifest.name)
    folder = Path(args.out) if args.out else _default_out("gates", stack.manifest.name)
    verdict = gate_image(stack=stack, image=image, docker=docker, out=folder, on_event=err,
                         tolerances_path=Path(args.tolerances) if args.tolerances else DEFAULT_PATH,
                         reference=Path(args.reference) if args.reference else None,
                         baseline=getattr(args, "baseline", None),
                         wheelhouse=Path(args.wheelhouse) if args.wheelhouse else None)
    if args.json:
        out(verdict.model_dump_json(indent=1))
    else:
        for check in verdict.checks:
            out(f"{check.status:<8} {check.name:<9} {check.reason}")
        out(f"{verdict.decision.upper()}: {verdict.reason}")
        out(f"report: {folder / 'report.md'}  verdict: {folder / 'verdict.json'}  ({verdict.timings.get('total_s', 0):.1f} s)")
    return verdict.exit_code


def cmd_calibrate(args: argparse.Namespace) -> int:
    from gates.calibrate import DEFAULT_VARIATIONS, calibrate_image
    from gates.gate import image_from_build_record
    from gates.tolerance import DEFAULT_PATH, load_tolerances, merge_entry, write_tolerances

    stack, docker = _stack_and_docker(args.sku)
    image = args.image or image_from_build_record(stack.manifest.name)
    folder = Path(args.out) if args.out else _default_out("calibrations", stack.manifest.name)
    path = Path(args.tolerances) if args.tolerances else DEFAULT_PATH
    tolerances = load_tolerances(path)
    entry = calibrate_image(stack=stack, image=image, docker=docker, out=folder, boots=args.boots,
                            variations=DEFAULT_VARIATIONS, margin=args.margin, on_event=err)
    merged = merge_entry(tolerances, entry, allow_looser=args.allow_looser)
    if not args.dry_run:
        write_tolerances(merged, path)
    summary = {"key": entry.key.label(), "written": None if args.dry_run else str(path),
               "per_prompt": entry.model.per_prompt, "mean": entry.model.mean, "honest_rate": entry.model.honest_rate,
               "kernels": entry.kernels, "runs": entry.provenance.runs, "margin": entry.provenance.margin}
    out(json.dumps(summary, indent=1))
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `gate` and `calibrate` to the skupin CLI."""
    p = subparsers.add_parser(
        "gate",
        help="check an image's files against its lock, boot it, compare its outputs with the NVIDIA reference",
        description="Checks, in order: reference, pins (static: the image's files are its lock, "
        "read from its layers before anything runs), boot, kernels, model, serve. "
        "Exit 0: pass; 10: the image failed the gate; 11: the gate could not run; 14: uncalibrated (no "
        "calibrated tolerance for the SKU's class: the calibration-free checks passed; never a pass).",
    )
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--image", metavar="REF", help="image to gate (default: the SKU's build record); any local image works")
    p.add_argument("--json", action="store_true", help="print the verdict JSON on stdout (progress goes to stderr)")
    p.add_argument("--out", metavar="DIR", help="where verdict.json, report.md, plot.png go (default .skupin/gates/SKU/TIME)")
    p.add_argument("--reference", metavar="DIR", help="reference bundle (default: the SKU's gate.reference)")
    p.add_argument("--tolerances", metavar="FILE", help="tolerance file (default gates/data/tolerances.yaml)")
    p.add_argument("--baseline", metavar="REF", help="serve check: A/B the server's speed against this image "
                                                    "(interleaved runs on this host; gate.serve.max_decode_regression bounds it)")
    p.add_argument("--wheelhouse", metavar="DIR",
                   help="where locked wheels with no download URL lie (pins compares the image with every locked wheel; "
                        "default $SKUPIN_WHEELHOUSE; wheels already in the wheel store need nothing)")
    p.set_defaults(func=cmd_gate)

    p = subparsers.add_parser("calibrate", help="derive the SKU's hardware-class tolerance from honest runs of its image")
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--image", metavar="REF", help="honest image (default: the SKU's build record)")
    p.add_argument("--boots", type=int, default=2, help="fresh containers per (batch size, threads) variation (default 2)")
    p.add_argument("--margin", type=float, default=4.0, help="threshold = margin x largest honest value (default 4)")
    p.add_argument("--out", metavar="DIR", help="where the honest runs' outputs go")
    p.add_argument("--tolerances", metavar="FILE", help="tolerance file to update (default gates/data/tolerances.yaml)")
    p.add_argument("--allow-looser", action="store_true", help="allow replacing this class's entry with looser thresholds")
    p.add_argument("--dry-run", action="store_true", help="print the entry without writing it")
    p.set_defaults(func=cmd_calibrate)
