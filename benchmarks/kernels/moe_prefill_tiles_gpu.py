"""The bf16 expert GEMMs (``fused_moe``) at an arrival step's size, each GEMM alone over a grid of tiles, with
pointer loads and (rows with ``"TMA": 1``, where the tile's box row is at most 128 bytes) with the weights read
through TMA (``fused_moe_tma``), next to cuBLAS ``bmm`` of the same per-expert sizes (every expert padded to the
most-routed one's rows) and the whole op with the committed config. GPT-OSS-20B expert shape (E = 32, top-4,
H = I = 2880), random routing, CUDA-graph replay after an L2 flush (``tuning_cases.bench_time_ms``); TFLOP/s from
the routed pairs' FLOPs; each gate_up and down output compared with the committed config's (``err``,
``err_down``). Env: MS (default 1727,2048), BUDGET (s, default 200), OUT.

    MS=1727 BUDGET=40 PYTHONPATH=$PWD python3 benchmarks/kernels/moe_prefill_tiles_gpu.py   # stops the grid at BUDGET
"""
import json, os, time
import torch
from loraplex.kernels import fused_moe as fm
from loraplex.kernels.moe_align import moe_align
from loraplex.kernels.tuning_cases import bench_time_ms, rel_error, _routing
from loraplex.kernels import tuning

if not torch.cuda.is_available():
    raise SystemExit("moe_prefill_tiles_gpu.py needs a CUDA GPU")
OUT = os.environ.get("OUT", "/tmp")
BUDGET = float(os.environ.get("BUDGET", "200"))
t0 = time.time()
E, A, H, I = 32, 4, 2880, 2880
dev = "cuda"
rows = []
def log(**r):
    rows.append(r); print(json.dumps(r), flush=True)
torch.manual_seed(0)
w13 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).to(torch.bfloat16)
w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).to(torch.bfloat16)
b13 = torch.randn(E, 2 * I, device=dev, dtype=torch.bfloat16) * 0.1
b2 = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.1
grid = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=w, num_stages=st)
        for bm, bn, bk, gm, w, st in [
            (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 3), (128, 64, 64, 8, 4, 4),
            (128, 256, 64, 8, 8, 3), (64, 128, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3), (128, 128, 32, 8, 8, 5),
            (64, 128, 128, 8, 4, 3), (128, 128, 64, 1, 8, 3), (128, 128, 64, 16, 8, 3), (128, 64, 128, 8, 4, 3),
            (64, 64, 64, 8, 4, 5), (128, 256, 32, 8, 8, 4)]]
for m in [int(v) for v in os.environ.get("MS", "1727,2048").split(",")]:
    x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
    tw, ids = _routing(m, E, A, dev)
    counts = torch.bincount(ids.flatten(), minlength=E)
    pairs = m * A
    fl_gu, fl_dn = 2 * pairs * H * 2 * I, 2 * pairs * I * H
    committed = tuning.get_config("fused_moe", fm.shape_of(x, w13, ids), m, fm.DEFAULT_CONFIG)
    want = fm.fused_moe(x, w13, w2, tw, ids, activation="swiglu_clamp", b13=b13, b2=b2, config=committed)
    op_us = bench_time_ms(lambda: fm.fused_moe(x, w13, w2, tw, ids, activation="swiglu_clamp", b13=b13, b2=b2,
                                               config=committed)) * 1e3
    log(m=m, what="op committed", cfg=committed, us=op_us, tflops=(fl_gu + fl_dn) / op_us / 1e6,
        max_count=int(counts.max()), min_count=int(counts.min()))
    # cuBLAS: bmm at the mean per-expert row count (padded to the max), same K/N
    r = int(counts.max())
    xa = torch.randn(E, r, H, device=dev, dtype=torch.bfloat16)
    ha = torch.randn(E, r, I, device=dev, dtype=torch.bfloat16)
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    us = bench_time_ms(lambda: torch.bmm(xa, w13t)) * 1e3
    log(m=m, what="cublas bmm gate_up (rows=max count)", us=us, tflops=2 * E * r * H * 2 * I / us / 1e6)
    us = bench_time_ms(lambda: torch.bmm(ha, w2t)) * 1e3
    log(m=m, what="cublas bmm down (rows=max count)", us=us, tflops=2 * E * r * I * H / us / 1e6)
    h_ref = o_ref = None
    rows_of = [[c, {**c, "TMA": 1}] if c["BLOCK_K"] * 2 <= 128 else [c] for c in grid]  # each tile, then its TMA form
    for cfg in [committed] + [c for pair in rows_of for c in pair]:
        if time.time() - t0 > BUDGET:
            log(m=m, what="stopped (budget)"); break
        try:
            align = moe_align(ids, E, cfg["BLOCK_M"])
            g = lambda: fm.gate_up(x, w13, align, cfg, top_k=A, activation="swiglu_clamp", b13=b13)
            h = g()
            if h_ref is None:
                h_ref = h
            e_gu = rel_error(h, h_ref)
            us_gu = bench_time_ms(g) * 1e3
            d = lambda: fm.down(h_ref, w2, tw, align, cfg, b2=b2)
            o = d()
            if o_ref is None:
                o_ref = o
            e_dn = rel_error(o, o_ref)
            us_dn = bench_time_ms(d) * 1e3
            log(m=m, what="gemms", cfg=cfg, gate_up_us=us_gu, gate_up_tflops=fl_gu / us_gu / 1e6, err=e_gu,
                down_us=us_dn, down_tflops=fl_dn / us_dn / 1e6, err_down=e_dn)
        except Exception as ex:  # noqa: BLE001
            log(m=m, what="error", cfg=cfg, error=f"{type(ex).__name__}: {str(ex)[:200]}")
            torch.cuda.synchronize()
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(f"{OUT}/moe_prefill.json", "w"), indent=1)
