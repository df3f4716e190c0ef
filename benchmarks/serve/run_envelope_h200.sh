#!/usr/bin/env bash
# The consolidation envelope of the GPT-OSS-20B multi-LoRA serving workload on one H200: one `loraplex bench serve`
# process per stage, each under its own `timeout` and `--total-time` (a stage that fails or runs out leaves the
# others' figures; each report is rewritten after every run, so a stage cut short keeps the runs it finished).
#
# Device kind: nvidia-h200 (one GPU; the stages run one after another on GPU 0).
# Wall time: at most BUDGET + ~60 s (default BUDGET=510: under 9.5 minutes). Stage budgets are BUDGET shared by
# weight (sweep 8, seed 2, churn 4, fairness 3) over the stages in STAGES.
# Each stage starts its own engine: on a machine whose Triton cache is cold that takes about 125 s (graph capture
# ~55 s, the eager warm-up ~65 s), later stages on the same machine about 15-50 s; a stage run alone needs a
# budget of that plus its runs (seed alone on a cold machine: BUDGET=260 or more).
#
# Stages (STAGES, space-separated, default "sweep seed churn fairness"); GPT-OSS-20B shape, dummy bf16 weights,
# adapters of rank 32 on attention and experts, 1600 input / 600 output tokens (EOS ignored), engine defaults:
#   sweep     concurrency sweep C = SWEEP_LEVELS (1,16,64,128,256) on one engine, base-only then SWEEP_ADAPTERS (32)
#             adapters, Zipf mix; per level a warm-up, then a closed loop of max(64, 2 C) requests whose first
#             requests ramp over the previous level's e2e, no new request after SWEEP_T s (8); the engine's own
#             max_num_seqs and KV pool (--kv-sizing engine); SWEEP_REPEATS (1) samples of each level in a row
#             (the TPOT ratio then from the samples' mean TPOTs, each sample's ratio beside it); a level's first
#             requests ramp over the previous level's e2e (about 9 s before C = 128, 12 s before C = 256), so with
#             SWEEP_T under 15 the levels from C = 128 up are mostly ramp and their TPOT ratios read high (1.25 at
#             C = 128 with 8 s against 1.14 with 15 s, one commit); the reported sweep is STAGES=sweep SWEEP_T=15
#             BUDGET=440 (about 260 s on a machine that has run the engine once, 125 s more on a cold one)
#   seed      the seed point: C=16, 8 adapters, even mix, clients 0.4 s apart, SEED_T s (20)
#   churn     CHURN_ADAPTERS (64) adapters, Zipf, C=16, an adapter budget for CHURN_BUDGET (16) of them
#             (CHURN_BUDGET_FLAG, default --adapter-budget: GPU memory for that many; --max-loras: that many slots),
#             beside the same run with all of them resident; CHURN_T s (20) each
#   fairness  a light tenant at FAIR_RATE (1) req/s (Poisson) alone, then beside a heavy one at 10x its rate, the
#             heavy requests with n = each of FAIR_N (1,64), under each of FAIR_POLICIES (fcfs,vtc), FAIR_T s (10)
#             each; FAIR_ARGS (default "--light-output-len 8") shapes the light requests
# Adapters: FILES (16) distinct files of 708 MB written once into a shared work dir; adapter k reads file k mod
# FILES (each loaded and held as its own adapter), so 64 adapters need 11 GB of disk, not 45.
# Needs: an engine with a memory-bounded adapter pool (adapter_memory_bytes) for churn's default budget flag, and
# tenant-fair scheduling (add_request tenant/weight, scheduling_policy) for fairness; without them those stages
# fail with a TypeError naming the missing keyword and the others run.
#
# Writes under $OUT (7 files): env.txt, log.txt (every stage's output), summary.md (every stage's Markdown
# report), and one JSON report per stage named <scenario>-gpt-oss-20b-bf16-<date>.json (sweep-, seed-, churn-,
# fairness-) for benchmarks/results/. The PNG: `loraplex bench plot $OUT/sweep-*.json --out docs/...png` on a
# machine with matplotlib.
#
# Env: STAGES, BUDGET (s), the per-stage knobs above, ARGS (extra flags for every stage, last wins), PYTHON (python3).
# CPU dry run of the whole flow (toy model, seconds per stage):
#   PYTHON=.venv/bin/python ARGS="--scale tiny --device cpu --input-len 24 --output-len 6 --num-requests 5 --rank 4"
#   SWEEP_LEVELS=1,2 SWEEP_ADAPTERS=2 CHURN_ADAPTERS=4 CHURN_BUDGET=2 FILES=2 FAIR_N=1,2 SWEEP_T=3 SEED_T=3
#   CHURN_T=3 FAIR_T=2 BUDGET=400 OUT=/tmp/envelope-dry bash benchmarks/serve/run_envelope_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
STAGES=${STAGES:-sweep seed churn fairness}
BUDGET=${BUDGET:-510}
SWEEP_LEVELS=${SWEEP_LEVELS:-1,16,64,128,256}
SWEEP_ADAPTERS=${SWEEP_ADAPTERS:-32}
SWEEP_T=${SWEEP_T:-8}
SWEEP_REPEATS=${SWEEP_REPEATS:-1}
SEED_T=${SEED_T:-20}
CHURN_ADAPTERS=${CHURN_ADAPTERS:-64}
CHURN_BUDGET=${CHURN_BUDGET:-16}
CHURN_BUDGET_FLAG=${CHURN_BUDGET_FLAG:---adapter-budget}
CHURN_T=${CHURN_T:-20}
FAIR_POLICIES=${FAIR_POLICIES:-fcfs,vtc}
FAIR_N=${FAIR_N:-1,64}
FAIR_RATE=${FAIR_RATE:-1}
FAIR_T=${FAIR_T:-10}
FAIR_ARGS=${FAIR_ARGS:---light-output-len 8}
FILES=${FILES:-16}
ARGS=${ARGS:-}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-12} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
SCRATCH=$(mktemp -d /tmp/loraplex-envelope.XXXXXX)
mkdir -p "$OUT" "$SCRATCH/results"
T0=$(date +%s)
COMMON="--input-len 1600 --output-len 600 --rank 32 --work-dir $SCRATCH/work --results-dir $SCRATCH/results"

files() { echo $(( FILES < $1 ? FILES : $1 )); }  # distinct files for N adapters
stage_flags() {  # the flags that make a stage what it is
  case $1 in
    sweep) echo "--concurrency $SWEEP_LEVELS --num-adapters $SWEEP_ADAPTERS --adapter-files $(files "$SWEEP_ADAPTERS")" \
             "--mix zipf" \
             "--scenario-time $SWEEP_T --kv-sizing engine --repeats $SWEEP_REPEATS" \
             "--requests-per-client 2 --ramp auto --label sweep" ;;  # one level alone is still a sweep level
    seed) echo "--concurrency 16 --num-adapters 8 --mix even --stagger 0.4 --num-requests 64 --scenario-time $SEED_T" \
            "--label seed" ;;
    churn) echo "--scenario churn --num-adapters $CHURN_ADAPTERS --adapter-files $(files "$CHURN_ADAPTERS")" \
             "$CHURN_BUDGET_FLAG $CHURN_BUDGET --mix zipf --concurrency 16 --num-requests 64 --scenario-time $CHURN_T" ;;
    fairness) echo "--scenario fairness --num-adapters 2 --concurrency 16 --light-rate $FAIR_RATE --heavy-n $FAIR_N" \
                "--scenario-time $FAIR_T --kv-sizing engine" \
                "${FAIR_POLICIES:+--scheduling-policy $FAIR_POLICIES} $FAIR_ARGS" ;;
    *) echo "unknown stage '$1' (sweep, seed, churn, fairness)" >&2; return 1 ;;
  esac
}
weight() { case $1 in sweep) echo 8 ;; seed) echo 2 ;; churn) echo 4 ;; *) echo 3 ;; esac; }
total=0
for s in $STAGES; do stage_flags "$s" > /dev/null || exit 2; total=$(( total + $(weight "$s") )); done

{ nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,clocks.sm,temperature.gpu,power.draw,memory.used \
    --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'GPUs')"
  git log -1 --format='commit %H' 2>/dev/null; git status --short 2>/dev/null | head -20
  echo "STAGES=$STAGES BUDGET=$BUDGET SWEEP_LEVELS=$SWEEP_LEVELS SWEEP_ADAPTERS=$SWEEP_ADAPTERS SWEEP_T=$SWEEP_T SWEEP_REPEATS=$SWEEP_REPEATS"
  echo "SEED_T=$SEED_T CHURN_ADAPTERS=$CHURN_ADAPTERS CHURN_BUDGET=$CHURN_BUDGET CHURN_BUDGET_FLAG=$CHURN_BUDGET_FLAG"
  echo "CHURN_T=$CHURN_T FAIR_POLICIES=$FAIR_POLICIES FAIR_N=$FAIR_N FAIR_RATE=$FAIR_RATE FAIR_T=$FAIR_T FILES=$FILES"
  echo "FAIR_ARGS=$FAIR_ARGS"; echo "ARGS=$ARGS"; date -u
} > "$OUT/env.txt" 2>&1

for s in $STAGES; do
  budget=$(( (BUDGET - 20) * $(weight "$s") / total ))
  left=$(( BUDGET - ($(date +%s) - T0) ))
  (( budget > left )) && budget=$left
  if (( budget < 10 )); then echo "== $s: skipped, $left s of the budget left" >> "$SCRATCH/log.txt"; continue; fi
  echo "== $s: budget $budget s, start $(( $(date +%s) - T0 )) s" >> "$SCRATCH/log.txt"
  # shellcheck disable=SC2086,SC2046
  timeout -k 10 $((budget + 30)) "$PY" -m loraplex.cli bench serve $COMMON $(stage_flags "$s") $ARGS \
    --total-time "$budget" --out "$SCRATCH/$s" >> "$SCRATCH/log.txt" 2>&1
  echo "== $s: rc=$? end $(( $(date +%s) - T0 )) s" >> "$SCRATCH/log.txt"
done

grep -v 'FutureWarning\|warnings.warn' "$SCRATCH/log.txt" | tail -c 400000 > "$OUT/log.txt"
cp "$SCRATCH"/results/*.json "$OUT"/ 2>/dev/null
for s in $STAGES; do
  [ -f "$SCRATCH/$s/bench_serve.md" ] && { echo "# stage $s"; cat "$SCRATCH/$s/bench_serve.md"; echo; }
done > "$OUT/summary.md"
cat "$OUT/env.txt"; grep '^\[bench\]\|^== \|Traceback\|Error' "$OUT/log.txt" | tail -80
grep -h '^Ratios' "$OUT/summary.md"
ls "$OUT"
echo "total wall $(( $(date +%s) - T0 )) s"
rm -rf "$SCRATCH"
