"""Both MXFP4 expert GEMMs in one launch (``fused_moe_mxfp4_one_launch``) against the committed two-launch op at
decode sizes of a token or a few, on the GPT-OSS-20B expert shape.

    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_one_launch_gpu.py            # ~3 minutes
    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_one_launch_gpu.py --m 1 --warm-s 0

Rows per M: ``op, committed`` (the tuned two-launch config) and ``one launch, <keys>`` over a grid of tiles
(``candidates``: ``ONE_`` keys added to the committed entry, ``fused_moe_mxfp4_one_launch.one_config``): the whole
op, CUDA-graph replay after an L2 flush (``tuning_cases.bench_time_ms``), each output checked against the torch
reference (rel. error ≤ 1e-2), and for the fastest one-launch row the largest difference between two runs of it (its
float32 atomic sums' order varies). Bytes and the roofline as ``mxfp4_gemm_gpu.py``: the touched experts' MXFP4
codes and scales plus activations, against a 1 GiB copy's rate. Writes ``mxfp4_one_launch.json`` (rows as they
come), ``mxfp4_one_launch.md`` and ``fused_moe_mxfp4.json`` (the device's tuning file with each M's entry set to the
fastest row's config where that is a one-launch row) to $OUT.
"""
from __future__ import annotations

import itertools
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from mxfp4_gemm_gpu import Run, sweep_main, sweep_outcome, time_op_rows  # noqa: E402


def candidates(m: int) -> list[dict]:
    """One-launch configs tried at M tokens: intermediate tile, down rows per step (the larger, the more of w2 in
    flight), gate and up in one product or two, cp.async pipeline depth, one or two warpgroups, and at M <= 2 one
    pair per block without the alignment launch (register prefetch and BLOCK_K 256 were slower in the first
    sweep); then gate_up's weights through TMA (``ONE_TMA``) on one warpgroup, 4 or 6 stages deep."""
    directs = (1, 0) if m <= 2 else (0,)
    grid = [{"ONE_LAUNCH": 1, "ONE_BLOCK_I": bi, "ONE_BLOCK_H": bh, "ONE_BLOCK_M": 8, "ONE_BLOCK_K": 128,
             "ONE_GU_FUSED": fused, "ONE_PREFETCH": 0, "ONE_num_stages": stages, "ONE_num_warps": warps,
             "ONE_DIRECT": direct, "ONE_PDL": 1}
            for bi, bh, fused, stages, warps, direct in itertools.product((64, 128), (256, 512), (1, 0), (2, 3),
                                                                         (4, 8), directs)
            if not (fused and warps > 4)]  # fused gate/up over two warpgroups runs unfused (``FUSED_MAX_WARPS``)
    tma = [{**c, "ONE_TMA": 1, "ONE_num_stages": stages} for c in grid
           if c["ONE_num_warps"] == 4 and c["ONE_num_stages"] == 3 for stages in (4, 6)]
    return grid + tma


def label(cfg: dict) -> str:
    return ", ".join(f"{k[4:]}={v}" for k, v in cfg.items() if k.startswith("ONE_") and k != "ONE_LAUNCH")


def measure(m: int, committed: dict, run: Run, copy_tbs: float) -> dict | None:
    """Rows at M tokens; the fastest one-launch config if it beat the committed op, else None."""
    # each one-launch row keeps the committed two-launch keys, which the expert LoRA path reads from the same entry
    variants = [("op, committed", committed)] + [(f"one launch, {label(c)}", {**committed, **c})
                                                 for c in candidates(m)]
    rows, call = time_op_rows(m, variants, run, copy_tbs, 4000 + m)
    winner, fastest = sweep_outcome(rows, "one launch")
    if fastest is not None:
        first = call(fastest["config"])
        spread = max(float((call(fastest["config"]).float() - first.float()).abs().max()) for _ in range(20))
        run.note(f"M = {m}: fastest one launch {fastest['us']:.1f} us ({fastest['roofline_pct']:.1f}%), committed "
                 f"{rows[0].get('us', float('nan')):.1f} us; largest difference over 20 runs {spread:.3g}")
    return winner

def main(argv: list[str] | None = None) -> int:
    return sweep_main(argv, doc=__doc__, name="mxfp4_one_launch", default_m="1,2,4", warm_s=120.0, budget_s=360.0,
                      candidates=candidates, measure=measure)


if __name__ == "__main__":
    sys.exit(main())
