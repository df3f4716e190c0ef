#!/usr/bin/env bash
# Device call 11 (nvidia-h200-x2), session of 2026-11-29 night, commit ceb13a7 (the expert-LoRA epilogue path,
# off by default). Files other helpers are still editing are restored to ceb13a7 from .session_head.tar (made
# with `git archive HEAD <modified files>` just before the call) and their new files removed.
# GPU 0: check_moe_lora_gpu.py (bf16 and INT8, M = 1, 16, 64, 256: separate vs epilogue vs base, errors, graphs).
# GPU 1 then GPU 0: the 8-adapter serving scenario with LORAPLEX_MOE_LORA_EPILOGUE=1 and =0 side by side.
set -uo pipefail
cd "$(dirname "$0")/../.."
tar xf .session_head.tar || exit 3
rm -f kernels/mxfp4.py kernels/mxfp4_dequant.py kernels/fused_moe_mxfp4.py engine/quantization/mxfp4_experts.py \
  engine/quantization/replace.py benchmarks/engine/train_tiny.py
git status --short > $OUT/tree.txt
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=12
S=/tmp/s11; rm -rf $S; mkdir -p $S/epi $S/sep $S/m
T0=$(date +%s)
COMMON="--num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 --output-len 600 --num-requests 64 --stagger 0.4
  --scenario-time 35 --profile-steps 5 --total-time 150 --no-base-only"
( export CUDA_VISIBLE_DEVICES=0
  OUT=$S/m timeout -k 5 200 python3 benchmarks/engine/check_moe_lora_gpu.py > $S/m/log.txt 2>&1
  echo "moe-lora rc=$? at $(( $(date +%s)-T0 ))s" >> $S/m/log.txt
  LORAPLEX_MOE_LORA_EPILOGUE=0 timeout -k 10 170 python3 -m loraplex.cli bench serve $COMMON --work-dir $S/w0 --out $S/sep \
    > $S/sep/log.txt 2>&1; echo "sep rc=$? at $(( $(date +%s)-T0 ))s" >> $S/sep/log.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  LORAPLEX_MOE_LORA_EPILOGUE=1 timeout -k 10 170 python3 -m loraplex.cli bench serve $COMMON --work-dir $S/w1 --out $S/epi \
    > $S/epi/log.txt 2>&1; echo "epi rc=$? at $(( $(date +%s)-T0 ))s" >> $S/epi/log.txt ) &
wait
tar czf "$OUT/call11.tgz" --exclude=w0 --exclude=w1 -C $S . 2>/dev/null
echo "===== moe-lora"; grep -v "^\s*$" $S/m/log.txt | tail -30 | cut -c1-170
for r in epi sep; do echo "===== $r"; grep '^\[bench\]\|rc=\|Traceback\|Error' $S/$r/log.txt | tail -4
  grep "Self CUDA time total" $S/$r/profile_adapters.txt | head -1
  grep "_moe_gate_up\|_moe_down\|_moe_lora\|_act_and" $S/$r/profile_adapters.txt | head -6 | awk '{print $1, $(NF-2), $NF}'; done
echo "total $(( $(date +%s)-T0 ))s"
