#!/usr/bin/env bash
# Device call 5: the 8-adapter serving scenario with the LoRA tuning files of 121bdfe (GPU 0) vs the ones tuned in
# call 2 (GPU 1), same code, in parallel.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=12
S=/tmp/s5; rm -rf $S; mkdir -p $S/old $S/new
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --num-requests 64 --stagger 0.4
  --no-base-only --scenario-time 45 --profile-steps 5 --total-time 200"
( CUDA_VISIBLE_DEVICES=0 LORAPLEX_TUNING_DIR=$PWD/.session_old_tuning timeout -k 10 230 python3 -m loraplex.cli bench serve \
    $COMMON --work-dir $S/w0 --out $S/old > $S/old/log.txt 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout -k 10 230 python3 -m loraplex.cli bench serve $COMMON --work-dir $S/w1 --out $S/new \
    > $S/new/log.txt 2>&1 ) &
wait
tar czf "$OUT/call5.tgz" --exclude=w0 --exclude=w1 -C $S . 2>/dev/null
for r in old new; do echo "== $r"; grep '^\[bench\]' $S/$r/log.txt; grep "_moe_lora\|_lora_shrink\|_lora_expand\|Self CUDA time total" $S/$r/profile_adapters.txt | cut -c1-58,150-230; done
