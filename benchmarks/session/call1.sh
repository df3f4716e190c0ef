#!/usr/bin/env bash
# Device call 1 (nvidia-h200-x2): GPU 0 = expert-LoRA op check, then CUDA-graph check; GPU 1 = issue-6 bf16 serving
# (base-only + 8 adapters, graphs). Everything lands in $OUT/call1.tgz; summaries on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s1; rm -rf $S; mkdir -p $S/a $S/b $S/serve
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.used --format=csv > $S/env.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $S/env.txt 2>&1
( export CUDA_VISIBLE_DEVICES=0
  OUT=$S/a timeout -k 5 170 python3 benchmarks/engine/check_moe_lora_gpu.py > $S/a/log.txt 2>&1; echo "A rc=$? at $(( $(date +%s)-T0 ))s" >> $S/a/log.txt
  OUT=$S/b timeout -k 5 $(( 540 - ($(date +%s)-T0) )) python3 benchmarks/engine/check_cuda_graphs.py > $S/b/log.txt 2>&1; echo "B rc=$? at $(( $(date +%s)-T0 ))s" >> $S/b/log.txt
) &
P0=$!
( CUDA_VISIBLE_DEVICES=1 timeout -k 10 540 python3 -m loraplex.cli bench serve --num-requests 64 --concurrency 16 \
    --input-len 1600 --output-len 600 --num-adapters 8 --rank 32 --stagger 0.4 --scenario-time 75 --profile-steps 5 \
    --total-time 500 --work-dir $S/w --out $S/serve > $S/serve/log.txt 2>&1; echo "serve rc=$? at $(( $(date +%s)-T0 ))s" >> $S/serve/log.txt ) &
P1=$!
wait $P0 $P1
tar czf "$OUT/call1.tgz" --exclude='*.safetensors' --exclude=w -C $S . 2>/dev/null
cat $S/env.txt
echo "===== A"; grep -v "Warning\|warn(" $S/a/log.txt | tail -40
echo "===== B"; grep -v "Warning\|warn(" $S/b/log.txt | tail -60
echo "===== serve"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/serve/log.txt | tail -40; cat $S/serve/bench_serve.md 2>/dev/null | head -60
echo "total $(( $(date +%s)-T0 ))s"
