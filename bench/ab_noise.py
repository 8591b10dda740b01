"""Where `skupin ab`'s round-to-round noise comes from on this host (issue 33): the CPU under the servers, or the server.

    PYTHONPATH=$PWD .venv/bin/python bench/ab_noise.py [--requests 120] [--long-requests 40] [--out FILE]
    # -> bench/results/ab-noise.json and a table on stdout (about 5 minutes on 2 cores)

Needs a Docker engine and the CPU SKU's image (`skupin build cpu-x86_64`'s record, else built now). Three measurements:
- the CPU alone: a fixed unit of work (60 float32 256x256 matrix products, about 20 ms) timed 300 times on each CPU,
  pinned, in this process: how much the machine under everything moves;
- one server alone (the CPU SKU's `transformers serve`, no A/B, no other container), requests one after another from
  one client, 64-token and 256-token completions, in two placements: `shared` (what `skupin ab` does by default: the
  gate's CPU quota on every CPU, the client anywhere) and `pinned` (`--server-cpus auto`: the server on the upper half
  of the CPUs as a cpuset, the client on the rest);
- for each series: the median decode tok/s, the spread of log decode speed from one request to the next (sd), its
  lag-1 autocorrelation (runs of fast and slow requests), the spread of means of 8 consecutive requests against what
  independent requests would give (sd / sqrt 8), and the server's CPU-seconds per output token per block of 8 requests
  from its container's cgroup: if the server does more work per token when it is slow, the noise is the server's own.
"""

from __future__ import annotations

import os

# the CPU-alone unit must be one thread's work: BLAS's own thread pool pinned to one CPU would fight itself
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skupin.ab.cpus import AUTO, SHARED, allowed_cpus, client_pinned, plan_cpus  # noqa: E402
from skupin.ab.runtime import prompt_inputs  # noqa: E402
from skupin.builder.check import resolve  # noqa: E402
from skupin.dockerd.client import connect  # noqa: E402
from skupin.gates.refdata.bundle import fixture_folder, model_folder  # noqa: E402
from skupin.gates.serving.perf import measure_level, tokenizer_counter  # noqa: E402
from skupin.gates.serving.serve import load_prompts, running_server  # noqa: E402
from tests.integration.conftest import built_image  # noqa: E402

SKU = ROOT / "skus/cpu-x86_64.yaml"
OUT = ROOT / "bench/results/ab-noise.json"
BLOCK = 8


def series_stats(values: list[float]) -> dict:
    """Median, sd of the logs, lag-1 autocorrelation of the logs, and the sd of means of BLOCK consecutive logs against
    what independent values would give."""
    logs = [math.log(v) for v in values if v > 0]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    lag1 = (sum((a - mean) * (b - mean) for a, b in zip(logs, logs[1:], strict=False)) / ((len(logs) - 1) * sd * sd)
            if sd > 0 else 0.0)
    blocks = [statistics.fmean(logs[i:i + BLOCK]) for i in range(0, len(logs) - BLOCK + 1, BLOCK)]
    return {"n": len(logs), "median": round(statistics.median(values), 3), "sd_log": round(sd, 4),
            "lag1": round(lag1, 3), "block_sd_log": round(statistics.stdev(blocks), 4) if len(blocks) > 1 else None,
            "block_sd_if_independent": round(sd / math.sqrt(BLOCK), 4)}


def cpu_alone(cpu: int, units: int = 300) -> dict:
    import numpy as np

    a = np.random.default_rng(0).random((256, 256), dtype=np.float32)

    def unit() -> float:
        t = time.perf_counter()
        for _ in range(60):
            a @ a
        return time.perf_counter() - t

    with client_pinned((cpu,)):
        for _ in range(20):
            unit()
        times = [unit() for _ in range(units)]
    return {"cpu": cpu, "unit_ms": series_stats([1000 * t for t in times]), "times_ms": [round(1000 * t, 3) for t in times]}


def one_server(*, placement: str, image: str, stack, docker, requests: int, long_requests: int) -> dict:
    plan = plan_cpus(placement, allowed_cpus())
    manifest = stack.manifest
    with tempfile.TemporaryDirectory(prefix="skupin-ab-noise-") as scratch:
        folder = fixture_folder(name=manifest.gate.model, model_dir=None, scratch=Path(scratch))
        mount = model_folder(manifest=manifest, scratch=Path(scratch), fixture_dir=folder)
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        prompts = load_prompts(folder / "prompts.json")["prompts"]
        out: dict = {"placement": placement, "plan": plan.describe() if plan else "every CPU shared", "series": {}}
        with running_server(manifest=manifest, image=image, docker=docker, model_dir=mount,
                            deadline_s=float(manifest.gate.deadline_s), workers=1, role="ab-noise",
                            cpuset=plan.cpuset() if plan else None) as server, \
                client_pinned(plan.client if plan else None):
            inputs = prompt_inputs(prompts=prompts, tokenizer=tokenizer, length=64, count=8, launch=server.launch)
            measure_level(client=server.client, prompts=inputs, concurrency=1, requests=4, max_tokens=64)
            for max_tokens, n in ((64, requests), (256, long_requests)):
                rates, cpu_per_token = [], []
                for start in range(0, n, BLOCK):
                    before = server.container.cpu_seconds()
                    samples, _ = measure_level(client=server.client, prompts=inputs, concurrency=1,
                                               requests=min(BLOCK, n - start), max_tokens=max_tokens,
                                               count_tokens=tokenizer_counter(tokenizer))
                    spent = server.container.cpu_seconds() - before
                    rates += [(s.output_tokens - 1) / s.decode_s for s in samples if s.decode_s > 0]
                    tokens = sum(s.output_tokens for s in samples)
                    cpu_per_token.append(1000 * spent / tokens if tokens else float("nan"))
                out["series"][str(max_tokens)] = {
                    "decode_tok_s": series_stats(rates), "rates": [round(r, 2) for r in rates],
                    "cpu_ms_per_token_blocks": [round(c, 4) for c in cpu_per_token],
                    "cpu_ms_per_token_block_sd_log": round(statistics.stdev(
                        [math.log(c) for c in cpu_per_token if c > 0]), 4) if len(cpu_per_token) > 1 else None}
                print(f"{placement:7s} {max_tokens:3d} tokens: {out['series'][str(max_tokens)]['decode_tok_s']}; CPU ms "
                      f"per token, blocks of {BLOCK}: sd(log) {out['series'][str(max_tokens)]['cpu_ms_per_token_block_sd_log']}",
                      flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=120, help="64-token requests per placement (default 120)")
    p.add_argument("--long-requests", type=int, default=40, help="256-token requests per placement (default 40)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    started = time.monotonic()
    results: dict = {"bench": "ab-noise", "host": {"cpus": list(allowed_cpus()), "load_before": os.getloadavg()},
                     "cpu_alone": [cpu_alone(c) for c in allowed_cpus()]}
    for row in results["cpu_alone"]:
        print(f"cpu {row['cpu']}: a 20 ms unit {row['unit_ms']}", flush=True)
    docker = connect()
    stack = resolve(SKU, require_lock=True)
    wheelhouse = Path(os.environ.get("SKUPIN_WHEELHOUSE") or "/opt/wheels")
    image = built_image(docker, stack, wheelhouse if wheelhouse.is_dir() else None, None)
    results["image"] = image
    results["servers"] = [one_server(placement=placement, image=image, stack=stack, docker=docker,
                                     requests=args.requests, long_requests=args.long_requests)
                          for placement in (SHARED, AUTO)]
    results["wall_s"] = round(time.monotonic() - started, 1)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"-> {args.out} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
