#!/bin/bash
# One call of the `run` tool on the lent H200 for the shaped fixture (issue 29), everything with the project's own code:
#   1. the peaked-moe bundles (bf16 and float32) captured with `skupin reference capture`, verified, tarred;
#   2. bench/calibrate_h200.py on peaked-moe: calibration boots 1-2, held-out boots 3-4, every swap in boot 1
#      (the bf16-path, routing and one-expert faults included), each boot a fresh process;
#   3. the same new faults on tiny-moe and tiny-llama (boot 1, swaps only), to compare the fixtures;
#   4. bench/h200/honest_sets.py workers beside them: honest bf16 runs on fresh prompt sets, until their deadline.
# Everything comes back as three files in $OUT (the tool returns at most eight): bundles-peaked-moe.tar,
# shaped-results.tar.gz (records, env, logs) and job.log.
#     HONEST_DEADLINE=300 bash bench/h200/shaped_job.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
start=$SECONDS
log() { echo "[$((SECONDS - start)) s] $*"; }
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R="python3 -m skupin.cli.reference"
W=/tmp/shaped
mkdir -p $W
FIX=/tmp/skupin-fixtures
$R fixture generate --name peaked-moe --out $FIX/peaked-moe > /dev/null || exit 1
for m in tiny-moe; do $R fixture generate --name $m --out $FIX/$m > /dev/null; done
log "fixtures generated"
for w in 0 1 2; do
  timeout $((${HONEST_DEADLINE:-300} + 90)) python3 bench/h200/honest_sets.py --out $W/honest --model peaked-moe \
    --worker $w --workers 3 --deadline ${HONEST_DEADLINE:-300} > $W/honest-$w.log 2>&1 &
done
for d in bfloat16 float32; do
  rm -rf gates/references/peaked-moe/h200-$d
  $R reference capture --sku nvidia-h200-vllm --model peaked-moe --model-dir $FIX/peaked-moe --dtype $d \
     --full-logprobs 1 --out gates/references/peaked-moe/h200-$d > $W/capture-$d.log 2>&1 || { cat $W/capture-$d.log; exit 1; }
  $R reference verify gates/references/peaked-moe/h200-$d
done
tar -cf $OUT/bundles-peaked-moe.tar gates/references/peaked-moe
log "bundles captured"
NEW=rope-table-bf16,norm-no-upcast,moe-no-renorm,router-no-upcast,expert-int4-one
timeout 300 python3 bench/calibrate_h200.py --out $W/cal-others --models tiny-moe,tiny-llama --boots 1 \
  --only-swaps $NEW --boot-timeout 280 ${SMOKE:+--smoke} > $W/cal-others.log 2>&1 &
others=$!
timeout 420 python3 bench/calibrate_h200.py --out $W/cal --models peaked-moe --boots 1,2,3,4 --boot-timeout 200 ${SMOKE:+--smoke} \
  > $W/cal.log 2>&1
log "peaked-moe calibration: exit $?"
wait $others; log "tiny-moe/tiny-llama new swaps: exit $?"
wait
log "honest prompt sets: $(cat $W/honest/*.jsonl 2>/dev/null | wc -l) runs"
tail -n 3 $W/*.log
tar -czf $OUT/shaped-results.tar.gz -C $W .
log "done"
