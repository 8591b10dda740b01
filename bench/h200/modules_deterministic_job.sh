#!/bin/bash
# One call of the `run` tool on the lent H200: honest module-op runs with deterministic algorithms (and plain), judged
# against the committed nvidia-hopper entries by bench/modules/judge_committed.py.
#     bash bench/h200/modules_deterministic_job.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
FIX=/tmp/skupin-fixtures; W=/tmp/det; mkdir -p $W
for m in peaked-moe tiny-moe tiny-llama deep-llama; do python3 -m skupin.cli.reference fixture generate --name $m --out $FIX/$m > /dev/null || exit 1; done
python3 bench/modules/faults.py --fixtures $FIX --out $W/h200-det --device cuda --model peaked-moe --model tiny-moe --model tiny-llama --model deep-llama --variant honest-deterministic --variant honest > $W/det.log 2>&1
echo "faults exit $?"
python3 bench/modules/judge_committed.py nvidia-hopper=$W/h200-det
tar -czf $OUT/det.tar.gz -C $W .
