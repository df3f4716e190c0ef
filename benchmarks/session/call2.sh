#!/usr/bin/env bash
# Device call 2 (nvidia-h200-x2): GPU 0 = kernel checks/bench/tune (benchmarks/kernels/device_run.sh);
# GPU 1 = issue-6 INT8 experts serving, then the HF+PEFT baseline. Everything in $OUT/call2.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s2; rm -rf $S; mkdir -p $S/k $S/int8 $S/hf
T0=$(date +%s)
( CUDA_VISIBLE_DEVICES=0 OUT=$S/k TOTAL_S=345 timeout -k 5 380 bash benchmarks/kernels/device_run.sh > $S/k/run.txt 2>&1
  echo "kernels rc=$? at $(( $(date +%s)-T0 ))s" >> $S/k/run.txt ) &
P0=$!
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --work-dir $S/w"
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 10 330 python3 -m loraplex.cli bench serve $COMMON --num-requests 64 --stagger 0.4 --scenario-time 60 \
    --quantization int8 --total-time 300 --out $S/int8 > $S/int8/log.txt 2>&1; echo "int8 rc=$? at $(( $(date +%s)-T0 ))s" >> $S/int8/log.txt
  timeout -k 10 $(( 540 - ($(date +%s)-T0) )) python3 -m loraplex.cli bench serve $COMMON --hf-only --hf-output-len 32 \
    --total-time $(( 500 - ($(date +%s)-T0) )) --out $S/hf > $S/hf/log.txt 2>&1; echo "hf rc=$? at $(( $(date +%s)-T0 ))s" >> $S/hf/log.txt ) &
P1=$!
wait $P0 $P1
tar czf "$OUT/call2.tgz" --exclude=w -C $S . 2>/dev/null
echo "===== kernels"; cat $S/k/run.txt | tail -5; grep -v "^\s*$" $S/k/bench.md 2>/dev/null | head -70
echo "===== tuned"; grep -v "^\s*$" $S/k/bench_tuned.md 2>/dev/null | head -30
echo "===== int8"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/int8/log.txt | tail -20
echo "===== hf"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/hf/log.txt | tail -20
echo "total $(( $(date +%s)-T0 ))s"
