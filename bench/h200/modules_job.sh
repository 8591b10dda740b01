#!/bin/bash
# One call of the `run` tool on the lent H200 for the module ops (issue 29), with the project's own code: for every
# fixture with nvidia-hopper entries, bench/modules/faults.py runs the probe's ops check (the op battery and the module
# ops, at bfloat16 and float32) on honest variants -- two processes each of sdpa and eager attention -- and on every
# fault it makes on the loaded model's instance; the results come back as one tar in $OUT.
#     bash bench/h200/modules_job.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
start=$SECONDS
log() { echo "[$((SECONDS - start)) s] $*"; }
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/modules
FIX=/tmp/skupin-fixtures
mkdir -p $W
MODELS="peaked-moe tiny-moe tiny-llama deep-llama"
for m in $MODELS; do python3 -m skupin.cli.reference fixture generate --name $m --out $FIX/$m > /dev/null || exit 1; done
log "fixtures generated"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $W/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $W/gpu.txt
args=""; for m in $MODELS; do args="$args --model $m"; done
# boot 1: every variant; boot 2: the honest ones again, in a fresh process
timeout 400 python3 bench/modules/faults.py --fixtures $FIX --out $W/h200-boot1 --device cuda $args > $W/boot1.log 2>&1
log "boot 1: exit $?"
timeout 200 python3 bench/modules/faults.py --fixtures $FIX --out $W/h200-boot2 --device cuda $args \
  --variant honest --variant honest-eager > $W/boot2.log 2>&1
log "boot 2: exit $?"
grep -v "Loading\|Experts" $W/boot1.log | tail -n 60
tar -czf $OUT/modules-h200.tar.gz -C $W .
log "done"
