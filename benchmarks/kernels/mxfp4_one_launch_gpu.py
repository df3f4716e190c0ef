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

import argparse
import itertools
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mxfp4_gemm_gpu import (GPT_OSS_20B, TOLERANCE, Run, committed_run, moe_bytes, moe_inputs,  # noqa: E402
                            rel_error, warm_compiles, write_tuning_file)


def candidates(m: int) -> list[dict]:
    """One-launch configs tried at M tokens: intermediate tile, down rows per step (the larger, the more of w2 in
    flight), gate and up in one product or two, cp.async pipeline depth, one or two warpgroups, and at M <= 2 one
    pair per block without the alignment launch (register prefetch and BLOCK_K 256 were slower in the first
    sweep)."""
    directs = (1, 0) if m <= 2 else (0,)
    return [{"ONE_LAUNCH": 1, "ONE_BLOCK_I": bi, "ONE_BLOCK_H": bh, "ONE_BLOCK_M": 8, "ONE_BLOCK_K": 128,
             "ONE_GU_FUSED": fused, "ONE_PREFETCH": 0, "ONE_num_stages": stages, "ONE_num_warps": warps,
             "ONE_DIRECT": direct, "ONE_PDL": 1}
            for bi, bh, fused, stages, warps, direct in itertools.product((64, 128), (256, 512), (1, 0), (2, 3),
                                                                         (4, 8), directs)
            if not (fused and warps > 4)]  # fused gate/up over two warpgroups runs unfused (``FUSED_MAX_WARPS``)


def label(cfg: dict) -> str:
    return ", ".join(f"{k[4:]}={v}" for k, v in cfg.items() if k.startswith("ONE_") and k != "ONE_LAUNCH")


def measure(m: int, committed: dict, run: Run, copy_tbs: float) -> dict | None:
    """Rows at M tokens; the fastest one-launch config if it beat the committed op, else None."""
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from loraplex.kernels.tuning_cases import bench_time_ms

    s = GPT_OSS_20B
    inp = moe_inputs(s, m, "cuda", 4000 + m)
    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
    want = ref.fused_moe_mxfp4(x, *inp["plain"], wts, ids, **kw)
    nbytes = moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "mxfp4")
    rows = []
    # each one-launch row keeps the committed two-launch keys, which the expert LoRA path reads from the same entry
    for variant, cfg in [("op, committed", committed)] + [(f"one launch, {label(c)}", {**committed, **c})
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
    ones = [r for r in timed if r["variant"].startswith("one launch")]
    if ones:
        fastest = min(ones, key=lambda r: r["us"])
        cfg = fastest["config"]
        first = fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg, **kw)
        spread = max(float((fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg, **kw).float()
                            - first.float()).abs().max()) for _ in range(20))
        run.note(f"M = {m}: fastest one launch {fastest['us']:.1f} us ({fastest['roofline_pct']:.1f}%), committed "
                 f"{rows[0].get('us', float('nan')):.1f} us; largest difference over 20 runs {spread:.3g}")
    return dict(best["config"]) if best["variant"].startswith("one launch") else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--m", default="1,2,4")
    p.add_argument("--warm-s", type=float, default=120.0, help="parallel compile warm-up budget (0: none)")
    p.add_argument("--compile-workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    p.add_argument("--budget-s", type=float, default=360.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = [int(v) for v in args.m.split(",")]
    run, copy_tbs, shape, committed = committed_run(args.out, args.budget_s, args, ms, "mxfp4_one_launch.json")
    if args.warm_s > 0:
        cfgs = []
        for m in ms:
            cfgs += [c for c in [committed[m]] + [{**committed[m], **o} for o in candidates(m)] if c not in cfgs]
        warm_compiles(GPT_OSS_20B, cfgs, args.compile_workers, run, args.warm_s, "one launch")
    winners = {m: measure(m, committed[m], run, copy_tbs) for m in ms}
    write_tuning_file(args.out, shape, winners)
    with open(os.path.join(args.out, "mxfp4_one_launch.md"), "w", encoding="utf-8") as f:
        f.write("| M | row | µs | % roofline | rel err |\n|---:|---|---:|---:|---:|\n")
        for r in run.data["rows"]:
            f.write(f"| {r['m']} | {r['variant']} | {r.get('us', float('nan')):.1f} | "
                    f"{r.get('roofline_pct', float('nan')):.1f} | {r.get('rel_err', float('nan')):.1e} |"
                    f"{' ' + r['error'] if r.get('error') else ''}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
