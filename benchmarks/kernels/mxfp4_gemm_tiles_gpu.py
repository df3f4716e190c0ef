"""Each MXFP4 expert GEMM's own tile at decode and prefill sizes: gate_up and down timed alone over a grid of tiles,
the best of each combined into one config (down's through the ``DOWN_`` keys of ``fused_moe_mxfp4.down_config``),
and the whole op and the expert layer with LoRA timed with the committed config and with the combination.

    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_gemm_tiles_gpu.py          # H200: ~3 minutes
    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_gemm_tiles_gpu.py --m 16 --warm-s 0
    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_gemm_tiles_gpu.py --m 2048,1024 --lora-m 0

The two GEMMs of an expert layer share the row blocks (one alignment: BLOCK_M, GROUP_M, DIRECT), not their
shapes: gate_up reads K = H and writes two accumulators (gate and up rows) per program, down reads K = I into one,
so a tile chosen for both is a compromise for one. Rows: ``gate_up, <tile>`` / ``down, <tile>`` (each GEMM alone,
its output checked against the committed config's, rel. error ≤ 1e-2), ``bf16 fused_moe`` (from M = 256, the bf16
experts the prefill target compares with), ``op, committed`` / ``op, combined`` /
``op, combined, PDL`` (the whole op against the torch reference) and ``lora, committed`` / ``lora, fastest``
(the fastest op row's config; ``moe_experts_lora`` with
--max-loras adapters of --rank on both expert targets, as the engine calls it). Timing, bytes and the roofline as
``mxfp4_gemm_gpu.py`` (CUDA-graph replay after an L2 flush; the touched experts' MXFP4 bytes and the activations;
a 1 GiB copy's rate). Writes ``mxfp4_tiles.json`` (every row, rewritten as rows come) and ``mxfp4_tiles.md`` into
$OUT, and ``fused_moe_mxfp4.json``: the committed tuning file with each measured M's entry set to the fastest op
row's config where that is not the committed one.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mxfp4_gemm_gpu import (GPT_OSS_20B, TOLERANCE, committed_run, gemm_bytes, lora_extra_bytes,  # noqa: E402
                            lora_inputs, moe_bytes, moe_inputs, rel_error, warm_compiles, write_tuning_file)

TILE_KEYS = ("BLOCK_N", "BLOCK_K", "PREFETCH", "num_warps", "num_stages")


def _tile(bn: int, bk: int, prefetch: int, warps: int = 4, stages: int = 3) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "PREFETCH": prefetch, "num_warps": warps,
            "num_stages": 1 if prefetch else stages}


COMPUTE_TILES_MIN_M = 256  # from here (tens of pairs per expert and more) the grids are of compute-bound tiles


def gate_up_tiles(m: int) -> list[dict]:
    """gate_up candidates (the committed config's row blocks kept): tile, gate/up in one product, deeper cp.async
    pipelines, split-K at M <= 8; at prefill sizes tiles of 64 or 128 weight rows, one or two warpgroups and
    shallow to deep pipelines."""
    if m >= COMPUTE_TILES_MIN_M:  # GU_FUSED only with 4 warps (``fused_moe_mxfp4.FUSED_MAX_WARPS``)
        return [{**_tile(bn, bk, 0, warps, stages), "GU_FUSED": fused}
                for bn, bk, warps, stages, fused in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4), (0, 1))
                if not (fused and warps > 4)]
    out = [{**_tile(bn, bk, pf), "GU_FUSED": fused}
           for bn, bk, pf, fused in itertools.product((64, 128), (128, 256), (1, 0), (0, 1))]
    out += [{**_tile(bn, 128, 0, stages=st), "GU_FUSED": fused}
            for bn, st, fused in itertools.product((64, 128), (4, 6), (0, 1))]
    if m <= 8:
        out += [{**_tile(bn, 128, pf), "GU_FUSED": fused, "GU_SPLIT_K": sk}
                for bn, pf, fused, sk in itertools.product((64, 128), (1, 0), (0, 1), (2, 4))]
    return out


def down_tiles(m: int) -> list[dict]:
    """down candidates as ``DOWN_`` keys (SPLIT_K is down's own key already)."""
    if m >= COMPUTE_TILES_MIN_M:
        tiles = [{**_tile(bn, bk, 0, warps, stages), "SPLIT_K": 1}
                 for bn, bk, warps, stages in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))]
        return [{("DOWN_" + k if k in TILE_KEYS else k): v for k, v in t.items()} for t in tiles]
    splits = (1, 2, 4) if m <= 8 else (1, 2) if m <= 32 else (1,)
    tiles = [{**_tile(bn, bk, pf), "SPLIT_K": sk}
             for bn, bk, pf, sk in itertools.product((64, 128, 256), (128, 256), (1, 0), splits)]
    tiles += [{**_tile(bn, 128, 0, stages=st), "SPLIT_K": sk}
              for bn, st, sk in itertools.product((64, 128), (4, 6), splits)]
    tiles += [{**_tile(256, 128, 0, 8), "SPLIT_K": 1}, {**_tile(128, 128, 0, 8), "SPLIT_K": 1}]
    return [{("DOWN_" + k if k in TILE_KEYS else k): v for k, v in t.items()} for t in tiles]


def label(cfg: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--m", default="16,64,1,4,8,32,2")
    p.add_argument("--lora-m", default="16,64")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--warm-s", type=float, default=150.0, help="parallel compile warm-up budget (0: none)")
    p.add_argument("--compile-workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    p.add_argument("--budget-s", type=float, default=420.0)
    args = p.parse_args(argv)
    from loraplex.kernels import fused_moe_mxfp4 as fm
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.moe_experts_lora import moe_experts_lora
    from loraplex.kernels.tuning_cases import bench_time_ms

    s = GPT_OSS_20B
    ms = [int(v) for v in args.m.split(",")]
    lora_ms = {int(v) for v in args.lora_m.split(",")}
    run, copy_tbs, shape, committed = committed_run(args.out, args.budget_s, args, ms, "mxfp4_tiles.json")
    if args.warm_s > 0:
        cfgs = []
        for m in ms:
            for c in [committed[m]] + [{**committed[m], **t} for t in gate_up_tiles(m) + down_tiles(m)]:
                if c not in cfgs:
                    cfgs.append(c)
        warm_compiles(s, cfgs, args.compile_workers, run, args.warm_s, "tiles", lora=[committed[m] for m in ms])
    best_file = {}
    for m in ms:
        if run.left_s() < 0:
            run.note(f"M = {m}: skipped (time budget)")
            continue
        best_file[m] = measure(m, s, committed[m], args, run, copy_tbs, lora_ms, fm, ref, moe_experts_lora,
                               bench_time_ms)
    write_tuning_file(args.out, shape, best_file)
    rows = run.data["rows"]
    with open(os.path.join(args.out, "mxfp4_tiles.md"), "w", encoding="utf-8") as f:
        f.write("| M | row | µs | % roofline | rel err | config |\n|---:|---|---:|---:|---:|---|\n")
        for r in rows:
            f.write(f"| {r['m']} | {r['variant']} | {r.get('us', float('nan')):.1f} | "
                    f"{r.get('roofline_pct', float('nan')):.1f} | {r.get('rel_err', float('nan')):.1e} | "
                    f"{r.get('error') or label(r.get('config') or {})} |\n")
    return 0


def measure(m, s, tuned, args, run, copy_tbs, lora_ms, fm, ref, moe_experts_lora, bench_time_ms):
    """Rows at M tokens; returns the combined config if the whole op ran faster with it, else None."""
    inp = moe_inputs(s, m, "cuda", 3000 + m)
    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    w13, s13, w2, s2 = inp["kernel"]
    kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
    results = {}

    def row(variant, fn, nbytes, check=None, config=None):
        r = {"m": m, "variant": variant, "config": config, "nbytes": nbytes, "active_experts": inp["active"]}
        try:
            if check is not None:
                r["rel_err"] = check()
                r["ok"] = r["rel_err"] <= TOLERANCE
            if check is None or r["ok"]:
                ms_ = bench_time_ms(fn)
                r["us"] = ms_ * 1e3
                r["roofline_pct"] = 100 * nbytes / (ms_ * 1e-3) / (copy_tbs * 1e12) if ms_ > 0 else float("nan")
        except Exception as e:  # noqa: BLE001  (a row, not a crash)
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.synchronize()
        run.add(r)
        results[variant] = r
        return r

    align = fm.route_tables(ids, s.num_experts, tuned)
    gu_ref = fm.gate_up(x, w13, s13, align, tuned, top_k=s.top_k, **kw_gate(kw))
    dn_ref = fm.sum_pairs(fm.down(gu_ref, w2, s2, wts, align, tuned, b2=inp["b2"]), m, s.top_k, x.dtype)
    gu_bytes = gemm_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "gate_up")
    dn_bytes = gemm_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "down")
    best_gu, best_dn = (None, float("inf")), (None, float("inf"))
    for t in [{}] + gate_up_tiles(m):
        cfg = {**tuned, **t}
        r = row(f"gate_up, {label(t) or 'committed'}", lambda cfg=cfg: fm.gate_up(
            x, w13, s13, align, cfg, top_k=s.top_k, **kw_gate(kw)), gu_bytes,
            lambda cfg=cfg: rel_error(fm.gate_up(x, w13, s13, align, cfg, top_k=s.top_k, **kw_gate(kw)), gu_ref), t)
        if r.get("us", float("inf")) < best_gu[1]:
            best_gu = (t, r["us"])
    for t in [{}] + down_tiles(m):
        cfg = {**tuned, **t}
        r = row(f"down, {label(t) or 'committed'}", lambda cfg=cfg: fm.sum_pairs(
            fm.down(gu_ref, w2, s2, wts, align, cfg, b2=inp["b2"]), m, s.top_k, x.dtype), dn_bytes,
            lambda cfg=cfg: rel_error(fm.sum_pairs(fm.down(gu_ref, w2, s2, wts, align, cfg, b2=inp["b2"]), m,
                                                   s.top_k, x.dtype), dn_ref), t)
        if r.get("us", float("inf")) < best_dn[1]:
            best_dn = (t, r["us"])
    if m >= COMPUTE_TILES_MIN_M:  # what "prefill no slower than bf16" compares with: bf16 experts at their tuned config
        from loraplex.kernels.fused_moe import fused_moe
        row("bf16 fused_moe", lambda: fused_moe(x, inp["w13"], inp["w2"], wts, ids, **kw),
            moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "bf16"))
    want = ref.fused_moe_mxfp4(x, *inp["plain"], wts, ids, **kw)
    combined = {**tuned, **(best_gu[0] or {}), **(best_dn[0] or {})}
    mx_bytes = moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "mxfp4")
    ops = {}
    for name, cfg in (("committed", tuned), ("combined", combined), ("combined, PDL", {**combined, "PDL": 1})):
        ops[name] = row(f"op, {name}", lambda cfg=cfg: fm.fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg,
                                                                            **kw), mx_bytes,
                        lambda cfg=cfg: rel_error(fm.fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg, **kw),
                                                  want), cfg)
    fastest = min(ops, key=lambda k: ops[k].get("us", float("inf")) if ops[k].get("ok") else float("inf"))
    best = ops[fastest]["config"]
    if m in lora_ms:
        lo = lora_inputs(s, m, ids, args.max_loras, args.rank, "cuda", x.dtype)
        lkw = dict(w13_lora=lo["w13_lora"], w2_lora=lo["w2_lora"], w13_scale=s13, w2_scale=s2, **kw)
        lbytes = mx_bytes + lora_extra_bytes(m, lo["pairs"], s.hidden, s.inter, s.top_k, args.rank)
        base = moe_experts_lora(x, w13, w2, wts, ids, lo["idx"], lo["scaling"], config=tuned, **lkw)
        for name, cfg in (("committed", tuned), ("fastest", best)):
            row(f"lora, {name}", lambda cfg=cfg: moe_experts_lora(x, w13, w2, wts, ids, lo["idx"], lo["scaling"],
                                                                  config=cfg, **lkw), lbytes,
                lambda cfg=cfg: rel_error(moe_experts_lora(x, w13, w2, wts, ids, lo["idx"], lo["scaling"],
                                                           config=cfg, **lkw), base), cfg)
    return dict(best) if fastest != "committed" else None


def kw_gate(kw: dict) -> dict:
    return {"activation": kw["activation"], "b13": kw["b13"]}


if __name__ == "__main__":
    sys.exit(main())
