#!/usr/bin/env bash
# One GPU session (at most ~520 s): float32 engine exactness, kernel correctness at real shapes, LoRA tuning at
# decode sizes, the decode benchmark. Writes under $OUT (at most 8 files come back, so the tuning folder, kept
# outside $OUT, is copied in as a tar after tuning): env.txt fp32.txt check.txt tune.txt bench.txt tuning.tar
# PHASES picks what runs (fp32,check,tune,tunedcheck,bench,probe; default: fp32,check,tune,bench); ONLY limits
# check and bench to label prefixes; TUNE_OPS / TUNE_M / TUNE_BUDGET shape the tuning step.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
PHASES=${PHASES:-fp32,check,tune,bench}
TUNE_OPS=${TUNE_OPS:-lora_shrink,lora_expand,fused_moe_lora}
TUNE_M=${TUNE_M:-1,16,64}
TUNE_BUDGET=${TUNE_BUDGET:-80}
ONLY=${ONLY:-}
TUNING=${TUNING:-/tmp/loraplex_tuning}
export PYTHONUNBUFFERED=1 LORAPLEX_TUNING_DIR="$TUNING"
dev=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
mkdir -p "$TUNING/$dev" "$OUT"
cp tuning_configs/"$dev"/*.json "$TUNING/$dev/" 2>/dev/null  # tuning merges into the committed files
start=$(date +%s)
stamp() { echo "[$1 done at $(( $(date +%s) - start ))s]"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  date -u; } > "$OUT/env.txt" 2>&1
has() { [[ ",$PHASES," == *",$1,"* ]]; }
if has fp32; then
  timeout 150 python3 benchmarks/kernels/check_engine_fp32.py > "$OUT/fp32.txt" 2>&1; stamp fp32 >> "$OUT/fp32.txt"
fi
if has check; then
  timeout 110 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,33,256 ${ONLY:+--only "$ONLY"} > "$OUT/check.txt" 2>&1
  stamp check >> "$OUT/check.txt"
fi
if has tune; then
  timeout $((TUNE_BUDGET + 40)) python3 -m loraplex.cli tune --model gpt-oss-20b --m "$TUNE_M" --ops "$TUNE_OPS" \
    --time-budget "$TUNE_BUDGET" > "$OUT/tune.txt" 2>&1; stamp tune >> "$OUT/tune.txt"
  tar -cf "$OUT/tuning.tar" -C "$TUNING" .
fi
if has tunedcheck; then
  timeout 90 python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 16,64 ${ONLY:+--only "$ONLY"} >> "$OUT/check.txt" 2>&1
  stamp tunedcheck >> "$OUT/check.txt"
fi
if has bench; then
  timeout 140 python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64,256 ${ONLY:+--only "$ONLY"} \
    > "$OUT/bench.txt" 2>&1
  stamp bench >> "$OUT/bench.txt"
fi
if has probe; then
  timeout 90 python3 benchmarks/kernels/probe_lora.py --model gpt-oss-20b --m 1,16,64 > "$OUT/probe.txt" 2>&1
  stamp probe >> "$OUT/probe.txt"
fi
tail -n 12 "$OUT/fp32.txt" 2>/dev/null; grep -E "FAIL|worst|compile" "$OUT/check.txt" 2>/dev/null
grep -E "x[0-9]" "$OUT/tune.txt" 2>/dev/null | cut -c1-100; cat "$OUT/bench.txt" "$OUT/probe.txt" 2>/dev/null
