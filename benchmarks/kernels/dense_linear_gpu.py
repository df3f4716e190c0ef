"""The dense projections of a decode step on the GPU: ``F.linear`` (cuBLAS) against the Triton decode GEMM
(``kernels/dense_gemm.py``) over a grid of tiles, at the GPT-OSS-20B shapes, held against the byte roofline of the
weights at the copy rate measured in the same run.

    PYTHONPATH=$PWD python3 benchmarks/kernels/dense_linear_gpu.py --out "$OUT" [--tune]   # ~1-2 min on an H200

Shapes (in -> out): qkv 2880 -> 5120 (64 q + 2 x 8 kv heads of 64, bias), o 4096 -> 2880 (bias); cuBLAS alone for
the router 2880 -> 32 and the LM head 2880 -> 201088. bf16. Every call is timed by CUDA-graph replay after a read
of 4x the L2 (``tuning_cases.bench_time_ms``), as the engine replays its decode graphs with every layer's weights
passing through L2 in between; every Triton config is checked against ``F.linear`` (rel. error <= 1e-2) before
it counts (the tile grid is ``loraplex tune``'s, ``tuning_cases.dense_gemm_space``). ``--tune`` writes, per shape
and M, the fastest Triton config, or one with ``"CUBLAS": 1`` where cuBLAS was at least as fast, into the device's
``dense_gemm.json`` (``kernels.tuning.write_configs``). Writes
``dense_linear.json`` under ``--out``: µs, share of the roofline, the winners and the whole sweep.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {  # name: (in, out, bias, calls per decode step, swept)
    "qkv": (2880, 5120, True, 24, True),
    "o": (4096, 2880, True, 24, True),
    "router": (2880, 32, True, 24, False),
    "lm_head": (2880, 201088, False, 1, False),
}


def copy_tbs(nbytes: int = 1 << 30) -> float:
    """Bytes read + written by a device-to-device copy, per second (median of 5), TB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * nbytes / sorted(times)[2] / 1e12


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12))


def main() -> int:
    from loraplex.kernels import tuning
    from loraplex.kernels.dense_gemm import DEFAULT_CONFIG, OP, dense_gemm, shape_of
    from loraplex.kernels.tuning_cases import bench_time_ms, dense_gemm_space

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="1,4,16,32,64", help="rows per call, comma-separated")
    p.add_argument("--tune", action="store_true", help="write the winners into the device's dense_gemm.json")
    p.add_argument("--out", default=None, help="folder for dense_linear.json")
    args = p.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    tbs = copy_tbs()
    print(f"{torch.cuda.get_device_name()}: copy rate {tbs:.2f} TB/s")
    rows, sweep, winners = [], [], {}
    for name, (k, n, has_bias, per_step, swept) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, w, bias)
            nbytes = (w.numel() + m * (k + n) + (n if has_bias else 0)) * 2
            roof = nbytes / (tbs * 1e12) * 1e6
            cublas = bench_time_ms(lambda: F.linear(x, w, bias)) * 1e3
            best, best_us = None, float("inf")
            for cfg in dense_gemm_space(m) if swept else []:
                try:
                    err = rel_error(dense_gemm(x, w, bias, cfg), want)
                    us = bench_time_ms(lambda: dense_gemm(x, w, bias, cfg), strict=True) * 1e3
                except Exception as e:  # noqa: BLE001  (a tile the compiler cannot fit)
                    sweep.append({"shape": name, "m": m, **cfg, "error": type(e).__name__})
                    continue
                ok = err <= 1e-2
                sweep.append({"shape": name, "m": m, **cfg, "us": round(us, 2), "rel_error": err, "ok": ok})
                if ok and us < best_us:
                    best, best_us = cfg, us
            row = {"shape": name, "in": k, "out": n, "bias": has_bias, "m": m, "roofline_us": round(roof, 2),
                   "cublas_us": round(cublas, 2), "cublas_share": round(roof / cublas, 3),
                   "per_step_calls": per_step}
            line = f"{name:8s} M={m:3d}  cuBLAS {cublas:7.2f} µs ({100 * roof / cublas:5.1f}%)"
            if best is not None:
                row.update(triton_us=round(best_us, 2), triton_share=round(roof / best_us, 3), triton_config=best,
                           speedup=round(cublas / best_us, 3))
                line += f"  Triton {best_us:7.2f} µs ({100 * roof / best_us:5.1f}%)  x{cublas / best_us:.2f}  {best}"
                winners.setdefault(shape_of(n, k)["N"], {})[m] = best if best_us < cublas else \
                    {**DEFAULT_CONFIG, "CUBLAS": 1}
            rows.append(row)
            print(line, flush=True)
    for name, (k, n, _, per_step, swept) in SHAPES.items():
        if swept:
            saved = sum(r["cublas_us"] - min(r["cublas_us"], r.get("triton_us", r["cublas_us"]))
                        for r in rows if r["shape"] == name and r["m"] == 16) * per_step / 1e3
            print(f"{name}: {saved:.3f} ms a decode step saved at M = 16")
    written = None
    if args.tune and winners:
        shapes = {tuning.shape_key(shape_of(n, k)): winners[n] for _, (k, n, *_r) in SHAPES.items() if n in winners}
        written = str(tuning.write_configs(OP, shapes))
        print(f"wrote {written}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dense_linear.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_tbs": round(tbs, 3), "torch": torch.__version__,
                       "rows": rows, "tuning_file": written, "sweep": sweep}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
