"""CLI commands of the gate: `skupin gate SKU` and `skupin calibrate SKU` ."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path
from typing import TYPE_CHECKING

from skupin.cli.output import emit, err, failure, install_missing_flag, out, warnings
from skupin.common.paths import env_wheelhouse

if TYPE_CHECKING:
    from skupin.ab.runtime import ABInput
    from skupin.builder.catalog.stack import ResolvedStack
    from skupin.dockerd import Docker
    from skupin.pipeline import RunOptions


def _stack_and_docker(sku: str) -> tuple[ResolvedStack, Docker]:
    from skupin.builder.check import resolve
    from skupin.common.paths import sku_path
    from skupin.dockerd import connect

    stack = resolve(sku_path(sku))
    return stack, connect()


def _default_out(kind: str, sku: str) -> Path:
    from skupin.common.paths import state_dir

    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return state_dir() / kind / sku / stamp


def cmd_gate(args: argparse.Namespace) -> int:
    from skupin.gates.gate import gate_image, image_from_build_record, pre_gate_passed
    from skupin.gates.judge.tolerance import catalog_tolerances
    from skupin.publishing.attest import find_signer
    from skupin.publishing.publish import write_verdict_envelope

    stack, docker = _stack_and_docker(args.sku)
    # the key that binds the verdict to this gate run, found (or made, on a fresh machine) before anything runs
    signer = find_signer(getattr(args, "signing_key", None), create=True, on_event=err)
    image = args.image or image_from_build_record(stack.manifest.name)
    folder = Path(args.out) if args.out else _default_out("gates", stack.manifest.name)
    pre_gate = bool(getattr(args, "pre_gate", False))
    verdict = gate_image(stack=stack, image=image, docker=docker, out=folder, on_event=err,
                         tolerances_path=Path(args.tolerances) if args.tolerances else catalog_tolerances(),
                         reference=Path(args.reference) if args.reference else None,
                         baseline=getattr(args, "baseline", None),
                         wheelhouse=Path(args.wheelhouse) if args.wheelhouse else None,
                         pre_gate=pre_gate)
    code = 0 if pre_gate and pre_gate_passed(verdict) else verdict.exit_code
    envelope = write_verdict_envelope(folder, verdict, signer)
    err(f"verdict signed by this host's key {signer.keyid[:12]}: {envelope}")
    if args.json:  # the verdict, with the --json contract's fields (skupin/cli/output.py) beside it
        contract = {"ok": True, "error": None, "warnings": warnings()} if code == 0 else failure(
            _verdict_error(verdict.exit_code, verdict.reason))
        out(json.dumps({**json.loads(verdict.model_dump_json()), **contract}, indent=1))
    else:
        for check in verdict.checks:
            out(f"{check.status:<8} {check.name:<9} {check.reason}")
        out(f"{'PRE-GATE PASSED' if code == 0 and pre_gate else verdict.decision.upper()}: {verdict.reason}")
        out(f"report: {folder / 'report.md'}  verdict: {folder / 'verdict.json'}  ({verdict.timings.get('total_s', 0):.1f} s)")
    return code


def _verdict_error(code: int, reason: str) -> Exception:
    """The error a verdict's exit code stands for (skupin/common/errors.py), carrying its reason."""
    from skupin.common.errors import GateCouldNotRun, GateFailed, GateUncalibrated, SkupinError

    for cls in (GateFailed, GateCouldNotRun, GateUncalibrated):
        if cls.exit_code == code:
            return cls(reason)
    exc = SkupinError(reason)
    exc.exit_code = code
    return exc


def cmd_calibrate(args: argparse.Namespace) -> int:
    from skupin.builder.check import resolve
    from skupin.calibration.calibrate import DEFAULT_VARIATIONS, calibrate_image, refuse_quantized
    from skupin.common.paths import sku_path
    from skupin.dockerd import connect
    from skupin.gates.gate import image_from_build_record
    from skupin.gates.judge.tolerance import (
        catalog_tolerances,
        load_tolerances,
        merge_entry,
        writable_tolerances,
        write_tolerances,
    )

    stack = resolve(sku_path(args.sku))
    refuse_quantized(stack.manifest)  # before anything runs: calibration comes from full-precision weights only
    pinned = stack  # the image's files are checked against the SKU's own lock and render, --float32 or not
    if args.float32:  # the float32 pass's entry: the same image at float32 against the float32 bundle
        from skupin.common.errors import ManifestError
        from skupin.gates.refdata.bundle import float32_manifest

        if stack.manifest.gate.dtype == "float32":
            raise ManifestError(f"{stack.manifest.name} serves float32: its gate has no separate float32 pass; "
                                f"run skupin calibrate {stack.manifest.name} without --float32")
        stack = stack.model_copy(update={"manifest": float32_manifest(stack.manifest)})
    image = args.image or image_from_build_record(stack.manifest.name)
    docker = connect()
    folder = Path(args.out) if args.out else _default_out("calibrations", stack.manifest.name)
    path = Path(args.tolerances) if args.tolerances else writable_tolerances()
    tolerances = load_tolerances(path if path.is_file() else catalog_tolerances())
    # refuses (nothing written) an image that fails pins, quantized weights, runs that break a hard bound or the
    # float32 pass (skupin/calibration/calibrate.py)
    wheelhouse = getattr(args, "wheelhouse", None)
    entry = calibrate_image(stack=stack, image=image, docker=docker, out=folder, boots=args.boots,
                            variations=DEFAULT_VARIATIONS, margin=args.margin, on_event=err, tolerances=tolerances,
                            pinned=pinned, wheelhouse=Path(wheelhouse) if wheelhouse else None)
    merged = merge_entry(tolerances, entry, allow_looser=args.allow_looser)
    if not args.dry_run:
        write_tolerances(merged, path)
    summary = {"key": entry.key.label(), "written": None if args.dry_run else str(path),
               "per_prompt": entry.model.per_prompt, "mean": entry.model.mean, "honest_rate": entry.model.honest_rate,
               "kernels": entry.kernels, "runs": entry.provenance.runs, "margin": entry.provenance.margin}
    out(json.dumps(summary, indent=1))
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers, e.g. 1,2,4") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers of at least 1, e.g. 1,2,4")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of at least 1")
    return value


def _ab_side(sku: str, image: str | None, args: argparse.Namespace) -> ABInput:
    """(stack, image) of one side: the given image with the SKU's current stack, else the SKU built (cached) here."""
    from skupin.ab.runtime import ABInput
    from skupin.builder.check import resolve
    from skupin.common.paths import sku_path
    from skupin.dockerd import ensure_dockerd
    from skupin.pipeline import build_sku

    if image:
        ensure_dockerd(on_event=err)
        return ABInput(stack=resolve(sku_path(sku), require_lock=True), image=image)
    stack, built, _ = build_sku(options=_run_options(sku, args), on_event=err)
    return ABInput(stack=stack, image=built.image)


def _run_options(sku: str, args: argparse.Namespace) -> RunOptions:
    from skupin.pipeline import RunOptions

    return RunOptions(sku=sku, wheelhouse=Path(args.wheelhouse) if args.wheelhouse else None)


def _check_ab_flags(args: argparse.Namespace) -> None:
    """ManifestError (exit 2) naming the flags of `skupin ab` that contradict each other, before anything is built."""
    from skupin.common.errors import ManifestError

    if args.target_ci is None:
        alone = [flag for flag, value in (("--max-runs", args.max_runs), ("--budget-s", args.budget_s))
                 if value is not None]
        if alone:
            raise ManifestError(f"{' and '.join(alone)} without --target-ci: {'they bound' if len(alone) > 1 else 'it bounds'} "
                                f"only the rounds --target-ci adds past --runs, and without it exactly --runs "
                                f"({args.runs}) rounds run; give --target-ci FRACTION or drop {' and '.join(alone)}")
    if args.max_runs is not None and args.max_runs < args.runs:
        raise ManifestError(f"--max-runs {args.max_runs} is smaller than --runs {args.runs}: --runs rounds always run "
                            f"and --max-runs is the most --target-ci may add up to; give --max-runs {args.runs} or more, "
                            "or fewer --runs")


def cmd_ab(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from skupin.ab.cpus import allowed_cpus, plan_cpus
    from skupin.ab.decision import ABSettings
    from skupin.ab.runtime import runtime_ab, same_weights
    from skupin.builder.check import resolve
    from skupin.common.errors import ManifestError
    from skupin.common.paths import sku_path
    from skupin.dockerd import connect
    from skupin.gates.judge.tolerance import catalog_tolerances

    _check_ab_flags(args)
    cpus = plan_cpus(args.server_cpus, allowed_cpus())
    try:
        settings = ABSettings(cpu_plan=cpus, runs=args.runs, concurrency=args.concurrency, prompt_lengths=args.prompt_lengths,
                              requests=args.requests, max_tokens=args.max_tokens, volume=args.volume,
                              target_ci=args.target_ci, budget_s=args.budget_s, restart_every=args.restart_every,
                              **({} if args.max_runs is None else {"max_runs": args.max_runs}))
    except ValidationError as exc:
        raise ManifestError("; ".join(f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: "
                                      f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())) from None
    same_weights(resolve(sku_path(args.baseline)).manifest, resolve(sku_path(args.candidate)).manifest)  # refuse early
    baseline = _ab_side(args.baseline, args.baseline_image, args)
    candidate = _ab_side(args.candidate, args.candidate_image, args)
    name = f"{baseline.stack.manifest.name}-vs-{candidate.stack.manifest.name}"
    folder = Path(args.out) if args.out else _default_out("ab", name)
    result = runtime_ab(baseline=baseline, candidate=candidate, docker=connect(), out=folder, settings=settings,
                        tolerances_path=Path(args.tolerances) if args.tolerances else catalog_tolerances(),
                        wheelhouse=_run_options(args.baseline, args).local_wheelhouse(), on_event=err)
    if args.json:  # promote is ok; hold (12) and reject (13) are the contract's error, with the A/B's reason
        decided = None if result.exit_code == 0 else RuntimeError(result.reason)
        emit(json.loads(result.model_dump_json()), decided, indent=1, code=result.exit_code,
             kind=f"ab_{result.decision}" if decided else None)
    else:
        for k in result.kpis:
            ci = f"  95% CI {k.ci_low:.3f}-{k.ci_high:.3f}" if k.ci_low is not None and k.ci_high is not None else ""
            out(f"{k.name:<10} baseline {k.baseline:12.4g}  candidate {k.candidate:12.4g}  ratio {k.ratio:6.3f}{ci}")
        cap = result.capacity
        if cap is not None and cap.baseline is not None and cap.candidate is not None:
            out(f"capacity   {cap.volume_tokens_per_day:.3g} tok/day: baseline {cap.baseline.servers} servers "
                f"${cap.baseline.monthly_usd:,.0f}/month, candidate {cap.candidate.servers} servers "
                f"${cap.candidate.monthly_usd:,.0f}/month, saving ${cap.monthly_saving_usd or 0:,.0f}/month")
        out(f"{result.decision_line.upper()}: {result.reason}")
        out(f"annex: {folder / 'annex.md'}  record: {folder / 'ab.json'}  ({result.wall_s:.0f} s)")
    return result.exit_code


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `gate`, `calibrate` and `ab` to the skupin CLI."""
    p = subparsers.add_parser(
        "gate",
        help="check an image's files against its lock, boot it, compare its outputs with the NVIDIA reference",
        description="Checks, in order: reference, pins (static: the image's files are its lock, "
        "read from its layers before anything runs), binaries (static: every GPU binary carries machine code for the "
        "SKU's arch, every shared object's libraries resolve inside the image), smoke (a GPU image imports its engine "
        "and loads its runtime libraries with no accelerator attached), boot (on a host without the SKU's "
        "accelerator the run ends here: could not run, never a pass), kernels, ops (the engine's own ops against float64 math "
        "on the host), model, float32 (a SKU serving bf16/fp16 is "
        "probed again at float32 against the float32 bundle beside its reference), serve. "
        "Exit 0: pass; 10: the image failed the gate; 11: the gate could not run; 14: uncalibrated (no "
        "calibrated tolerance for the SKU's class: the calibration-free checks passed; never a pass). "
        "With --pre-gate: exit 0 when every check before boot passed.",
    )
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--image", metavar="REF", help="image to gate (default: the SKU's build record); any local image works")
    p.add_argument("--json", action="store_true", help="print the verdict JSON on stdout (progress goes to stderr)")
    p.add_argument("--out", metavar="DIR", help="where verdict.json, verdict.dsse.json (the verdict signed with this "
                                            "host's key), report.md, plot.png go (default .skupin/gates/SKU/TIME)")
    p.add_argument("--signing-key", metavar="FILE", type=Path,
                   help="the key that signs the verdict (default $SKUPIN_SIGNING_KEY, else .skupin/keys/signing.key, "
                        "made and trusted here when missing); publish accepts only a verdict a trusted key signed")
    p.add_argument("--reference", metavar="DIR", help="reference bundle (default: the SKU's gate.reference)")
    p.add_argument("--tolerances", metavar="FILE", help="tolerance file (default gates/data/tolerances.yaml)")
    p.add_argument("--baseline", metavar="REF", help="serve check: A/B the server's speed against this image "
                                                    "(interleaved runs on this host; gate.serve.max_decode_regression bounds it)")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", default=env_wheelhouse(),
                   help="where locked wheels with no download URL lie (pins compares the image with every locked wheel; "
                        "default $SKUPIN_WHEELHOUSE; wheels already in the wheel store need nothing)")
    p.add_argument("--pre-gate", action="store_true",
                   help="run only the checks that need no accelerator (reference, pins, binaries, smoke) and stop before "
                        "boot: what a build runner runs before an image goes to staging. Exit 0 when they all passed; "
                        "the verdict still says could_not_run (a pre-gate is never a pass; publish refuses it)")
    install_missing_flag(p)
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
    p.add_argument("--float32", action="store_true",
                   help="calibrate the float32 pass of a SKU that serves bf16/fp16: honest float32 runs of the same image "
                        "against the float32 bundle beside its reference (key <class>/float32/<model>, plus /<engine> "
                        "on an accelerator or with gate.tolerance_per_engine)")
    install_missing_flag(p)
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser(
        "ab",
        help="swap the runtime on the same weights: gate two SKUs, A/B their servers in interleaved rounds, decide",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
A/B a CANDIDATE runtime against a named BASELINE on the same hardware and the same weights.

Both SKUs must share hardware class, model fixture, dtype and reference bundle (refused otherwise,
naming what differs; exit 2). Each SKU's image is built here (cached) unless --*-image names one.
Then:
  1. both images go through the whole gate against the NVIDIA reference (a candidate that fails
     is rejected however fast it is; it is still measured when it booted and served);
  2. both servers (each image's own CMD) boot side by side in the gate's sandbox;
  3. RUNS interleaved rounds (B A, A B, ...; B the baseline, A the candidate, more with
     --target-ci): each image serves every prompt length at every concurrency level while the
     other's container is paused, so a drift of the host hits both alike; a round a side fails
     in is kept in the record and ends the rounds, and the KPIs pair only rounds measured on both
     sides, by the round they ran in; with --restart-every N both servers are stopped and booted
     again after every N rounds, so a server process's own speed offset is sampled too;
  4. KPIs kept apart: decode tok/s per request, prefill tok/s, TTFT p50/p99, aggregate tok/s,
     $/1M output tokens (each SKU's cost block), per-round ratios with a 95% interval (paired t
     on the log ratio over rounds, or over boots with --restart-every) and a noise floor from
     each image's own round-to-round movement (at least 2%); output tokens counted on the host
     from the streamed text with the model's tokenizer (never the server's usage); per slice
     (prompt length x concurrency) the primary KPI (gate.serve.primary_kpi, default decode) with
     its interval; CPU-seconds per 1M output tokens from each container's cgroup; servers and
     monthly cost for --volume.

Decision: "reject: quality gate failed" when the candidate fails the gate (however fast); then what
the rounds showed (a server failing, requests streaming nothing, completions that differ from the
baseline's, "reject: candidate under-generates" when more than 5% of its completions stream
over 25% fewer tokens than asked); then speed over decode tok/s per request, prefill tok/s and
aggregate tok/s, with at least 3 rounds: "promote" when one or more are faster beyond the noise
floor in the median and in every round, none slower and no slice worse on the primary KPI beyond
its 95% interval, "reject: slower" when some are slower and none faster, "hold: trade-off (...)"
when both or when a slice is worse (named), "hold: within noise" otherwise; a promote with fewer
than RUNS rounds giving a decode ratio of both sides is "hold: rounds missing", and any reason
says how many rounds were asked, run and measured on both sides when they fall short
(docs/SERVE.md, section 5, item 7).
Writes annex.md (one page), annex.png and ab.json to --out (default .skupin/ab/BASELINE-vs-CANDIDATE/TIME).
Exit 0: promote; 12: hold; 13: reject; 2: flags that contradict each other, not the same weights,
or one image on both sides; 5, 6, 11: the build, Docker or gate could not run.""",
        epilog="example:\n  skupin ab cpu-x86_64 cpu-x86_64-vllm --runs 3 --concurrency 1,2,4 --prompt-lengths 64,256",
    )
    p.add_argument("baseline", help="baseline SKU (name or manifest path)")
    p.add_argument("candidate", help="candidate SKU (name or manifest path)")
    p.add_argument("--runs", type=_positive, default=3,
                   help="interleaved rounds, at most 50 (default 3; one round shows no noise, fewer than 3 decide "
                        "nothing)")
    p.add_argument("--concurrency", type=_int_list, default=(1, 2, 4), metavar="N,N,...",
                   help="concurrency levels, each once (default 1,2,4)")
    p.add_argument("--prompt-lengths", type=_int_list, default=(64, 256), metavar="N,N,...",
                   help="prompt tokens per request, made from the fixture's prompts (default 64,256)")
    p.add_argument("--requests", type=_positive, default=8,
                   help="measured requests per level, round and image, at least the level's concurrency (default 8)")
    p.add_argument("--max-tokens", type=_positive, default=32, help="output tokens per request, at least 2 (default 32)")
    p.add_argument("--target-ci", type=float, metavar="FRACTION",
                   help="after --runs rounds, add rounds until the decode ratio's 95%% interval is within +- FRACTION "
                        "(between 0 and 1, e.g. 0.025) of its centre, up to --max-runs and --budget-s "
                        "(default: exactly --runs rounds)")
    p.add_argument("--max-runs", type=_positive, metavar="N",
                   help="with --target-ci only: the most rounds, at least --runs and at most 200 (default 50)")
    p.add_argument("--budget-s", type=float, metavar="SECONDS",
                   help="with --target-ci only: start no round past --runs (with --restart-every: no boot) after "
                        "this many seconds since the first round "
                        "(default: none; no A/B starts a round after 11 hours of rounds, whatever is asked)")
    p.add_argument("--restart-every", type=_positive, metavar="N",
                   help="stop and boot both servers again after every N rounds (even, at least 2) and take every "
                        "95%% interval over boots (the mean log ratio of each boot), not rounds: the interval then "
                        "also holds whatever differs from one start of a server to the next, which the rounds of one "
                        "boot share and cannot show (on a 2-CPU host estimated 0-1.3%% sd, against 13-15%% from "
                        "round to round: docs/BENCHMARKS.md, 'Restarts'). Costs a boot and warm-up per N rounds; --runs "
                        "(and --max-runs) must be whole boots, two at least, e.g. --runs 48 --restart-every 8 "
                        "(default: one boot for all rounds)")
    p.add_argument("--server-cpus", default="shared", metavar="shared|auto|CPUS",
                   help="where the servers run: 'shared' (default) gives each server container the gate's CPU quota on "
                        "every CPU, shared with the measuring client; 'auto' pins each server to the upper half of the "
                        "CPUs this process may use (a cpuset, no quota) and the client to the rest (shared on one "
                        "CPU); a CPU list (e.g. 1 or 2-3) names "
                        "the servers' CPUs. Only one server runs at a time (the other is paused), so both get the same "
                        "CPUs. On a 2-CPU host pinning did not reduce the round-to-round noise (docs/BENCHMARKS.md)")
    p.add_argument("--volume", type=float, default=1e8, metavar="TOKENS_PER_DAY",
                   help="daily output volume the capacity and cost block is sized for (default 1e8 = 100M tokens/day)")
    p.add_argument("--baseline-image", metavar="REF", help="local image for the baseline (default: build the SKU here)")
    p.add_argument("--candidate-image", metavar="REF", help="local image for the candidate (default: build the SKU here)")
    p.add_argument("--out", metavar="DIR", help="where annex.md, annex.png, ab.json and both gates' outputs go")
    p.add_argument("--json", action="store_true", help="print ab.json's record on stdout with ok/error/warnings "
                   "(hold and reject are the error, codes 12 and 13; progress goes to stderr)")
    p.add_argument("--tolerances", metavar="FILE", help="tolerance file (default gates/data/tolerances.yaml)")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", default=env_wheelhouse(),
                   help="local wheels for builds and pins (default $SKUPIN_WHEELHOUSE, "
                                                       "else /opt/wheels when present)")
    install_missing_flag(p)
    p.set_defaults(func=cmd_ab)
