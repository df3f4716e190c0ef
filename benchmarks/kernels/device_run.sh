#!/usr/bin/env bash
# The kernels at GPT-OSS-20B shapes in one device run on one H200 (kind nvidia-h200), at most TOTAL_S (default
# 345 s) wall: kernel correctness at real shapes (every op and the LoRA variants: fused_moe_lora one-kernel / PDL,
# lora_expand PDL), the decode benchmark with the committed configs, LoRA tuning, the benchmark again with the
# tuned configs, and the tuned configs' check.
# Every stage runs under its own timeout, capped by what is left of TOTAL_S; a failed stage is logged and the
# next one runs. Writes under $OUT (8 files, the most that come back):
#   env.txt  check.txt (check + tuned check)  bench.md bench.json (committed configs)  tune.txt
#   tuning.tar (the tuned tuning_configs folder: committed files merged with the new entries)
#   bench_tuned.md bench_tuned.json (LoRA ops, tuned configs)
# Expected (H200, wall): check ~50 s: every row "ok", worst rel. error < 1e-2, compile-once OK for each kernel
#   incl. moe_lora_fused, "(.., graph)" rows ok (PDL inside a CUDA graph). bench ~70 s: fused_moe M=16 ~95%
#   (cold = warm, its weights exceed L2); LoRA rows slower cold than warm at M <= 16 (their 2-35 MB stay in the
#   50 MB L2 when warm); "(two kernels+PDL)" 1-3 us under the plain row at M <= 16, "(fused)" best at M=1 if
#   anywhere. tune ~100 s: lines "x<speed-up>" per (op, M), PDL/FUSED keys in the chosen configs where they
#   win. bench_tuned ~40 s: the tuned/default column for lora_shrink/lora_expand/fused_moe_lora at M=1,16,64.
# PHASES picks what runs (check,bench,tune,benchtuned,tunedcheck; extra: fp32, probe, which add a file each);
# ONLY limits check and the first bench to label prefixes; TUNE_OPS / TUNE_M / TUNE_BUDGET / TUNE_TARGETS (the dense
# LoRA projections, `loraplex tune --lora-targets`: qkv,o) shape the tuning.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
PHASES=${PHASES:-check,bench,tune,benchtuned,tunedcheck}
TUNE_OPS=${TUNE_OPS:-lora_shrink,lora_expand,fused_moe_lora}
TUNE_M=${TUNE_M:-1,16,64}
TUNE_TARGETS=${TUNE_TARGETS:-qkv,o}
TUNE_BUDGET=${TUNE_BUDGET:-75}
TOTAL_S=${TOTAL_S:-345}
ONLY=${ONLY:-}
LORA_ONLY="lora_,fused_moe_lora"
TUNING=${TUNING:-/tmp/loraplex_tuning}
export PYTHONUNBUFFERED=1
unset LORAPLEX_TUNING_DIR  # check and bench read the committed tuning_configs/
start=$(date +%s)
mkdir -p "$OUT"
dev=$(timeout 60 python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
mkdir -p "$TUNING/$dev"
# tuning merges into the committed files: the ones a read uses (same_as.json followed), copied as real files
timeout 60 python3 -c "import shutil, sys; from loraplex.kernels import tuning
for f in tuning.device_files(sys.argv[1], 'tuning_configs').values(): shutil.copy(f, sys.argv[2])" \
  "$dev" "$TUNING/$dev/"
stamp() { echo "[$1 rc=$2 done at $(( $(date +%s) - start ))s]"; }
# timeout for a stage: its own limit, capped by what is left of TOTAL_S (at least 5 s)
limit() { local left=$(( TOTAL_S - ($(date +%s) - start) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
  timeout 60 python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'triton', triton.__version__, torch.cuda.get_device_name(), 'L2', torch.cuda.get_device_properties().L2_cache_size)"
  date -u; git log -1 --format=%H 2>/dev/null; git status --short 2>/dev/null | head -40; } > "$OUT/env.txt" 2>&1
has() { [[ ",$PHASES," == *",$1,"* ]]; }
if has fp32; then
  timeout "$(limit 150)" python3 benchmarks/kernels/check_engine_fp32.py > "$OUT/fp32.txt" 2>&1
  stamp fp32 $? >> "$OUT/fp32.txt"
fi
if has check; then  # ~50 s: every op at M=1,33,256 plus the LoRA variants, compile-once
  timeout "$(limit 70)" python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,33,256 \
    ${ONLY:+--only "$ONLY"} > "$OUT/check.txt" 2>&1
  stamp check $? >> "$OUT/check.txt"
fi
if has bench; then  # ~70 s: all ops, M=1,16,64,256, cold and warm L2, LoRA variants
  timeout "$(limit 90)" python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64,256 \
    ${ONLY:+--only "$ONLY"} --json "$OUT/bench.json" > "$OUT/bench.md" 2>&1
  stamp bench $? >> "$OUT/bench.md"
fi
if has tune; then  # TUNE_BUDGET + compiles of the last candidates
  timeout "$(limit $((TUNE_BUDGET + 30)))" python3 -m loraplex.cli tune --model gpt-oss-20b --m "$TUNE_M" \
    --ops "$TUNE_OPS" --lora-targets "$TUNE_TARGETS" --time-budget "$TUNE_BUDGET" --out "$TUNING" \
    > "$OUT/tune.txt" 2>&1
  stamp tune $? >> "$OUT/tune.txt"
  tar -cf "$OUT/tuning.tar" -C "$TUNING" .
fi
if has benchtuned; then  # ~40 s: LoRA ops with the tuned configs (M=256 uses the M=64 entry)
  LORAPLEX_TUNING_DIR="$TUNING" timeout "$(limit 55)" python3 benchmarks/kernels/bench_kernels.py \
    --model gpt-oss-20b --m 1,16,64 --only "$LORA_ONLY" --no-warm --json "$OUT/bench_tuned.json" \
    > "$OUT/bench_tuned.md" 2>&1
  stamp benchtuned $? >> "$OUT/bench_tuned.md"
fi
if has tunedcheck; then  # the tuned configs (and variants) against the references
  LORAPLEX_TUNING_DIR="$TUNING" timeout "$(limit 30)" python3 benchmarks/kernels/check_gpu.py \
    --model gpt-oss-20b --m 1,16,64 --only "$LORA_ONLY" >> "$OUT/check.txt" 2>&1
  stamp tunedcheck $? >> "$OUT/check.txt"
fi
if has probe; then
  timeout "$(limit 90)" python3 benchmarks/kernels/probe_lora.py --model gpt-oss-20b --m 1,16,64 > "$OUT/probe.txt" 2>&1
  stamp probe $? >> "$OUT/probe.txt"
fi
echo "total $(( $(date +%s) - start ))s"
tail -n 12 "$OUT/fp32.txt" 2>/dev/null; grep -E "FAIL|worst|compile|rc=" "$OUT/check.txt" 2>/dev/null
grep -E "x[0-9]|rc=" "$OUT/tune.txt" 2>/dev/null | cut -c1-160
grep -E "fused_moe_lora|lora_expand|lora_shrink\[|^\| fused_moe \||rc=" "$OUT/bench.md" 2>/dev/null
cat "$OUT/bench_tuned.md" "$OUT/probe.txt" 2>/dev/null
