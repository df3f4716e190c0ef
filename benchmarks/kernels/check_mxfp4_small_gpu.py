"""MXFP4 expert kernels at small, awkward shapes on the device (float32 and bf16 activations): both layouts'
``fused_moe_mxfp4`` and ``moe_experts_lora`` (expert LoRA on both targets, mixed adapters and base tokens) against
the torch reference, eager and through a CUDA graph. One PASS / FAIL line per case with its relative error (bound
1e-4 in float32, 1e-2 in bf16); exits 1 if any case fails.

    PYTHONPATH=$PWD python3 benchmarks/kernels/check_mxfp4_small_gpu.py     # H200: about 30 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/kernels/check_mxfp4_small_gpu.py --device cpu  # smoke run
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the GEMM benchmark's inputs

import torch  # noqa: E402

from mxfp4_gemm_gpu import Shapes, lora_inputs, moe_inputs, rel_error  # noqa: E402

BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # relative error: float32 exact up to summation order; bf16
SHAPES = ((6, 2, 64, 32), (4, 2, 96, 64), (4, 2, 128, 64), (32, 4, 2880, 2880))


def case(e: int, a: int, h: int, i: int, m: int, dtype: torch.dtype, graph: bool, dev: str) -> list[tuple[str, bool]]:
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from loraplex.kernels.moe_experts_lora import moe_experts_lora

    shapes = Shapes("small", h, e, a, i)
    inp = moe_inputs(shapes, m, dev, 1000 * e + m, dtype)
    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    q13, s13, q2, s2 = inp["plain"]
    kern = inp["kernel"]
    kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
    slots = 3
    lo = lora_inputs(shapes, m, ids, slots, 8, dev, dtype)
    idx = torch.tensor([(t % (slots + 1)) - 1 for t in range(m)], device=dev, dtype=torch.int32)  # -1: base tokens
    lkw = dict(kw, w13_lora=lo["w13_lora"], w2_lora=lo["w2_lora"])
    scaling = lo["scaling"]
    want = ref.fused_moe_mxfp4(x, q13, s13, q2, s2, wts, ids, **kw)
    want_l = ref.moe_experts_lora(x, q13, q2, wts, ids, idx, scaling, w13_scale=s13, w2_scale=s2, **lkw)
    calls = {
        "fused_moe_mxfp4 kernel layout": (lambda: fused_moe_mxfp4(x, *kern, wts, ids, **kw), want),
        "fused_moe_mxfp4 checkpoint layout": (lambda: fused_moe_mxfp4(x, q13, s13, q2, s2, wts, ids, **kw), want),
        "moe_experts_lora kernel layout": (lambda: moe_experts_lora(x, kern[0], kern[2], wts, ids, idx, scaling,
                                                                    w13_scale=kern[1], w2_scale=kern[3], **lkw),
                                           want_l),
        "moe_experts_lora checkpoint layout": (lambda: moe_experts_lora(x, q13, q2, wts, ids, idx, scaling,
                                                                        w13_scale=s13, w2_scale=s2, **lkw), want_l),
    }
    bound = BOUNDS[dtype]
    lines = []
    for name, (fn, w) in calls.items():
        head = f"E={e} A={a} H={h} I={i} M={m} {str(dtype)[6:]} {'graph' if graph else 'eager'} {name}"
        try:
            got = fn()
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = fn()
                g.replay()
                torch.cuda.synchronize()
                got = out
            err = rel_error(got, w)
            lines.append((f"{'PASS' if err <= bound else 'FAIL'} {head}: rel err {err:.2e} (bound {bound:g})",
                          err <= bound))
        except Exception as exc:  # noqa: BLE001  (a case, not a crash)
            lines.append((f"FAIL {head}: {type(exc).__name__}: {str(exc)[:200]}", False))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cpu: the small shapes only, eager, float32 (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = args.device == "cuda"
    ok = True
    for e, a, h, i in SHAPES if cuda else SHAPES[:-1]:
        for m in (1, 5, 33):
            for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
                for graph in (False, True) if cuda else (False,):
                    for line, passed in case(e, a, h, i, m, dtype, graph, args.device):
                        print(line, flush=True)
                        ok = ok and passed
    print("check: PASS" if ok else "check: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
