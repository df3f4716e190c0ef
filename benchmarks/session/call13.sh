#!/usr/bin/env bash
# Device call 13 (nvidia-h200-x2), session of 2026-11-29 night, commit fc1b87b (MXFP4 experts).
# GPU 0: fused_moe_mxfp4 (and INT8 beside it) against the references at GPT-OSS-20B shapes incl. expert LoRA on
#        MXFP4 base weights in a CUDA graph; tune fused_moe_mxfp4 (M = 1, 16, 64, 256, 1024, 2048); the kernel
#        bench with the tuned file.
# GPU 1: issue 6's serving run with MXFP4 experts, default configs; then again with the tuned file once it exists.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s13; rm -rf $S; mkdir -p $S/k $S/mx $S/mxt
cp -r tuning_configs $S/tuning
T0=$(date +%s)
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --num-requests 64 --stagger 0.4
  --scenario-time 35 --quantization mxfp4"
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 120 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,16,64,256 \
    --only fused_moe_mxfp4,fused_moe_int8 > $S/k/check.txt 2>&1; echo "check rc=$?" >> $S/k/check.txt
  timeout -k 5 150 python3 -m loraplex.cli tune --model gpt-oss-20b --m 1,16,64,256,1024,2048 --ops fused_moe_mxfp4 \
    --time-budget 120 --out $S/tuning > $S/k/tune.txt 2>&1; echo "tune rc=$?" >> $S/k/tune.txt
  cp $S/tuning/NVIDIA_H200/fused_moe_mxfp4.json $S/k/ 2>/dev/null; touch $S/tuned
  LORAPLEX_TUNING_DIR=$S/tuning timeout -k 5 80 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b \
    --m 1,16,64,256 --only fused_moe_mxfp4,fused_moe_int8,fused_moe --no-warm > $S/k/bench.md 2>&1
  echo "bench rc=$?" >> $S/k/bench.md ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 10 170 python3 -m loraplex.cli bench serve $COMMON --total-time 150 --work-dir $S/w1 --out $S/mx \
    > $S/mx/log.txt 2>&1; echo "mxfp4 rc=$? at $(( $(date +%s)-T0 ))s" >> $S/mx/log.txt
  for i in $(seq 60); do [ -f $S/tuned ] && break; sleep 2; done
  LORAPLEX_TUNING_DIR=$S/tuning timeout -k 10 $(( 440 - ($(date +%s)-T0) )) python3 -m loraplex.cli bench serve $COMMON \
    --profile-steps 5 --total-time $(( 420 - ($(date +%s)-T0) )) --work-dir $S/w1 --out $S/mxt > $S/mxt/log.txt 2>&1
  echo "mxfp4 tuned rc=$? at $(( $(date +%s)-T0 ))s" >> $S/mxt/log.txt ) &
wait
tar czf "$OUT/call13.tgz" --exclude=w1 -C $S . 2>/dev/null
echo "===== check"; grep -i "mxfp4\|int8\|FAIL\|rc=" $S/k/check.txt | cut -c1-160 | head -24
echo "===== tune"; grep "fused_moe_mxfp4\|rc=" $S/k/tune.txt | cut -c1-200 | tail -8
echo "===== bench"; grep "fused_moe\|rc=" $S/k/bench.md | cut -c1-140
for r in mx mxt; do echo "===== $r"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/$r/log.txt | tail -5; done
grep "Self CUDA time total" $S/mxt/profile_*.txt 2>/dev/null | head -4
echo "total $(( $(date +%s)-T0 ))s"
