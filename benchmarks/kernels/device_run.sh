#!/usr/bin/env bash
# One GPU session: correctness at real shapes, tuning (GPT-OSS-20B, then Qwen3-30B-A3B in the time left),
# tuned-config correctness, and the decode benchmark. Writes under $OUT (at most 8 files):
#   check.txt tune.txt bench.txt tuning/<device>/<op>.json
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
BUDGET=${BUDGET:-520}
mkdir -p "$OUT/tuning"
export PYTHONUNBUFFERED=1 LORAPLEX_TUNING_DIR="$OUT/tuning"
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  date -u; } > "$OUT/check.txt" 2>&1
echo "## default configs" >> "$OUT/check.txt"
timeout 110 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,33,256 >> "$OUT/check.txt" 2>&1
echo "check1 done at $(( $(date +%s) - start ))s" >> "$OUT/check.txt"
timeout 190 python3 -m loraplex.cli tune --model gpt-oss-20b --m 1,16,64,256 --time-budget 150 > "$OUT/tune.txt" 2>&1
echo "tune done at $(( $(date +%s) - start ))s" >> "$OUT/tune.txt"
timeout 100 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64,256 > "$OUT/bench.txt" 2>&1
echo "bench done at $(( $(date +%s) - start ))s" >> "$OUT/bench.txt"
echo "## tuned configs" >> "$OUT/check.txt"
timeout 60 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 16,64 >> "$OUT/check.txt" 2>&1
l=$(left)
if [ "$l" -gt 45 ]; then
  timeout "$l" python3 -m loraplex.cli tune --model qwen3-30b-a3b --m 1,16,64,256 --time-budget $((l - 30)) \
    >> "$OUT/tune.txt" 2>&1
fi
echo "all done at $(( $(date +%s) - start ))s" >> "$OUT/tune.txt"
