"""MXFP4 expert GEMMs with the weights read through TMA (``fused_moe_mxfp4``'s "TMA" / "DOWN_TMA" keys) against
the committed op at decode sizes, on the GPT-OSS-20B expert shape.

    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_tma_gpu.py                 # ~3 minutes
    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_tma_gpu.py --m 1 --warm-s 60 --budget-s 90

Rows per M: ``op, committed`` (the tuned config as the engine runs it) and ``tma, <keys>`` over a grid of tiles
(``candidates``: two launches, both GEMMs through TMA, the committed entry's row blocks, routing and PDL kept): the
whole op, CUDA-graph replay after an L2 flush (``tuning_cases.bench_time_ms``), each output checked against the
torch reference (rel. error ≤ 1e-2). Bytes and the roofline as ``mxfp4_gemm_gpu.py``: the touched experts' MXFP4
codes and scales plus activations, against a 1 GiB copy's rate. Writes ``mxfp4_tma.json`` (rows as they come),
``mxfp4_tma.md`` and ``fused_moe_mxfp4.json`` (the device's tuning file with each M's entry set to the fastest
row's config where that is a TMA row) to $OUT.
"""
from __future__ import annotations

import itertools
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from mxfp4_gemm_gpu import Run, sweep_main, sweep_outcome, time_op_rows  # noqa: E402

TMA_KEYS = ("BLOCK_N", "BLOCK_K", "GU_FUSED", "num_stages", "SPLIT_K", "GU_SPLIT_K", "DOWN_BLOCK_N")


def candidates(m: int) -> list[dict]:
    """TMA configs tried at M tokens: the tuner's (``tuning_cases.MXFP4_TMA_SPACE``, those ``mxfp4_moe_space(m)``
    holds), then a grid of weight rows per program, K per step (atoms unrolled), gate and up in one product or two,
    pipeline depth (TMA needs no registers for the copies in flight, so deeper than the pointer kernels' 3),
    split-K of both GEMMs; one warpgroup, two launches (``ONE_LAUNCH`` 0)."""
    from loraplex.kernels.tuning_cases import MXFP4_TMA_SPACE, mxfp4_moe_space

    tuner = [{**c, "ONE_LAUNCH": 0} for c in MXFP4_TMA_SPACE if c in mxfp4_moe_space(m)]
    return tuner + [{"TMA": 1, "DOWN_TMA": 1, "PREFETCH": 0, "DOWN_PREFETCH": 0, "ONE_LAUNCH": 0, "BLOCK_N": bn,
             "BLOCK_K": bk, "DOWN_BLOCK_K": bk, "GU_FUSED": fused, "num_stages": stages, "DOWN_num_stages": stages,
             "num_warps": 4, "DOWN_num_warps": 4, "SPLIT_K": split, "GU_SPLIT_K": split, "DOWN_BLOCK_N": dbn}
            for bn, bk, fused, stages, split, dbn in itertools.product((64, 128), (128, 256), (1, 0), (4, 6),
                                                                      (2, 4), (64,))]


def label(cfg: dict) -> str:
    return ", ".join(f"{k}={cfg[k]}" for k in TMA_KEYS if k in cfg)


def measure(m: int, committed: dict, run: Run, copy_tbs: float) -> dict | None:
    """Rows at M tokens; the fastest TMA config if it beat the committed op, else None."""
    variants = [("op, committed", committed)] + [(f"tma, {label({**committed, **c})}", {**committed, **c})
                                                 for c in candidates(m)]
    rows, _ = time_op_rows(m, variants, run, copy_tbs, 5000 + m)
    winner, fastest = sweep_outcome(rows, "tma")
    if fastest is not None:
        run.note(f"M = {m}: fastest TMA {fastest['us']:.1f} us ({fastest['roofline_pct']:.1f}%), committed "
                 f"{rows[0].get('us', float('nan')):.1f} us ({rows[0].get('roofline_pct', float('nan')):.1f}%)")
    return winner

def main(argv: list[str] | None = None) -> int:
    return sweep_main(argv, doc=__doc__, name="mxfp4_tma", default_m="1,2,16", warm_s=90.0, budget_s=240.0,
                      candidates=candidates, measure=measure)


if __name__ == "__main__":
    sys.exit(main())
