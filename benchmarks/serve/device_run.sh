#!/usr/bin/env bash
# Issue 6's serving benchmark in one device call (kind nvidia-h200-x2, <= 9 minutes wall). Three stages, each a
# `loraplex bench serve` process under its own `timeout` (a stage that fails or runs out leaves the others' figures):
#   stage 1, GPU 0: bf16 base-only + 8 adapters, CUDA graphs (engine default), torch-profiler tables of 5 decode steps
#   stage 2, GPU 1: INT8 experts (EngineConfig.quantization), base-only + 8 adapters   } in parallel with stage 1
#   stage 3, GPU 1: HF transformers, then + PEFT (1 adapter), static batch 16, short output, after stage 2
# Workload (issue 6): GPT-OSS-20B shape, dummy bf16 weights, 8 adapters r32 (attention + experts), 1600 input /
# 600 output tokens (EOS ignored), closed loop at C=16, 64 requests per scenario spread evenly over the adapters;
# clients start STAGGER s apart (about e2e / C: the steady state of a closed loop, see docs/performance.md).
# Stages 1 and 2 run on separate GPUs of the same host at once (each engine is one host thread; 32 cores). On a
# machine with one GPU (or PARALLEL=0) they run one after another on GPU 0 with smaller budgets.
# Writes under $OUT (6 files): env.txt, log.txt (every stage's output), bench_combined.md (one table + issue-6
# checks), bench_combined.json (the full per-stage reports inside), profile_base.txt, profile_adapters.txt.
# Env: BUDGET (s, default 500: the whole script stays under it plus ~20 s), STAGGER (0.4), REQUESTS (64),
#      ARGS (extra flags for every stage, last wins, e.g. "--output-len 300"), PARALLEL (auto: 1 with 2+ GPUs),
#      PYTHON (python3). CPU dry run: PYTHON=.venv/bin/python ARGS="--scale tiny --device cpu --input-len 24
#      --output-len 6 --num-requests 5 --num-adapters 2 --rank 4 --scenario-time 30" bash benchmarks/serve/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
BUDGET=${BUDGET:-500}
STAGGER=${STAGGER:-0.4}
REQUESTS=${REQUESTS:-64}
ARGS=${ARGS:-}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-12}
SCRATCH=$(mktemp -d /tmp/loraplex-serve.XXXXXX)
mkdir -p "$OUT"
T0=$(date +%s)
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
PARALLEL=${PARALLEL:-$([ "${NGPU:-0}" -ge 2 ] && echo 1 || echo 0)}
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,clocks.sm,temperature.gpu,power.draw,memory.used \
    --format=csv
  "$PY" -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'GPUs')"
  "$PY" -c "import peft; print('peft', peft.__version__)"
  echo "PARALLEL=$PARALLEL BUDGET=$BUDGET STAGGER=$STAGGER REQUESTS=$REQUESTS ARGS=$ARGS"; date -u
} > "$OUT/env.txt" 2>&1

# budgets (s): stage 1 | stage 2 + stage 3 in parallel; all three in a row otherwise
if [ "$PARALLEL" = 1 ]; then
  B1=$((BUDGET - 30)); B3=$((BUDGET / 4)); B2=$((BUDGET - 30 - B3)); G2=1
else
  B1=$((BUDGET * 2 / 5)); B2=$((BUDGET * 2 / 5 - 20)); B3=$((BUDGET / 5 - 20)); G2=0
fi
# the whole issue-6 workload; each scenario starts no new request after SCEN s (its running ones finish)
SCEN=${SCEN:-$([ "$PARALLEL" = 1 ] && echo 75 || echo 40)}
COMMON="--num-requests $REQUESTS --concurrency 16 --input-len 1600 --output-len 600 --num-adapters 8 --rank 32
  --stagger $STAGGER --scenario-time $SCEN"

stage() {  # name gpu budget flags...: one bench process, hard-killed 30 s after its own --total-time
  local name=$1 gpu=$2 budget=$3; shift 3
  echo "== $name: GPU $gpu, budget $budget s, start $(( $(date +%s) - T0 )) s" > "$SCRATCH/$name.log"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 $((budget + 30)) "$PY" -m loraplex.cli bench serve "$@" \
    --total-time "$budget" --out "$SCRATCH/$name" >> "$SCRATCH/$name.log" 2>&1
  echo "== $name: rc=$? end $(( $(date +%s) - T0 )) s" >> "$SCRATCH/$name.log"
}

# shellcheck disable=SC2086
stage s1_bf16 0 "$B1" $COMMON --profile-steps 5 --work-dir "$SCRATCH/w1" $ARGS &
P1=$!
[ "$PARALLEL" = 1 ] || wait $P1
# shellcheck disable=SC2086
{ stage s2_int8 "$G2" "$B2" $COMMON --quantization int8 --work-dir "$SCRATCH/w2" $ARGS
  # HF needs one adapter: the one stage 2 wrote (or stage 1's when they ran in a row)
  stage s3_hf "$G2" "$B3" --hf-only --num-adapters 8 --rank 32 --concurrency 16 --input-len 1600 \
    --output-len 600 --hf-output-len 32 --work-dir "$SCRATCH/w$([ "$PARALLEL" = 1 ] && echo 2 || echo 1)" $ARGS; } &
P2=$!
wait $P1 $P2

for s in s1_bf16 s2_int8 s3_hf; do cat "$SCRATCH/$s.log" 2>/dev/null; done | grep -v 'FutureWarning\|warnings.warn' \
  | tail -c 400000 > "$OUT/log.txt"
cp "$SCRATCH"/s1_bf16/profile_*.txt "$OUT/" 2>/dev/null
timeout 60 "$PY" -m loraplex.cli bench combine --out "$OUT" "bf16 graphs=$SCRATCH/s1_bf16/bench_serve.json" \
  "int8 graphs=$SCRATCH/s2_int8/bench_serve.json" "HF=$SCRATCH/s3_hf/bench_serve.json" > "$SCRATCH/combine.txt" 2>&1
echo "combine rc=$?" >> "$OUT/log.txt"
cat "$OUT/env.txt"; grep '^\[bench\]\|^== \|Traceback\|Error' "$OUT/log.txt" | tail -60
cat "$SCRATCH/combine.txt"
echo "total wall $(( $(date +%s) - T0 )) s"
rm -rf "$SCRATCH"
