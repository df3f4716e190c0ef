#!/usr/bin/env bash
# Device call 8 (nvidia-h200-x2), session of 2026-11-29 night, at the session-start code (5116ee6 + the arrival
# profile): where a step's time goes now. GPU 0: bf16 serving, base-only then 8 adapters, decode + arrival profiles.
# GPU 1: the same with INT8 experts, then the LoRA kernel rows of issue 5 three times (run-to-run spread at M=16).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s8; rm -rf $S; mkdir -p $S/bf16 $S/int8 $S/k
T0=$(date +%s)
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --num-requests 64 --stagger 0.4
  --scenario-time 35 --profile-steps 5"
( CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 python3 -m loraplex.cli bench serve $COMMON --total-time 180 \
    --work-dir $S/w0 --out $S/bf16 > $S/bf16/log.txt 2>&1; echo "bf16 rc=$? at $(( $(date +%s)-T0 ))s" >> $S/bf16/log.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 10 150 python3 -m loraplex.cli bench serve $COMMON --quantization int8 --total-time 130 \
    --work-dir $S/w1 --out $S/int8 > $S/int8/log.txt 2>&1; echo "int8 rc=$? at $(( $(date +%s)-T0 ))s" >> $S/int8/log.txt
  for p in 1 2 3; do
    timeout -k 5 60 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64 --no-warm \
      --only fused_moe_lora,lora_expand,lora_shrink > $S/k/pass$p.md 2>&1; echo "pass$p rc=$?" >> $S/k/pass$p.md
  done ) &
wait
tar czf "$OUT/call8.tgz" --exclude=w0 --exclude=w1 -C $S . 2>/dev/null
echo "===== bf16"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/bf16/log.txt | tail -8
echo "===== int8"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/int8/log.txt | tail -8
echo "===== kernels"; for p in 1 2 3; do grep "M=16\|| 16 \|rc=" $S/k/pass$p.md | cut -c1-160 | head -12; done
echo "total $(( $(date +%s)-T0 ))s"
