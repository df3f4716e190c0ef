#!/usr/bin/env bash
# Device call 4 (nvidia-h200-x2), after the split-KV attention, shape-aware LoRA defaults + tuned configs and the
# host-overhead work: GPU 0 = issue-6 bf16 serving (base-only + 8 adapters, graphs, profile); GPU 1 = split-KV
# checks, paged-attention bench and split sweep, INT8 serving, then the CUDA-graph correctness check (tiny families
# vs HF/PEFT) and the GPT-OSS-shape step times. Everything in $OUT/call4.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s4; rm -rf $S; mkdir -p $S/serve $S/int8 $S/k $S/b
T0=$(date +%s)
git log -1 --format=%H > $S/env.txt 2>&1; git status --short >> $S/env.txt 2>&1
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --num-requests 64 --stagger 0.4"
( CUDA_VISIBLE_DEVICES=0 timeout -k 10 330 python3 -m loraplex.cli bench serve $COMMON --scenario-time 75 \
    --profile-steps 5 --total-time 300 --work-dir $S/w0 --out $S/serve > $S/serve/log.txt 2>&1
  echo "serve rc=$? at $(( $(date +%s)-T0 ))s" >> $S/serve/log.txt ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 100 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,33 --only paged > $S/k/check.txt 2>&1
  echo "check rc=$?" >> $S/k/check.txt
  timeout -k 5 90 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64,256 --only paged \
    > $S/k/bench.md 2>&1; echo "bench rc=$?" >> $S/k/bench.md
  timeout -k 5 60 python3 benchmarks/kernels/sweep_paged_attention_splits.py > $S/k/sweep.txt 2>&1; echo "sweep rc=$?" >> $S/k/sweep.txt
  timeout -k 10 200 python3 -m loraplex.cli bench serve $COMMON --scenario-time 50 --quantization int8 \
    --total-time 180 --work-dir $S/w1 --out $S/int8 > $S/int8/log.txt 2>&1; echo "int8 rc=$? at $(( $(date +%s)-T0 ))s" >> $S/int8/log.txt
  OUT=$S/b timeout -k 5 $(( 560 - ($(date +%s)-T0) )) python3 benchmarks/engine/check_cuda_graphs.py > $S/b/log.txt 2>&1
  echo "graphs rc=$? at $(( $(date +%s)-T0 ))s" >> $S/b/log.txt ) &
P1=$!
wait $P0 $P1
tar czf "$OUT/call4.tgz" --exclude=w0 --exclude=w1 -C $S . 2>/dev/null
echo "===== kernels"; grep -i "split\|compile-once paged\|worst\|rc=" $S/k/check.txt | tail -14; grep "paged\|rc=" $S/k/bench.md; cat $S/k/sweep.txt
echo "===== serve"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/serve/log.txt | tail -12
echo "===== int8"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/int8/log.txt | tail -8
echo "===== graphs"; sed -n '/==== CUDA graphs check/,$p' $S/b/log.txt | tail -24; tail -2 $S/b/log.txt
echo "total $(( $(date +%s)-T0 ))s"
