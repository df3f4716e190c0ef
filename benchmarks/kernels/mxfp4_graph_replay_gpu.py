"""The tuned MXFP4 expert op as the engine's CUDA graphs run it: at each M, the op with the device's tuned entry
called eagerly, then captured in a CUDA graph and replayed 50 times; rows give whether the entry takes the one
launch (``ONE_LAUNCH``), both outputs' relative error against the torch reference, the largest difference of a
replay from the eager call (the one launch's float32 atomic sums may differ in order; the two launches may not),
and the op's time by strict graph timing (``tuning_cases.bench_time_ms(strict=True)``: a capture failure is an
error, not a fallback).

    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_graph_replay_gpu.py --m 1,2,3,4,8

Writes ``graph_check.json`` to $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mxfp4_gemm_gpu import GPT_OSS_20B, moe_inputs, rel_error  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--m", default="1,2,3,4,8")
    p.add_argument("--replays", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4, kernel_config
    from loraplex.kernels.tuning_cases import bench_time_ms

    s = GPT_OSS_20B
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    for m in (int(v) for v in args.m.split(",")):
        inp = moe_inputs(s, m, "cuda", 77 + m)
        kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
        call = (inp["x"], *inp["kernel"], inp["weights"], inp["ids"])
        cfg = kernel_config(inp["x"], inp["kernel"][0], inp["ids"])
        want = ref.fused_moe_mxfp4(inp["x"], *inp["plain"], inp["weights"], inp["ids"], **kw)
        eager = fused_moe_mxfp4(*call, **kw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
            fused_moe_mxfp4(*call, **kw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fused_moe_mxfp4(*call, **kw)
        diff = 0.0
        for _ in range(args.replays):
            graph.replay()
            torch.cuda.synchronize()
            diff = max(diff, float((got.float() - eager.float()).abs().max()))
        row = {"m": m, "one_launch": bool(cfg.get("ONE_LAUNCH")), "rel_err_eager": rel_error(eager, want),
               "rel_err_graph": rel_error(got, want), "max_graph_vs_eager": diff,
               "us_strict": bench_time_ms(lambda: fused_moe_mxfp4(*call, **kw), strict=True) * 1e3}
        print(row, flush=True)
        out["rows"].append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "graph_check.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
