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

import argparse
import itertools
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mxfp4_gemm_gpu import (GPT_OSS_20B, TOLERANCE, Run, committed_run, moe_bytes, moe_inputs,  # noqa: E402
                            rel_error, warm_compiles, write_tuning_file)

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
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from loraplex.kernels.tuning_cases import bench_time_ms

    s = GPT_OSS_20B
    inp = moe_inputs(s, m, "cuda", 5000 + m)
    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
    want = ref.fused_moe_mxfp4(x, *inp["plain"], wts, ids, **kw)
    nbytes = moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "mxfp4")
    rows = []
    for variant, cfg in [("op, committed", committed)] + [(f"tma, {label({**committed, **c})}", {**committed, **c})
                                                          for c in candidates(m)]:
        if run.left_s() < 0:
            run.note(f"M = {m}: stopped at {variant} (time budget)")
            break
        op = lambda cfg=cfg: fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg, **kw)  # noqa: E731
        r = {"m": m, "variant": variant, "config": cfg, "nbytes": nbytes, "active_experts": inp["active"]}
        try:
            r["rel_err"] = rel_error(op(), want)
            r["ok"] = r["rel_err"] <= TOLERANCE
            if r["ok"]:
                r["us"] = bench_time_ms(op) * 1e3
                r["roofline_pct"] = 100 * nbytes / (r["us"] * 1e-6) / (copy_tbs * 1e12)
        except Exception as e:  # noqa: BLE001  (a row, not a crash)
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.synchronize()
        run.add(r)
        rows.append(r)
    timed = [r for r in rows if r.get("us") is not None]
    if not timed:
        return None
    best = min(timed, key=lambda r: r["us"])
    tma = [r for r in timed if r["variant"].startswith("tma")]
    if tma:
        fastest = min(tma, key=lambda r: r["us"])
        run.note(f"M = {m}: fastest TMA {fastest['us']:.1f} us ({fastest['roofline_pct']:.1f}%), committed "
                 f"{rows[0].get('us', float('nan')):.1f} us ({rows[0].get('roofline_pct', float('nan')):.1f}%)")
    return dict(best["config"]) if best["variant"].startswith("tma") else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--m", default="1,2,16")
    p.add_argument("--warm-s", type=float, default=90.0, help="parallel compile warm-up budget (0: none)")
    p.add_argument("--compile-workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    p.add_argument("--budget-s", type=float, default=240.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = [int(v) for v in args.m.split(",")]
    run, copy_tbs, shape, committed = committed_run(args.out, args.budget_s, args, ms, "mxfp4_tma.json")
    if args.warm_s > 0:
        cfgs = []
        for m in ms:
            cfgs += [c for c in [committed[m]] + [{**committed[m], **o} for o in candidates(m)] if c not in cfgs]
        warm_compiles(GPT_OSS_20B, cfgs, args.compile_workers, run, args.warm_s, "tma")
    winners = {m: measure(m, committed[m], run, copy_tbs) for m in ms}
    write_tuning_file(args.out, shape, winners)
    with open(os.path.join(args.out, "mxfp4_tma.md"), "w", encoding="utf-8") as f:
        f.write("| M | row | µs | % roofline | rel err |\n|---:|---|---:|---:|---:|\n")
        for r in run.data["rows"]:
            f.write(f"| {r['m']} | {r['variant']} | {r.get('us', float('nan')):.1f} | "
                    f"{r.get('roofline_pct', float('nan')):.1f} | {r.get('rel_err', float('nan')):.1e} |"
                    f"{' ' + r['error'] if r.get('error') else ''}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
