#!/usr/bin/env bash
# Device call 9 (nvidia-h200-x2), session of 2026-11-29 night: the Triton rope / routing kernels (e394400) checked
# and timed, fused_moe / fused_moe_int8 tuned at prefill sizes (M = 1024, 2048), then both serving runs with them.
# Work of helpers still in progress on this machine is reverted first to the committed code (engine/, the bench
# driver, the MoE kernels), so this call measures e394400.
set -uo pipefail
cd "$(dirname "$0")/../.."
# (the device's git holds the session-start commit 5116ee6; none of these paths changed between it and e394400)
git checkout -q 5116ee6 -- engine loraplex/bench/engine_setup.py loraplex/bench/report.py loraplex/bench/serve.py \
  loraplex/commands kernels/fused_moe.py kernels/fused_moe_lora.py kernels/moe_experts_lora.py || exit 3
rm -f engine/step_pipeline.py kernels/moe_lora_epilogue.py; git status --short > $OUT/tree.txt
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s9; rm -rf $S; mkdir -p $S/bf16 $S/int8 $S/k $S/b $S/tune
cp -r tuning_configs $S/tuning
T0=$(date +%s)
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --num-requests 64 --stagger 0.4
  --scenario-time 35 --profile-steps 5"
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 170 python3 -m loraplex.cli tune --model gpt-oss-20b --m 1024,2048 --ops fused_moe,fused_moe_int8 \
    --time-budget 150 --out $S/tuning > $S/tune/log.txt 2>&1; echo "tune rc=$? at $(( $(date +%s)-T0 ))s" >> $S/tune/log.txt
  cp -r $S/tuning/NVIDIA_H200 $S/tune/ 2>/dev/null
  LORAPLEX_TUNING_DIR=$S/tuning timeout -k 10 $(( 520 - ($(date +%s)-T0) )) python3 -m loraplex.cli bench serve $COMMON \
    --total-time $(( 490 - ($(date +%s)-T0) )) --work-dir $S/w0 --out $S/bf16 > $S/bf16/log.txt 2>&1
  echo "bf16 rc=$? at $(( $(date +%s)-T0 ))s" >> $S/bf16/log.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 120 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,16,64,256 --only rotary,moe_route \
    > $S/k/check.txt 2>&1; echo "check rc=$?" >> $S/k/check.txt
  timeout -k 5 90 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64,256 --only rotary,moe_route \
    > $S/k/bench.md 2>&1; echo "bench rc=$?" >> $S/k/bench.md
  OUT=$S/b timeout -k 5 150 python3 benchmarks/engine/check_cuda_graphs.py > $S/b/log.txt 2>&1
  echo "graphs rc=$? at $(( $(date +%s)-T0 ))s" >> $S/b/log.txt
  timeout -k 10 $(( 520 - ($(date +%s)-T0) )) python3 -m loraplex.cli bench serve $COMMON --quantization int8 \
    --total-time $(( 490 - ($(date +%s)-T0) )) --work-dir $S/w1 --out $S/int8 > $S/int8/log.txt 2>&1
  echo "int8 rc=$? at $(( $(date +%s)-T0 ))s" >> $S/int8/log.txt ) &
wait
tar czf "$OUT/call9.tgz" --exclude=w0 --exclude=w1 -C $S . 2>/dev/null
echo "===== tune"; tail -6 $S/tune/log.txt
echo "===== check"; grep -i "rotary\|moe_route\|FAIL\|rc=" $S/k/check.txt | head -20
echo "===== bench"; grep "rotary\|moe_route\|rc=" $S/k/bench.md | cut -c1-150
echo "===== graphs"; sed -n '/==== CUDA graphs check/,$p' $S/b/log.txt | tail -14; tail -2 $S/b/log.txt
for r in bf16 int8; do echo "===== $r"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/$r/log.txt | tail -6
  grep "^# arrival\|^# decode" $S/$r/profile_*.txt | cut -c1-330; done
echo "total $(( $(date +%s)-T0 ))s"
