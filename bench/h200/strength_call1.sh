#!/bin/bash
# The device call of issue 18's H200 work: capture the bundles of the new fixtures (tiny-moe, deep-llama) with the
# project's own `skupin reference capture`, then the boots of bench/calibrate_h200.py (calibration 1-2 with every
# swap, held out 3-6). Run from the repository root on the H200 with .whl/ (cp312 pydantic wheels) carried:
#     MODELS=tiny-moe,deep-llama BOOTS=1,2,3,4,5,6 bash bench/h200/strength_call1.sh
# Results land in $OUT: the bundles as a tar, h200-calib-records.jsonl, h200-calib-env.json, h200-calib-log.txt.
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R="python3 -m skupin.cli.reference"
for m in ${CAPTURE:-tiny-moe deep-llama}; do
  $R fixture generate --name $m --out /tmp/skupin-fixtures/$m
  for d in bfloat16 float32; do
    rm -rf gates/references/$m/h200-$d
    $R reference capture --sku nvidia-h200-vllm --model $m --model-dir /tmp/skupin-fixtures/$m \
       --dtype $d --out gates/references/$m/h200-$d
    $R reference verify gates/references/$m/h200-$d
  done
done
tar -cf $OUT/bundles.tar gates/references
python3 bench/calibrate_h200.py --out $OUT --models ${MODELS:-tiny-moe,deep-llama} --boots ${BOOTS:-1,2,3,4,5,6} \
  --boot-timeout 200 2>&1 | tee $OUT/h200-calib-log.txt
