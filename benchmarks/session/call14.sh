#!/usr/bin/env bash
# Device call 14 (nvidia-h200), session of 2026-11-29 night, commit a90ee4d: after the MXFP4 branch went into the
# shared fused MoE kernels, the bf16 / INT8 paths checked again (fused_moe*, fused_moe_lora, moe_experts_lora in
# CUDA graphs), and the LoRA kernel rows re-timed (call 13's fused_moe_lora rows read 0.0-2.0 us).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
S=/tmp/s14; rm -rf $S; mkdir -p $S
timeout -k 5 100 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,16,256 --only fused_moe \
  > $S/check.txt 2>&1; echo "check rc=$?" >> $S/check.txt
OUT=$S timeout -k 5 80 python3 benchmarks/engine/check_moe_lora_gpu.py > $S/moe_lora.txt 2>&1; echo "moe-lora rc=$?" >> $S/moe_lora.txt
timeout -k 5 70 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16 --only fused_moe_lora,lora_expand \
  --no-warm > $S/bench.md 2>&1; echo "bench rc=$?" >> $S/bench.md
tar czf "$OUT/call14.tgz" -C $S . 2>/dev/null
grep "FAIL\|worst\|rc=" $S/check.txt | head; grep -v "^\s*$" $S/moe_lora.txt | tail -12
grep "kernels\|lora_expand\|rc=" $S/bench.md | cut -c1-130
