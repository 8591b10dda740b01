#!/bin/bash
# Capture the H200 bundles of the given fixtures with the project's own `skupin reference capture`, one tar per model
# in $OUT, and show that a capture is bit-reproducible (the tensors of a second capture of the first one hash the
# same), which ties the bench's records (measured against an earlier capture in the same environment) to them.
#     CAPTURE="tiny-moe deep-llama" bash bench/h200/capture_bundles.sh
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R="python3 -m skupin.cli.reference"
first=""
for m in ${CAPTURE:-tiny-moe deep-llama}; do
  $R fixture generate --name $m --out /tmp/skupin-fixtures/$m > /dev/null
  for d in bfloat16 float32; do
    rm -rf gates/references/$m/h200-$d
    $R reference capture --sku nvidia-h200-vllm --model $m --model-dir /tmp/skupin-fixtures/$m \
       --dtype $d --out gates/references/$m/h200-$d
    $R reference verify gates/references/$m/h200-$d
    sha256sum gates/references/$m/h200-$d/tensors.safetensors
    first=${first:-$m:$d}
  done
  tar -cf $OUT/bundles-$m.tar gates/references/$m
done
m=${first%%:*}; d=${first##*:}
$R reference capture --sku nvidia-h200-vllm --model $m --model-dir /tmp/skupin-fixtures/$m --dtype $d --out /tmp/again
sha256sum /tmp/again/tensors.safetensors gates/references/$m/h200-$d/tensors.safetensors
# the honest run the records call "boot 1, batch 8, sdpa" against each new bundle: 0 where the bundle is the one the
# records were measured against
python3 - <<'PY'
import os, numpy as np
from pathlib import Path
from bench.detection import runs
from skupin.gates.refdata.tensorio import read_safetensors
for m in os.environ.get("CAPTURE", "tiny-moe deep-llama").split():
    folder = Path(f"/tmp/skupin-fixtures/{m}")
    ids = runs.load_ids(folder / "prompts.json")
    for d in ("bfloat16", "float32"):
        ref, _ = read_safetensors(f"gates/references/{m}/h200-{d}/tensors.safetensors")
        rec = runs.run_spec({"batch": 8, "attn": "sdpa", "dtype": d, "swap": None}, model_dir=folder, ids=ids,
                            reference=ref, device="cuda", full=4)
        print(m, d, "max over prompts and statistics:",
              max(max(v for v in rec["stats"][s] if v is not None) for s in ("kl", "logprob_l2", "max_abs", "one_minus_cos")))
PY
