#!/usr/bin/env bash
# One device call for issue 6's serving baseline (H200). Writes under $OUT (6 files, all within the 8 that come
# back): env.txt, log.txt, bench_serve.json, bench_serve.md, profile_base.txt, profile_adapters.txt.
#   BUDGET   seconds the bench may use in all (default 420; the report is rewritten after every scenario, and
#            scenarios that no longer fit are listed under "skipped")
#   ARGS     extra flags for `loraplex bench serve` (default: the reduced baseline below)
# Cost model (to be replaced by the first measured run): setup (8 adapters of 708 MB written and loaded, 21B dummy
# weights) ~60 s; per scenario a warm-up (2 full prompts + short ones) and the measured closed loop.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loraplex_out}
BUDGET=${BUDGET:-420}
ARGS=${ARGS:---num-requests 16 --concurrency 16 --output-len 256 --int8 --profile-steps 5 --hf-baseline \
  --hf-output-len 32}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  python3 -c "import peft; print('peft', peft.__version__)"
  date -u; } > "$OUT/env.txt" 2>&1
# shellcheck disable=SC2086
timeout $((BUDGET + 30)) python3 -m loraplex.cli bench serve $ARGS --total-time "$BUDGET" --out "$OUT" \
  > "$OUT/log.txt" 2>&1
echo "rc=$?" >> "$OUT/log.txt"
cat "$OUT/env.txt"; grep '^\[bench\]\|^rc=' "$OUT/log.txt"; cat "$OUT/bench_serve.md" 2>/dev/null
