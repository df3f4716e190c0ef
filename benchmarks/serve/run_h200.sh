#!/usr/bin/env bash
# The GPT-OSS-20B multi-LoRA serving workload on H200s: one `loraplex bench serve` process per stage, each under its
# own `timeout` (a stage that fails or runs out leaves the others' figures), then one combined table.
#
# Device kind: nvidia-h200-x2 (stage i runs on GPU i mod 2, the stages of one GPU one after another; the two GPUs
# in parallel, each engine one host thread of the 32 cores) or nvidia-h200 (every stage in a row on GPU 0).
# Wall time: at most BUDGET + ~40 s (default BUDGET=500: under 9 minutes).
#
# Stages (STAGES, space-separated, default "bf16 int8 hf"), each base-only then 8 adapters on one engine:
#   bf16    bf16 weights, CUDA graphs, overlapped scheduling (the engine's defaults)
#   sync    the same with --no-async-scheduling (the synchronous engine)
#   int8    INT8 experts (--quantization int8)
#   mxfp4   MXFP4 experts (--quantization mxfp4)
#   hf      HF transformers, then + PEFT with one adapter: static batch 16, 32 output tokens, extrapolated to 600
#   spec-bf16-L, spec-mxfp4-L   speculative decoding with replayed proposals at acceptance length L (e.g.
#           spec-mxfp4-3.0): 8 adapters only, verify steps through CUDA graphs, k = 2 drafts for L <= 2, else 3;
#           each scenario first runs its requests with speculation off and records them (bench/speculative.py)
#   <stage>-nomixed   that stage with --no-mixed-cuda-graphs: steps with a prompt run eagerly instead of replaying
#           the mixed-step graphs (e.g. STAGES="spec-mxfp4-3.0 spec-mxfp4-3.0-nomixed": A and B in one lease)
# Workload (docs/performance.md, "GPT-OSS-20B multi-LoRA serving workload"): GPT-OSS-20B shape, dummy bf16
# weights, 8 random adapters of rank 32 on attention and experts (even mix), 1600 input / 600 output tokens (EOS
# ignored), closed loop at concurrency 16, REQUESTS requests per scenario, clients STAGGER s apart. A stage's
# budget is shared out by weight (engine stages 3, hf 1); each scenario starts no new request after SCEN s
# (default: (stage budget - 100) / 2, between 20 and 75). Stages on one GPU share a work dir (adapters written once).
#
# Writes under $OUT (at most 8 files): env.txt, log.txt (every stage's output), bench_combined.md (one table and
# the workload's targets, checked against the first stage whose rows match: list bf16 before sync),
# bench_combined.json (the same with every stage's full report), and for each stage in
# PROFILE (default "bf16") profile_<stage>_base.txt / profile_<stage>_adapters.txt: torch-profiler tables of 5
# decode steps at batch 16 and of one arrival.
#
# Env: STAGES, PROFILE, BUDGET (s), STAGGER (0.4), REQUESTS (64), SCEN, ARGS (extra flags for every stage, last
# wins, e.g. "--output-len 300"), NGPU (default: the GPUs nvidia-smi lists, at least 1), PYTHON (python3).
# CPU dry run of the whole flow (toy model, seconds per stage):
#   PYTHON=.venv/bin/python ARGS="--scale tiny --device cpu --input-len 24 --output-len 6 --num-requests 5
#   --num-adapters 2 --rank 4" BUDGET=200 OUT=/tmp/serve-dry bash benchmarks/serve/run_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
STAGES=${STAGES:-bf16 int8 hf}
PROFILE=${PROFILE:-bf16}
BUDGET=${BUDGET:-500}
STAGGER=${STAGGER:-0.4}
REQUESTS=${REQUESTS:-64}
SCEN=${SCEN:-}
ARGS=${ARGS:-}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-12}
SCRATCH=$(mktemp -d /tmp/loraplex-serve.XXXXXX)
mkdir -p "$OUT"
T0=$(date +%s)
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
WORKLOAD="--concurrency 16 --input-len 1600 --output-len 600 --num-adapters 8 --rank 32"

stage_flags() {  # the flags that make a stage what it is
  if [[ $1 == *-nomixed ]]; then  # any stage, its prompt steps eager (no mixed-step graphs): A/B in one lease
    local base
    base=$(stage_flags "${1%-nomixed}") || return 1
    echo "$base --no-mixed-cuda-graphs"
    return
  fi
  case $1 in
    bf16) echo "" ;;
    sync) echo "--no-async-scheduling" ;;
    int8) echo "--quantization int8" ;;
    mxfp4) echo "--quantization mxfp4" ;;
    hf) echo "--hf-only --hf-output-len 32" ;;
    spec-bf16-*|spec-mxfp4-*) spec_flags "$1" ;;
    *) echo "unknown stage '$1' (bf16, sync, int8, mxfp4, hf, spec-bf16-L, spec-mxfp4-L; any with -nomixed)" >&2
       return 1 ;;
  esac
}
spec_flags() {  # spec-<experts>-<L>
  local rest=${1#spec-} k=3 q
  q=${rest%%-*}
  local length=${rest#*-}
  [[ "$length" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "stage '$1': L must be a number (spec-mxfp4-3.0)" >&2; return 1; }
  awk -v l="$length" 'BEGIN { exit !(l + 0 <= 2) }' && k=2
  [ "$q" = mxfp4 ] && echo -n "--quantization mxfp4 "
  echo "--no-base-only --speculative-method replay --num-speculative-tokens $k --speculative-acceptance-length $length" \
    "--speculative-verify-cuda-graphs"
}
weight() { [ "$1" = hf ] && echo 1 || echo 3; }
for s in $STAGES; do stage_flags "$s" > /dev/null || exit 2; done

{ nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,clocks.sm,temperature.gpu,power.draw,memory.used \
    --format=csv
  "$PY" -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'GPUs')"
  "$PY" -c "import peft; print('peft', peft.__version__)"
  git log -1 --format='commit %H' 2>/dev/null; git status --short 2>/dev/null | head -20
  echo "STAGES=$STAGES PROFILE=$PROFILE NGPU=$NGPU BUDGET=$BUDGET STAGGER=$STAGGER REQUESTS=$REQUESTS SCEN=$SCEN"
  echo "ARGS=$ARGS"; date -u
} > "$OUT/env.txt" 2>&1

run_stage() {  # name gpu budget: one bench process, hard-killed 30 s after its own --total-time
  local name=$1 gpu=$2 budget=$3 scen profile=""
  if [ -n "$SCEN" ]; then scen=$SCEN
  else scen=$(( (budget - 100) / 2 )); (( scen < 20 )) && scen=20; (( scen > 75 )) && scen=75; fi
  [[ " $PROFILE " == *" $name "* ]] && profile="--profile-steps 5"
  echo "== $name: GPU $gpu, budget $budget s, scenario time $scen s, start $(( $(date +%s) - T0 )) s" \
    > "$SCRATCH/$name.log"
  # shellcheck disable=SC2086,SC2046
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 $((budget + 30)) "$PY" -m loraplex.cli bench serve $WORKLOAD \
    --num-requests "$REQUESTS" --stagger "$STAGGER" --scenario-time "$scen" $profile $(stage_flags "$name") \
    --work-dir "$SCRATCH/w$gpu" $ARGS --total-time "$budget" --out "$SCRATCH/$name" >> "$SCRATCH/$name.log" 2>&1
  echo "== $name: rc=$? end $(( $(date +%s) - T0 )) s" >> "$SCRATCH/$name.log"
}

run_lane() {  # gpu: its stages in a row, BUDGET - 30 s shared out by weight
  local gpu=$1 i=0 total=0 s
  local -a mine=()
  for s in $STAGES; do
    (( i % NGPU == gpu )) && { mine+=("$s"); total=$(( total + $(weight "$s") )); }
    i=$(( i + 1 ))
  done
  for s in "${mine[@]}"; do run_stage "$s" "$gpu" $(( (BUDGET - 30) * $(weight "$s") / total )); done
}

pids=()
for (( g = 0; g < NGPU; g++ )); do run_lane "$g" & pids+=($!); done
wait "${pids[@]}"

for s in $STAGES; do
  cat "$SCRATCH/$s.log" 2>/dev/null
  for kind in base adapters; do
    [ -f "$SCRATCH/$s/profile_$kind.txt" ] && cp "$SCRATCH/$s/profile_$kind.txt" "$OUT/profile_${s}_$kind.txt"
  done
done | grep -v 'FutureWarning\|warnings.warn' | tail -c 400000 > "$OUT/log.txt"
specs=()
for s in $STAGES; do specs+=("$s=$SCRATCH/$s/bench_serve.json"); done
timeout 60 "$PY" -m loraplex.cli bench combine --out "$OUT" "${specs[@]}" > "$SCRATCH/combine.txt" 2>&1
echo "combine rc=$?" >> "$OUT/log.txt"
cat "$OUT/env.txt"; grep '^\[bench\]\|^== \|Traceback\|Error' "$OUT/log.txt" | tail -60
cat "$SCRATCH/combine.txt"
echo "total wall $(( $(date +%s) - T0 )) s"
rm -rf "$SCRATCH"
