"""The matrix product every Triton kernel here uses: fp32 accumulation, and full IEEE float32 products when the
operands are float32.

Triton's plain ``tl.dot`` on float32 operands rounds them to tf32 (10 mantissa bits) on the GPU; through a
model that is a relative logits error of 1e-3 to 8e-2 against transformers' float32 (reproduced on the CPU by
``benchmarks/kernels/check_engine_fp32.py --tf32-interpret``). float32 serves exactness checks, so it takes
the slow IEEE path; 16-bit operands keep the tensor cores (the dtype test is resolved at compile time).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b):
    """a [M, K] @ b [K, N] -> [M, N] float32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, out_dtype=tl.float32)
