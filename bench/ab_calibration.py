"""The resolution of `skupin ab` as a measured property (issue 33): A/Bs with known answers, many times over.

    PYTHONPATH=$PWD .venv/bin/python bench/ab_calibration.py [--quick] [--repeats 30] [--runs 16] [--requests 8]
        [--max-tokens 64] [--prompt-lengths 64] [--concurrency 1] [--target-ci F [--max-runs M] [--budget-s S]]
        [--restart-every N] [--arms self,slow-5pct,slow-10pct] [--out bench/results/ab-calibration.json] [--append]
    # -> OUT (settings, every A/B's decision, intervals and raw rounds, the rates per arm), OUT's -records.jsonl.gz
    #    (every A/B's whole ab.json, one a line) and a table on stdout; --quick writes ab-calibration-quick.json

Needs a Docker engine and the CPU SKU's image (`skupin build cpu-x86_64`'s record, else built now as the integration
tests build it, with $SKUPIN_WHEELHOUSE; that image is the SKU's own and stays). Every A/B has that image as its
baseline and one of three candidates, each an arm with a known answer:

- self: the same image under another id (FROM it with one LABEL added: the same layers, the same lock): the decode
  ratio is 1. The share of its A/Bs decided `hold: within noise` with no slice worse is the false-alarm goal (at least
  95%); the share whose 95% decode interval holds 1 is the interval's coverage (about 95% when rounds are independent).
- slow-5pct, slow-10pct: a locked test wheel (tests/integration/derived/swap.py, as `slow` is) busy-waits after each
  decode step for 1/0.95 - 1 (1/0.90 - 1) of that step's own period: decode tok/s x 0.95 (x 0.90) by construction,
  prefill unchanged (swap.py says how exact). The share whose decode interval lies wholly below 1 is the power (goal
  at least 95% at 5%), the share holding the known ratio the coverage.

Each image is gated once (runtime_ab reuses a verdict made for the same image id and lock); the A/Bs then run `skupin
ab`'s library path (skupin.ab.runtime.runtime_ab) with the settings given, the arms interleaved (self, 5%, 10%, self,
...) so a drift of the host hits them alike. Recorded per A/B: the decision, the decode ratio and its 95% interval,
every KPI's per-round ratios (decode, prefill, TTFT, aggregate, CPU-seconds per token), the slices, each round's
status. Per arm: the rates with Wilson 95% intervals, the median half-width of the decode interval, the decode ratio
pooled over the arm's A/Bs, the round-to-round and A/B-to-A/B spread of the log ratio and from them the smallest
decode difference these settings resolve at 95% power; with --restart-every, the log ratio's spread split into round
to round within a boot and boot to boot (a server process's own offset), what the settings resolve over boots and how
many boots of 2-16 rounds 5% needs. The JSON is written again after every A/B (a long run cut
short keeps what it measured). Derived images are removed at the end, whatever happens; the A/Bs' folders live in a
temporary folder. --quick is a smoke run (one A/B per arm, 3 short rounds, a few minutes): its numbers are noise.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skupin.ab.cpus import SHARED, allowed_cpus, plan_cpus  # noqa: E402
from skupin.ab.decision import ABSettings, RuntimeAB, logs_by_boot, t_quantile  # noqa: E402
from skupin.ab.runtime import ABInput, runtime_ab  # noqa: E402
from skupin.builder.check import resolve  # noqa: E402
from skupin.dockerd.client import connect  # noqa: E402
from skupin.gates.gate import gate_image  # noqa: E402
from skupin.gates.serving.perf import PerfSettings  # noqa: E402
from tests.integration.conftest import built_image, derived_images, tampered_images  # noqa: E402

SKU = ROOT / "skus/cpu-x86_64.yaml"
OUT = ROOT / "bench/results/ab-calibration.json"
QUICK_OUT = ROOT / "bench/results/ab-calibration-quick.json"
# arm -> the decode tok/s ratio candidate / baseline it has by construction
ARMS = {"self": 1.0, "slow-5pct": 0.95, "slow-10pct": 0.90}
GOAL = 0.95
# The load of each gate's own serve check (the A/B's load is the settings'), as tests/integration/test_ab.py's.
GATE_LOAD = PerfSettings(concurrency=(1,), requests=2, repetitions=1, warmup=0, max_tokens=8)
# Full mode: 16 rounds of 8 requests of 64 tokens at concurrency 1, 30 A/Bs per arm. `transformers serve` runs one
# request at a time, so a higher concurrency only queues (docs/BENCHMARKS.md) and costs time the rounds need more.
FULL = {"repeats": 30, "runs": 16, "requests": 8, "max_tokens": 64, "prompt_lengths": "64", "concurrency": "1",
        "warmup": 2}
QUICK = {"repeats": 1, "runs": 3, "requests": 2, "max_tokens": 16, "prompt_lengths": "64", "concurrency": "1",
         "warmup": 1}
# For the duration estimate, on this 2-CPU host: the CPU image's decode tok/s per request (105-135 in
# docs/BENCHMARKS.md's runtime A/B, 175-320 in this bench's smoke run on a loaded host: 150), its TTFT, a gate of it
# with GATE_LOAD (20-27 s), booting and warming both servers (5-6 s each) and a round's fixed cost (pause, unpause,
# two cgroup reads per side).
DECODE_TOK_S, TTFT_S, GATE_S, BOOT_S, ROUND_FIXED_S = 150.0, 0.05, 30.0, 15.0, 2.0
# the self arm's candidate: the honest image under another id (one label; the same layers and lock label)
SELF_DOCKERFILE = 'ARG BASE\nFROM ${BASE}\nARG MODE\nLABEL io.skupin.test-derived="copy-${MODE}"\n'


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score 95% interval of a rate `hits` / `n` (None for n = 0): honest at 0/n and n/n, where the normal
    approximation's is empty."""
    if n == 0:
        return None
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _kpi_row(k) -> dict:
    return {"ratio": k.ratio, "ci": [k.ci_low, k.ci_high], "rounds": list(k.rounds), "unit": k.unit,
            "higher_is_better": k.higher_is_better}


def ab_row(result: RuntimeAB, *, arm: str, index: int) -> dict:
    """One A/B as the bench keeps it: decision, the decode ratio's interval and the verdicts on the known answer, and
    every KPI's, slice's and round's raw record."""
    expected = ARMS[arm]
    decode = result.kpi("decode")
    lo, hi = (decode.ci_low, decode.ci_high) if decode is not None else (None, None)
    half = math.sqrt(hi / lo) - 1 if lo and hi else None
    worse = [s for s in result.slices if s.move == "worse"]
    return {
        "arm": arm, "index": index, "expected_ratio": expected, "honest_image": result.baseline.image_id,
        "decision": result.decision, "decision_line": result.decision_line, "reason": result.reason,
        "decode_ratio": decode.ratio if decode is not None else None, "decode_ci": [lo, hi],
        "decode_half_width": half,
        "within_noise": result.decision_line == "hold: within noise" and not worse,
        "detected_slower": hi is not None and hi < 1.0,
        "detected_faster": lo is not None and lo > 1.0,
        "covers_expected": lo is not None and hi is not None and lo <= expected <= hi,
        "noise_floor": result.noise_floor, "order": list(result.order), "boots": list(result.boots),
        "kpis": {k.name: _kpi_row(k) for k in result.kpis},
        "slices": [s.model_dump(mode="json") for s in result.slices],
        "rounds": [r.model_dump(mode="json") for r in result.rounds], "rounds_note": result.rounds_note,
        "rounds_stop": result.rounds_stop,
        "cpu": {role: c.model_dump(mode="json") for role, c in result.cpu.items()},
        "requests": result.requests, "failed_requests": result.failed_requests,
        "short_completions": result.short_completions, "output_agreement": result.output_agreement,
        "errors": result.errors, "wall_s": result.wall_s,
    }


def _logs(values: Sequence[float | None]) -> list[float]:
    return [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]


def resolvable(sd: float, rounds: int, power: float = GOAL) -> float | None:
    """The smallest decode difference (1 - ratio) whose paired t interval over `rounds` rounds, with this round-to-round
    sd of the log ratio, lies wholly below 1 with probability `power`: exp(-(t(0.975) + t(power)) sd / sqrt(n))."""
    if rounds < 2 or not math.isfinite(sd):
        return None
    df = rounds - 1
    return 1.0 - math.exp(-(t_quantile(df, 0.975) + t_quantile(df, power)) * sd / math.sqrt(rounds))


def boots_needed(*, sd_within: float, sd_between: float, rounds_per_boot: int, difference: float = 0.05,
                 power: float = GOAL, most: int = 1000) -> int | None:
    """The fewest boots of `rounds_per_boot` rounds whose interval over boots (ratio_interval) lies wholly below 1 with
    probability `power` when the candidate is `difference` slower: a boot's mean log ratio spreads by
    sqrt(sd_between^2 + sd_within^2 / rounds_per_boot); None past `most`."""
    sd = math.sqrt(sd_between ** 2 + sd_within ** 2 / rounds_per_boot)
    for boots in range(2, most + 1):
        found = resolvable(sd, boots, power)
        if found is not None and found <= difference:
            return boots
    return None


def boot_components(rows: Sequence[dict]) -> dict | None:
    """The decode log ratio's spread split in two, over the A/Bs whose rounds came from two boots or more: round to
    round within a boot (variance pooled over boots) and boot to boot beyond what that explains (the variance of boot
    means, averaged over A/Bs, less within^2 / rounds per boot, at least 0): a server process's own offset. None
    without such A/Bs."""
    within, weights, boot_means, sizes = [], [], [], []
    for r in rows:
        rounds = r["kpis"].get("decode", {}).get("rounds", [])
        groups = list(logs_by_boot(rounds, r.get("boots") or [1] * len(rounds)).values())
        if len(groups) < 2:
            continue
        within += [statistics.variance(g) for g in groups if len(g) > 1]
        weights += [len(g) - 1 for g in groups if len(g) > 1]
        means = [statistics.fmean(g) for g in groups]
        boot_means.append(statistics.variance(means))
        sizes += [len(g) for g in groups]
    if not boot_means or not within:
        return None
    # pooled with each boot's degrees of freedom; a boot mean's share of round noise goes with the harmonic mean size
    sd_within = math.sqrt(sum(w * v for w, v in zip(weights, within, strict=True)) / sum(weights))
    per_boot_rounds = statistics.harmonic_mean(sizes)
    var_means = statistics.fmean(boot_means)
    sd_between = math.sqrt(max(0.0, var_means - sd_within ** 2 / per_boot_rounds))
    return {"abs": len(boot_means), "boots": len(sizes), "rounds_per_boot": per_boot_rounds,
            "sd_within_boot": sd_within, "sd_boot_means": math.sqrt(var_means), "sd_between_boots": sd_between,
            "boots_for_5pct": {k: boots_needed(sd_within=sd_within, sd_between=sd_between, rounds_per_boot=k)
                               for k in (2, 4, 8, 16)}}


def _rate(rows: Sequence[dict], key: str) -> dict:
    hits = sum(bool(r[key]) for r in rows)
    ci = wilson(hits, len(rows))
    return {"hits": hits, "n": len(rows), "rate": hits / len(rows) if rows else None, "wilson_95": ci}


def arm_summary(rows: Sequence[dict]) -> dict:
    """An arm's rates (within noise, detected slower, interval holds the known ratio), the decode interval's median
    half-width, the decode ratio pooled over its A/Bs (geometric mean of each A/B's rounds, then a t interval over the
    A/Bs, the independent unit), the spread of the log ratio within an A/B (round to round) and between A/Bs (of their
    means: larger than within / sqrt(rounds) says the rounds of one A/B are not independent), and what these settings
    resolve at 95% power from that spread."""
    if not rows:
        return {}
    means, within, counts = [], [], []
    for r in rows:
        logs = _logs(r["kpis"].get("decode", {}).get("rounds", []))
        if logs:
            means.append(statistics.fmean(logs))
            counts.append(len(logs))
        if len(logs) > 1:
            within.append(statistics.variance(logs))
    halves = [r["decode_half_width"] for r in rows if r["decode_half_width"] is not None]
    out: dict = {
        "abs": len(rows), "expected_ratio": rows[0]["expected_ratio"],
        "decisions": dict(Counter(r["decision_line"] for r in rows)),
        "within_noise": _rate(rows, "within_noise"), "detected_slower": _rate(rows, "detected_slower"),
        "detected_faster": _rate(rows, "detected_faster"), "covers_expected": _rate(rows, "covers_expected"),
        "median_half_width": statistics.median(halves) if halves else None,
        "median_rounds": statistics.median(counts) if counts else None,
    }
    if means:
        out["pooled_ratio"] = math.exp(statistics.fmean(means))
    if len(means) > 1:
        half = t_quantile(len(means) - 1) * statistics.stdev(means) / math.sqrt(len(means))
        out["pooled_ci"] = [math.exp(statistics.fmean(means) - half), math.exp(statistics.fmean(means) + half)]
        out["sd_between_abs"] = statistics.stdev(means)
    if within:
        sd = math.sqrt(statistics.fmean(within))
        out["sd_within_ab"] = sd
        out["resolves_at_95"] = resolvable(sd, int(statistics.median(counts)))
    components = boot_components(rows)
    if components is not None:
        # over boots (the unit skupin ab's interval is over then): the boot means' spread at the median number of boots
        boots = statistics.median(n for r in rows if (n := len(set(r.get("boots", [])))) > 1)
        out["boot_components"] = components
        out["resolves_at_95_boots"] = resolvable(components["sd_boot_means"], int(boots))
    return out


def goals(summary: dict) -> dict:
    """The two goals of issue 33, as observed here: the observed rate against 95% and its Wilson interval's low end."""
    out = {}
    for name, arm, key in (("self_within_noise", "self", "within_noise"),
                           ("slow_5pct_detected", "slow-5pct", "detected_slower")):
        rate = summary.get(arm, {}).get(key)
        if rate and rate["n"]:
            out[name] = {**rate, "goal": GOAL, "met_observed": rate["rate"] >= GOAL,
                         "met_with_95_confidence": rate["wilson_95"][0] >= GOAL}
    return out


def estimate_s(settings: ABSettings, *, abs_count: int, images: int) -> float:
    """Seconds the run should take on this host: the gates, then per A/B booting both servers and `runs` rounds of
    every slice's requests on both sides (one request at a time: the CPU image's server is sequential)."""
    request_s = TTFT_S + (settings.max_tokens - 1) / DECODE_TOK_S
    side_s = len(settings.prompt_lengths) * len(settings.concurrency) * settings.requests * request_s
    round_s = 2 * side_s * 1.05 + ROUND_FIXED_S
    boots = math.ceil(settings.runs / settings.restart_every) if settings.restart_every else 1
    return images * GATE_S + abs_count * (boots * BOOT_S + settings.runs * round_s)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def _write(out: Path, results: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")


def _print_table(summary: dict) -> None:
    print(f"\n{'arm':11s} {'A/Bs':>4s} {'within noise':>13s} {'CI below 1':>11s} {'CI holds truth':>15s} "
          f"{'half-width':>10s} {'pooled ratio':>12s} {'resolves':>9s}")
    def pct(s: dict, key: str) -> str:
        return f"{s[key]['hits']}/{s[key]['n']}"

    for arm, s in summary.items():
        hw = s.get("median_half_width")
        res = s.get("resolves_at_95_boots", s.get("resolves_at_95"))
        print(f"{arm:11s} {s['abs']:4d} {pct(s, 'within_noise'):>13s} {pct(s, 'detected_slower'):>11s} "
              f"{pct(s, 'covers_expected'):>15s} {'-' if hw is None else f'{100 * hw:.1f}%':>10s} "
              f"{s.get('pooled_ratio', float('nan')):12.4f} {'-' if res is None else f'{100 * res:.1f}%':>9s}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: one A/B per arm, 3 short rounds (a few minutes)")
    p.add_argument("--repeats", type=int, help=f"A/Bs per arm (full {FULL['repeats']}, quick {QUICK['repeats']})")
    p.add_argument("--runs", type=int, help=f"rounds per A/B (full {FULL['runs']}, quick {QUICK['runs']})")
    p.add_argument("--requests", type=int, help="requests per slice, round and side")
    p.add_argument("--max-tokens", type=int, help="output tokens per request")
    p.add_argument("--prompt-lengths", help="comma-separated prompt lengths in tokens")
    p.add_argument("--concurrency", help="comma-separated concurrency levels")
    p.add_argument("--warmup", type=int, help="unmeasured requests per server before the first round")
    p.add_argument("--target-ci", type=float, help="skupin ab --target-ci: adaptive rounds past --runs")
    p.add_argument("--max-runs", type=int, help="with --target-ci: the most rounds")
    p.add_argument("--budget-s", type=float, help="with --target-ci: no round past --runs starts after this")
    p.add_argument("--restart-every", type=int, help="skupin ab --restart-every: boot both servers again after every N "
                   "rounds (intervals over boots)")
    p.add_argument("--server-cpus", default=SHARED, help="skupin ab --server-cpus: shared (default), auto or a CPU list")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--out", type=Path, help=f"the results JSON (default {OUT.relative_to(ROOT)}, quick "
                                            f"{QUICK_OUT.relative_to(ROOT)})")
    p.add_argument("--append", action="store_true", help="add this run's A/Bs to --out's (made with the same settings: "
                   "refused otherwise) and to its records, instead of starting both again")
    p.add_argument("--estimate-only", action="store_true", help="print the settings and the estimated duration, run nothing")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(ARMS)})")
    return args


def settings_of(args: argparse.Namespace) -> ABSettings:
    extra = {k: v for k, v in (("target_ci", args.target_ci), ("max_runs", args.max_runs), ("budget_s", args.budget_s))
             if v is not None}
    if extra and args.target_ci is None:
        raise SystemExit("--max-runs and --budget-s need --target-ci (as skupin ab refuses them without it)")
    return ABSettings(cpu_plan=plan_cpus(args.server_cpus, allowed_cpus()), runs=args.runs, requests=args.requests,
                      max_tokens=args.max_tokens, warmup=args.warmup, restart_every=args.restart_every,
                      prompt_lengths=tuple(int(x) for x in args.prompt_lengths.split(",")),
                      concurrency=tuple(int(x) for x in args.concurrency.split(",")), **extra)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    settings = settings_of(args)
    arms = args.arms.split(",")
    plan = [(i, arm) for i in range(args.repeats) for arm in arms]  # interleaved: self, 5%, 10%, self, ...
    estimate = estimate_s(settings, abs_count=len(plan), images=len(arms) + 1)
    more = " at least (--target-ci adds rounds)" if settings.target_ci is not None else ""
    boots = f", a new boot every {settings.restart_every}" if settings.restart_every else ""
    print(f"ab-calibration: {len(plan)} A/Bs ({args.repeats} x {', '.join(arms)}), {settings.runs} rounds{boots} of "
          f"{settings.requests} requests x {settings.max_tokens} tokens per slice ({len(settings.prompt_lengths)} prompt "
          f"lengths x {len(settings.concurrency)} levels); estimated {_hours(estimate)}{more}", flush=True)
    if args.estimate_only:
        return 0
    out = (args.out or (QUICK_OUT if args.quick else OUT)).resolve()
    records = out.with_name(out.stem + "-records.jsonl.gz")
    earlier, earlier_runs = _earlier(out, settings) if args.append else ([], [])
    if not earlier:
        records.unlink(missing_ok=True)
    docker = connect()
    stack = resolve(SKU, require_lock=True)
    wheelhouse = Path(os.environ["SKUPIN_WHEELHOUSE"]) if os.environ.get("SKUPIN_WHEELHOUSE") else None
    if wheelhouse is None and Path("/opt/wheels").is_dir():
        wheelhouse = Path("/opt/wheels")
    started = time.monotonic()
    honest = built_image(docker, stack, wheelhouse, None)
    if earlier and any(r.get("honest_image", honest) != honest for r in earlier):
        raise SystemExit(f"--append: {out} measured another baseline image than {honest}; give another --out")
    results: dict = {
        "bench": "ab-calibration", "quick": args.quick,
        "note": ("smoke run (--quick): one A/B per arm of 3 short rounds, on whatever else this host ran: its numbers "
                 "show the bench works, not the resolution of skupin ab") if args.quick else "",
        "sku": stack.manifest.name, "honest_image": honest, "settings": settings.model_dump(mode="json"),
        "repeats": args.repeats, "arms": {}, "estimated_s": round(estimate), "abs": list(earlier), "summary": {},
        "goals": {},
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "host": None, "wall_s": None,
        "earlier_runs": earlier_runs,
    }
    with tempfile.TemporaryDirectory(prefix="skupin-ab-calibration-") as tmp, \
            tampered_images(docker, image=honest, lock=stack.lock, workdir=Path(tmp) / "swaps",
                            base_tag="skupin-bench/ab-calibration-base:latest") as derived, \
            derived_images(docker, honest_image=honest, context=_self_context(Path(tmp) / "self"),
                           base_tag="skupin-bench/ab-calibration-self-base:latest") as copies:
        sides = {"honest": (stack, honest, wheelhouse)}
        for arm in arms:
            if arm == "self":
                sides[arm] = (stack, copies("self"), wheelhouse)
            else:
                swapped = derived.swap(arm)
                sides[arm] = (swapped.stack(stack), swapped.image, swapped.wheelhouse)
        verdicts = {}
        for name, (side_stack, image, house) in sides.items():
            t0 = time.monotonic()
            verdicts[name] = gate_image(stack=side_stack, image=image, docker=docker, out=Path(tmp) / f"gate-{name}",
                                        wheelhouse=house, serve_perf=GATE_LOAD)
            print(f"gate {name:10s} {verdicts[name].decision} ({time.monotonic() - t0:.0f} s): "
                  f"{verdicts[name].reason[:120]}", flush=True)
            if name != "honest":
                results["arms"][name] = {"expected_ratio": ARMS[name], "image_id": verdicts[name].image_id,
                                         "gate": verdicts[name].decision}
        done = Counter(r["arm"] for r in earlier)  # with --append, indices go on from the earlier run's
        for n, (i, arm) in enumerate(plan, 1):
            i += done[arm]
            side_stack, image, house = sides[arm]
            folder = Path(tmp) / f"ab-{arm}-{i + 1}"
            result = runtime_ab(baseline=ABInput(stack=stack, image=honest, verdict=verdicts["honest"]),
                                candidate=ABInput(stack=side_stack, image=image, verdict=verdicts[arm]),
                                docker=docker, out=folder, settings=settings, wheelhouse=house,
                                gate_serve_perf=GATE_LOAD, on_event=_progress)
            row = ab_row(result, arm=arm, index=i + 1)
            results["abs"].append(row)
            results["host"] = result.host
            with gzip.open(records, "at", encoding="utf-8") as f:
                f.write(json.dumps({"arm": arm, "index": i + 1, "ab": json.loads((folder / "ab.json").read_text())})
                        + "\n")
            results["summary"] = {a: arm_summary([r for r in results["abs"] if r["arm"] == a])
                                  for a in dict.fromkeys([*(r["arm"] for r in results["abs"]), *arms])}
            results["goals"] = goals(results["summary"])
            results["wall_s"] = round(time.monotonic() - started, 1)
            _write(out, results)
            lo, hi = row["decode_ci"]
            ci = f"{lo:.3f}-{hi:.3f}" if lo is not None and hi is not None else "no interval"
            left = (time.monotonic() - started) / n * (len(plan) - n)
            print(f"[{n}/{len(plan)}] {arm:10s} #{i + 1}: decode {row['decode_ratio'] or float('nan'):.3f}x ({ci}), "
                  f"{result.decision_line} ({result.wall_s:.0f} s; about {_hours(left)} left)", flush=True)
    _print_table(results["summary"])
    for name, g in results["goals"].items():
        print(f"{name}: {g['hits']}/{g['n']} ({100 * g['rate']:.0f}%, Wilson 95% "
              f"{100 * g['wilson_95'][0]:.0f}-{100 * g['wilson_95'][1]:.0f}%), goal {100 * GOAL:.0f}%")
    print(f"-> {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} and {records.name} "
          f"({results['wall_s']:.0f} s; estimated {results['estimated_s']} s)")
    return 0


def _earlier(out: Path, settings: ABSettings) -> tuple[list[dict], list[dict]]:
    """With --append: the A/Bs of the earlier runs in `out`, made with the same settings (SystemExit when they differ,
    so one file never mixes settings), and when each run started and how long it took; empty when there is none."""
    if not out.is_file():
        return [], []
    prev = json.loads(out.read_text(encoding="utf-8"))
    if prev.get("settings") != json.loads(json.dumps(settings.model_dump(mode="json"))):
        raise SystemExit(f"--append: {out} was made with other settings ({prev.get('settings')}); give the same "
                         "settings or another --out")
    before = prev.get("earlier_runs", [])
    runs = [*before, {"started": prev.get("started"), "wall_s": prev.get("wall_s"),
                      "abs": len(prev.get("abs", [])) - sum(r["abs"] for r in before)}]
    return list(prev.get("abs", [])), runs


def _self_context(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Dockerfile").write_text(SELF_DOCKERFILE, encoding="utf-8")
    return folder


def _progress(line: str) -> None:
    """The A/B's own lines (its servers, rounds and decision), cut to one screen line each."""
    if line.startswith("ab: "):
        print("  " + line[:200], flush=True)


if __name__ == "__main__":
    sys.exit(main())
