#!/usr/bin/env bash
# Device call 15 (nvidia-h200), session of 2026-11-29 night: the LoRA kernel rows again with bench_time_ms
# measuring the L2 flush beside each op (calls 13-14 read 0.0 us for small ops: a flush time cached at the first
# call over-subtracted). Same command as call 14's bench.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
S=/tmp/s15; rm -rf $S; mkdir -p $S
timeout -k 5 150 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16 --only fused_moe_lora,lora_expand \
  --no-warm > $S/bench.md 2>&1; echo "bench rc=$?" >> $S/bench.md
cp $S/bench.md "$OUT/call15_bench.md"
grep "kernels\|lora_expand\|rc=" $S/bench.md | cut -c1-130
