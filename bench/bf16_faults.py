"""bf16-path faults in real images, gated on this CPU: what the bf16 gate decides before its float32 pass (issue 29).

    PYTHONPATH=$PWD .venv/bin/python bench/bf16_faults.py [--models peaked-moe,tiny-moe] [--modes ...]
        [--tolerances FILE]         # -> bench/results/bf16-faults.json and a table on stdout

Needs a Docker engine; uses the bf16 CPU SKU's image `skupin build cpu-x86_64-bf16` recorded (or builds it, as the
integration tests do, with $SKUPIN_WHEELHOUSE). For each fixture, the SKU is
gated as it is with `gate.model` (and its H200 bf16 reference) set to that fixture; for each fault a derived image
FROM the honest one installs a locked test wheel (tests/integration/derived/swap.py, the gate's own test
mechanism: a faulty point release of a locked package passes `pins`, so only the numeric checks can catch it):

- norm-bf16, rope-bf16, router-bf16: transformers' RMSNorm, rotary embedding or MoE router classes compute in bf16
  what the honest ones compute in float32 (a float32 run is unchanged: only the bf16 checks can see them);
- expert-int4: one expert of one MoE layer quantized INT4 at load (the weights, which no op battery sees).

Recorded per run: every check's status and the first failing check before the float32 pass (the gate "without
the float32 pass"), the ops check's failing ops, and the model check's means against their bounds. Derived images
are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skupin.builder.check import resolve  # noqa: E402
from skupin.dockerd.client import connect  # noqa: E402
from skupin.gates.gate import gate_image  # noqa: E402
from skupin.gates.judge.tolerance import DEFAULT_PATH  # noqa: E402
from tests.integration.conftest import built_image, tampered_images  # noqa: E402

SKU = ROOT / "skus/cpu-x86_64-bf16.yaml"
OUT = ROOT / "bench/results/bf16-faults.json"
MODES = ("honest", "norm-bf16", "rope-bf16", "router-bf16", "expert-int4")
BEFORE_FLOAT32 = ("reference", "pins", "boot", "kernels", "ops", "model")


def with_model(stack, model: str):
    gate = stack.manifest.gate.model_copy(update={"model": model,
                                                  "reference": f"gates/references/{model}/h200-bfloat16"})
    return stack.model_copy(update={"manifest": stack.manifest.model_copy(update={"gate": gate})})


def summary(verdict) -> dict:
    checks = {c.name: c for c in verdict.checks}
    first = next((c.name for c in verdict.checks if c.name in BEFORE_FLOAT32 and c.status == "fail"), None)
    row = {"decision": verdict.decision, "statuses": {c.name: c.status for c in verdict.checks},
           "caught_before_float32": first}
    ops = checks.get("ops")
    if ops is not None:
        rows = ops.details.get("ops") or {}
        row["ops_failing"] = {name: r.get("ratio") for name, r in rows.items()
                              if isinstance(r, dict) and ((r.get("ratio") or 0) > 1 or r.get("problem"))}
        row["ops_reason"] = ops.reason
    model = checks.get("model")
    if model is not None:
        row["model_means"] = model.details.get("means")
        row["model_reason"] = model.reason
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="peaked-moe,tiny-moe")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--tolerances", type=Path, default=DEFAULT_PATH)
    args = p.parse_args(argv)
    docker = connect()
    stack = resolve(SKU, require_lock=True)
    wheelhouse = os.environ.get("SKUPIN_WHEELHOUSE")
    honest = built_image(docker, stack, Path(wheelhouse) if wheelhouse else None, None)
    modes = args.modes.split(",")
    tolerances = args.tolerances.resolve()
    shown = tolerances.relative_to(ROOT) if tolerances.is_relative_to(ROOT) else tolerances
    results: dict = {"sku": "cpu-x86_64-bf16", "image": honest, "tolerances": str(shown), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="skupin-bf16-faults-") as tmp, \
            tampered_images(docker, image=honest, lock=stack.lock, workdir=Path(tmp),
                           base_tag="skupin-bench/bf16-faults-base:latest") as derived:
        images: dict[str, tuple[str, object, Path | None]] = {"honest": (honest, stack.lock, None)}
        for mode in modes:
            if mode != "honest":
                swapped = derived.swap(mode)
                images[mode] = (swapped.image, swapped.lock, swapped.wheelhouse)
        for model in args.models.split(","):
            for mode in modes:
                image, lock, house = images[mode]
                out = Path(tmp) / f"gate-{model}-{mode}"
                t0 = time.monotonic()
                verdict = gate_image(stack=with_model(stack, model).model_copy(update={"lock": lock}), image=image,
                                     docker=docker, out=out, wheelhouse=house, tolerances_path=args.tolerances)
                row = {**summary(verdict), "wall_s": round(time.monotonic() - t0, 1)}
                results["runs"][f"{model}/{mode}"] = row
                print(f"{model:11s} {mode:12s} {row['decision']:13s} before float32: "
                      f"{row['caught_before_float32'] or 'nothing failed'}; ops failing {row.get('ops_failing')} "
                      f"({row['wall_s']} s)", flush=True)
    OUT.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
