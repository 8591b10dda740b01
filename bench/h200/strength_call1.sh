#!/bin/bash
# Device call 1 of issue 18's H200 work: capture the tiny-moe bundles with the project's own capture, then the
# calibration boots (1, 2: honest runs + every swap) for tiny-llama, tiny-moe and llama-1k. Run from the
# repository root on the H200 with .whl/ (cp312 pydantic wheels) carried; results land in $OUT.
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
R="python3 -m skupin.cli.reference"
$R fixture generate --name tiny-moe --out /tmp/skupin-fixtures/tiny-moe
for d in bfloat16 float32; do
  $R reference capture --sku nvidia-h200-vllm --model tiny-moe --model-dir /tmp/skupin-fixtures/tiny-moe \
     --dtype $d --out gates/references/tiny-moe/h200-$d
  $R reference verify gates/references/tiny-moe/h200-$d
done
tar -cf $OUT/tiny-moe-bundles.tar gates/references/tiny-moe
python3 bench/calibrate_h200.py --out $OUT --boots ${BOOTS:-1,2} 2>&1 | tee $OUT/h200-calib-log.txt
