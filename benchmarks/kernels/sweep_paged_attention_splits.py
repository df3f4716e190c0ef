"""Decode attention time against ``num_splits`` at GPT-OSS-20B shapes (64 q / 8 kv heads of 64, block 16, bf16,
sinks): for M sequences at context ctx, the split counts 1, 2, 4, 8, 16 and the default (``default_num_splits``),
plus the window-128 layer. CUDA-graph replay, L2-warm (the M=1 rows are optimistic: 4 MB of KV stays in L2).

    python3 benchmarks/kernels/sweep_paged_attention_splits.py      # ~20 s on an H200
"""
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402

from loraplex.kernels.paged_attention import default_num_splits, paged_attention  # noqa: E402

ROOFLINE_GBS = 4200.0


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_paged_attention_splits.py needs a CUDA GPU; torch sees none")
    for m, ctx in ((1, 2048), (16, 2048), (64, 2048), (16, 8192)):
        per = ctx // 16
        kc = torch.randn(m * per + 1, 16, 8, 64, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(m * per, device="cuda").view(m, per).int()
        sl = torch.full((m,), ctx, device="cuda", dtype=torch.int32)
        qsl = torch.arange(m + 1, device="cuda", dtype=torch.int32)
        q = torch.randn(m, 64, 64, device="cuda", dtype=torch.bfloat16)
        sinks = torch.randn(64, device="cuda")
        mbytes = 2 * m * ctx * 8 * 64 * 2 / 1e6
        cells = []
        for ns in (1, 2, 4, 8, 16, None):
            def f(ns=ns):
                return paged_attention(q, kc, vc, bt, sl, qsl, 0.125, sinks=sinks, num_splits=ns)
            f()
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(f, rep=50) * 1e3
            label = ns or f"default={default_num_splits(m, m, 8)}"
            cells.append(f"{label}:{us:.1f}us/{100 * mbytes / us * 1e3 / ROOFLINE_GBS:.0f}%")

        def w():
            return paged_attention(q, kc, vc, bt, sl, qsl, 0.125, sinks=sinks, sliding_window=128)
        w()
        torch.cuda.synchronize()
        cells.append(f"win128:{triton.testing.do_bench_cudagraph(w, rep=50) * 1e3:.1f}us")
        print(f"m={m} ctx={ctx} KV={mbytes:.0f}MB |", " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
