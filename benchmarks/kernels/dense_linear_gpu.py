"""The dense projections of a decode step on the GPU: ``F.linear`` (cuBLAS, with bias where the model has one) at the
GPT-OSS-20B shapes, held against the byte roofline of the weights at the copy rate measured in the same run.

    PYTHONPATH=$PWD python3 benchmarks/kernels/dense_linear_gpu.py --out "$OUT"      # ~10 s on an H100 or H200

Shapes (in -> out): qkv 2880 -> 5120 (64 q + 2 x 8 kv heads of 64, bias), o 4096 -> 2880 (bias), router 2880 -> 32
(bias), LM head 2880 -> 201088 (no bias); bf16. Every call is timed by CUDA-graph replay after a read of 4x the L2
(``tuning_cases.bench_time_ms``), as the engine replays its decode graphs with every layer's weights passing
through L2 in between. Writes ``dense_linear.json`` under ``--out``: µs per call, share of the roofline and the
time a decode step spends in each projection, per shape and M, with the device and the copy rate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mxfp4_gemm_gpu import copy_bandwidth_tbs  # noqa: E402

SHAPES = {  # name: (in, out, bias, calls per decode step)
    "qkv": (2880, 5120, True, 24),
    "o": (4096, 2880, True, 24),
    "router": (2880, 32, True, 24),
    "lm_head": (2880, 201088, False, 1),
}


def roofline_us(k: int, n: int, m: int, has_bias: bool, tbs: float) -> float:
    """µs to move one call's bytes (bf16 weights, M rows in and out, the bias) at the copy rate ``tbs`` (TB/s)."""
    nbytes = (n * k + m * (k + n) + (n if has_bias else 0)) * 2
    return nbytes / (tbs * 1e12) * 1e6


def main(argv: list[str] | None = None) -> int:
    from loraplex.kernels.tuning_cases import bench_time_ms

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="1,4,16,32,64", help="rows per call, comma-separated")
    p.add_argument("--out", default=None, help="folder for dense_linear.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("dense_linear_gpu.py needs a CUDA GPU; torch sees none")
    ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    tbs = copy_bandwidth_tbs("cuda", 1 << 30)
    print(f"{torch.cuda.get_device_name()}: copy rate {tbs:.2f} TB/s")
    rows = []
    for name, (k, n, has_bias, per_step) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = bench_time_ms(lambda: F.linear(x, w, bias)) * 1e3
            roof = roofline_us(k, n, m, has_bias, tbs)
            rows.append({"shape": name, "in": k, "out": n, "bias": has_bias, "m": m, "cublas_us": round(us, 2),
                         "roofline_us": round(roof, 2), "cublas_share": round(roof / us, 3),
                         "per_step_ms": round(us * per_step / 1e3, 3)})
            print(f"{name:8s} M={m:3d}  {us:8.2f} µs  roofline {roof:7.2f} µs  {100 * roof / us:5.1f}%  "
                  f"x{per_step} = {us * per_step / 1e3:.3f} ms a step", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dense_linear.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_tbs": round(tbs, 3), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
