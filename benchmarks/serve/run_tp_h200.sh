#!/usr/bin/env bash
# Tensor parallelism on the GPT-OSS-20B multi-LoRA serving workload: TP=2 against TP=1 on two H200s (NCCL).
# Device kind: nvidia-h200-x2. Wall time: at most BUDGET + ~40 s (default BUDGET=440: under 8 minutes).
#   phase A, in parallel:  TP=1 eager on GPU 0  |  TP=1 with CUDA graphs on GPU 1 (graphs need TP=1)
#   phase B:               TP=2 eager on GPUs 0+1 (rank 0 here, one worker process; activations over NCCL, step
#                          metadata over gloo), reading the adapters phase A wrote
# Workload (docs/performance.md, "GPT-OSS-20B multi-LoRA serving workload"): GPT-OSS-20B shape, dummy bf16, 8
# adapters r32, 1600 in / 600 out, C=16, even mix, clients STAGGER s apart; the adapter scenario only (the served
# mix), REQUESTS (48) requests, each scenario starting no new request after SCEN (40) s, so the three engines fit.
# Writes under $OUT (4 files): env.txt, log.txt, bench_combined.md (table + TP=2 / TP=1 ratios of per-request
# tok/s, output tok/s and TTFT p50), bench_combined.json.
# Env: BUDGET (s, default 440), STAGGER (0.4), REQUESTS (48), SCEN (40), ARGS (extra flags for every run, last
# wins), PYTHON (python3). CPU dry run (gloo instead of NCCL; CUDA graphs off): PYTHON=.venv/bin/python
# ARGS="--scale tiny --device cpu --input-len 24 --output-len 6 --num-requests 5 --num-adapters 2 --rank 4"
# bash benchmarks/serve/run_tp_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
BUDGET=${BUDGET:-440}
STAGGER=${STAGGER:-0.4}
REQUESTS=${REQUESTS:-48}
SCEN=${SCEN:-40}
ARGS=${ARGS:-}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-12}
SCRATCH=$(mktemp -d /tmp/loraplex-tp.XXXXXX)
mkdir -p "$OUT"
T0=$(date +%s)
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,memory.used --format=csv
  nvidia-smi topo -m
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
  torch.cuda.device_count(), 'GPUs', 'nccl', torch.cuda.nccl.version())"
  echo "BUDGET=$BUDGET STAGGER=$STAGGER REQUESTS=$REQUESTS SCEN=$SCEN ARGS=$ARGS"; date -u; } > "$OUT/env.txt" 2>&1
BA=$(( (BUDGET - 40) / 2 )); BB=$(( BUDGET - 40 - BA ))
COMMON="--no-base-only --num-requests $REQUESTS --concurrency 16 --input-len 1600 --output-len 600 --num-adapters 8
  --rank 32 --stagger $STAGGER --scenario-time $SCEN"

run() {  # name gpus budget flags...
  local name=$1 gpus=$2 budget=$3; shift 3
  echo "== $name: GPUs $gpus, budget $budget s, start $(( $(date +%s) - T0 )) s" > "$SCRATCH/$name.log"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 $((budget + 20)) "$PY" -m loraplex.cli bench serve "$@" \
    --total-time "$budget" --out "$SCRATCH/$name" >> "$SCRATCH/$name.log" 2>&1
  echo "== $name: rc=$? end $(( $(date +%s) - T0 )) s" >> "$SCRATCH/$name.log"
}

# shellcheck disable=SC2086
run tp1_eager 0 "$BA" $COMMON --enforce-eager --work-dir "$SCRATCH/w" $ARGS &
PA=$!
# shellcheck disable=SC2086
run tp1_graphs 1 "$BA" $COMMON --work-dir "$SCRATCH/w_graphs" $ARGS &
PG=$!
wait $PA $PG
# shellcheck disable=SC2086
run tp2_eager 0,1 "$BB" $COMMON --tensor-parallel-size 2 --enforce-eager --work-dir "$SCRATCH/w" $ARGS

for s in tp1_eager tp1_graphs tp2_eager; do cat "$SCRATCH/$s.log" 2>/dev/null; done \
  | grep -v 'FutureWarning\|warnings.warn' | tail -c 400000 > "$OUT/log.txt"
timeout 60 "$PY" -m loraplex.cli bench combine --out "$OUT" "TP1 eager=$SCRATCH/tp1_eager/bench_serve.json" \
  "TP1 graphs=$SCRATCH/tp1_graphs/bench_serve.json" "TP2 eager=$SCRATCH/tp2_eager/bench_serve.json" \
  > "$SCRATCH/combine.txt" 2>&1
echo "combine rc=$?" >> "$OUT/log.txt"
cat "$OUT/env.txt"; grep '^\[bench\]\|^== \|Traceback\|Error' "$OUT/log.txt" | tail -60
cat "$SCRATCH/combine.txt"
echo "total wall $(( $(date +%s) - T0 )) s"
rm -rf "$SCRATCH"
