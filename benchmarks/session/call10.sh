#!/usr/bin/env bash
# Device call 10 (nvidia-h200-x2), session of 2026-11-29 night, commit 2d7a7fc+33a3844 (overlapped scheduling,
# memoised tuning lookups): A/B of overlapped (async) vs synchronous scheduling on issue 6's bf16 workload, one
# engine per GPU in parallel; then the CUDA-graph correctness check, which now also runs every tiny family with
# overlap on (tokens vs graphs and vs HF/PEFT). The MoE-LoRA epilogue work in progress here is reverted first.
set -uo pipefail
cd "$(dirname "$0")/../.."
git checkout -q 5116ee6 -- kernels/fused_moe.py kernels/fused_moe_lora.py kernels/moe_experts_lora.py || exit 3
rm -f kernels/moe_lora_epilogue.py; git status --short > $OUT/tree.txt
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s10; rm -rf $S; mkdir -p $S/async $S/sync $S/b
T0=$(date +%s)
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --num-requests 64 --stagger 0.4
  --scenario-time 35 --profile-steps 5 --total-time 170"
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 10 190 python3 -m loraplex.cli bench serve $COMMON --work-dir $S/w0 --out $S/async > $S/async/log.txt 2>&1
  echo "async rc=$? at $(( $(date +%s)-T0 ))s" >> $S/async/log.txt
  OUT=$S/b timeout -k 5 $(( 540 - ($(date +%s)-T0) )) python3 benchmarks/engine/check_cuda_graphs.py > $S/b/log.txt 2>&1
  echo "graphs rc=$? at $(( $(date +%s)-T0 ))s" >> $S/b/log.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 10 190 python3 -m loraplex.cli bench serve $COMMON --no-async-scheduling --work-dir $S/w1 --out $S/sync \
    > $S/sync/log.txt 2>&1; echo "sync rc=$? at $(( $(date +%s)-T0 ))s" >> $S/sync/log.txt ) &
wait
tar czf "$OUT/call10.tgz" --exclude=w0 --exclude=w1 -C $S . 2>/dev/null
for r in async sync; do echo "===== $r"; grep '^\[bench\]\|rc=\|Traceback\|Error\|overlapped' $S/$r/log.txt | tail -7
  grep "^# arrival\|^# decode" $S/$r/profile_*.txt | cut -c1-330; done
echo "===== graphs"; grep "tokens==\|PASS\|FAIL\|async\|rc=" $S/b/log.txt | tail -30
echo "total $(( $(date +%s)-T0 ))s"
