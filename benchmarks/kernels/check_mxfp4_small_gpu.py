"""MXFP4 expert kernels at small, awkward shapes on the device (float32 and bf16 activations): both layouts'
``fused_moe_mxfp4`` and ``moe_experts_lora`` (expert LoRA on both targets, mixed adapters and base tokens) against
the torch reference, eager and through a CUDA graph. Prints one line per case with its relative error.

    PYTHONPATH=$PWD python3 benchmarks/kernels/check_mxfp4_small_gpu.py     # H200: about 30 s
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

SHAPES = ((6, 2, 64, 32), (4, 2, 96, 64), (4, 2, 128, 64), (32, 4, 2880, 2880))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def case(e: int, a: int, h: int, i: int, m: int, dtype: torch.dtype, graph: bool) -> list[str]:
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from loraplex.kernels.moe_experts_lora import moe_experts_lora
    from loraplex.kernels.mxfp4 import prepare_for_kernel, quantize_mxfp4

    dev = "cuda"
    x = torch.randn(m, h, device=dev, dtype=dtype)
    w13 = torch.randn(e, 2 * i, h, device=dev) * 0.05
    w2 = torch.randn(e, h, i, device=dev) * 0.05
    b13 = (torch.randn(e, 2 * i, device=dev) * 0.01).to(dtype)
    b2 = (torch.randn(e, h, device=dev) * 0.01).to(dtype)
    v, ids = torch.topk(torch.randn(m, e, device=dev), a, dim=-1)
    wts = torch.softmax(v, -1)
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    kern = (*prepare_for_kernel(q13, s13), *prepare_for_kernel(q2, s2))
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    slots, r = 3, 8
    idx = torch.tensor([(t % (slots + 1)) - 1 for t in range(m)], device=dev, dtype=torch.int32)  # -1: base
    mk = lambda k, n: ref.as_expert_table(((torch.randn(slots, e, r, k, device=dev) / k ** 0.5).to(dtype),  # noqa
                                           (torch.randn(slots, e, n, r, device=dev) / r ** 0.5).to(dtype)))
    lkw = dict(kw, w13_lora=mk(h, 2 * i), w2_lora=mk(i, h))
    scaling = torch.full((slots,), 2.0, device=dev)
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
    lines = []
    for name, (fn, w) in calls.items():
        try:
            got = fn()
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = fn()
                g.replay()
                torch.cuda.synchronize()
                got = out
            lines.append(f"E={e} A={a} H={h} I={i} M={m} {str(dtype)[6:]} {'graph' if graph else 'eager'} {name}: "
                         f"rel err {rel(got, w):.2e}")
        except Exception as err:  # noqa: BLE001
            lines.append(f"E={e} A={a} H={h} I={i} M={m} {str(dtype)[6:]} {name}: ERROR {type(err).__name__}: "
                         f"{str(err)[:200]}")
    return lines


def main() -> int:
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    for e, a, h, i in SHAPES:
        for m in (1, 5, 33):
            for dtype in (torch.float32, torch.bfloat16):
                for graph in (False, True):
                    for line in case(e, a, h, i, m, dtype, graph):
                        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
