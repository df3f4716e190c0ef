"""The MoE layer's input norm with its router in Triton: residual add, RMSNorm and the router's logits in one launch.

    x [T, H] + residual [T, H] -> residual' (the sum), out = RMSNorm(residual') [T, H],
    logits = out @ router_weight[E, H]^T (+ router_bias[E])  [T, E]

At decode sizes the router is a 2880 x 32 product (184 KB of weight at GPT-OSS-20B) that a GEMM library launches as
a kernel of its own, about as long as the norm before it; here the programs that normalise a token row also take its
dot products with a block of router rows (grid: tokens x expert blocks; each program loads its block's rows first,
so that they are in flight while it normalises its row again, and the first of the row writes the norm's outputs).
The logits round the float32 sums to the input dtype, as a bf16 GEMM does; the summation order is not the GEMM
library's, so a logit may differ from ``F.linear``'s by one unit in the last place. Above MAX_TOKENS rows (prefill
chunks) every program would re-read the router's rows for its token, so the launcher runs the plain norm and
``F.linear`` instead. On sm_90+ a PDL launch (``slot_blocks.step_pdl``): the router rows and the norm's weight are
loaded before the wait for the kernel before it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.rms_norm import rms_norm
from loraplex.kernels.slot_blocks import pdl_launch, pdl_trigger, pdl_wait, step_pdl

MAX_TOKENS = 64  # decode and verify steps; prefill chunks run the norm, then the GEMM
BLOCK_E = 8  # router rows per program


@cached_launch
@triton.jit
def _rms_norm_router_kernel(
    x_ptr, res_ptr, w_ptr, rw_ptr, rb_ptr, out_ptr, res_out_ptr, logits_ptr,
    # x, residual [T, H]; norm weight [H]; router weight [E, H], bias [E]; out, new residual [T, H]; logits [T, E]
    H, E, eps,
    stride_x, stride_res, stride_out, stride_res_out, stride_rw, stride_logits,
    HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    # the router rows first: their load is in flight while the row is summed and normalised
    experts = block * BLOCK_E + tl.arange(0, BLOCK_E)
    live = experts < E
    rw = tl.load(rw_ptr + experts[:, None].to(tl.int64) * stride_rw + cols[None, :],
                 mask=live[:, None] & mask[None, :], other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        rb = tl.load(rb_ptr + experts, mask=live, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)  # weights above, the step's rows below
    pdl_trigger(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum rounded to the input dtype, as torch adds
    # ---- normalise in fp32 (as rms_norm and the reference do)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = xf * tl.rsqrt(var + eps)
    out = (w * y).to(out_ptr.dtype.element_ty)
    if block == 0:
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
    # ---- this block's router rows against the rounded output (what the router reads from memory otherwise)
    acc = tl.sum(out.to(tl.float32)[None, :] * rw.to(tl.float32), axis=1)  # [BLOCK_E]
    if HAS_BIAS:
        acc += rb
    tl.store(logits_ptr + row * stride_logits + experts, acc.to(logits_ptr.dtype.element_ty), mask=live)


def rms_norm_router(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                    router_weight: torch.Tensor, router_bias: torch.Tensor | None):
    """Same contract as ``reference.rms_norm_router``: (out [T, H], x + residual [T, H], logits [T, E])."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm_router expects x [T, H] and weight [H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1]:
        raise ValueError(f"router_weight must be [E, H={x.shape[1]}], got {tuple(router_weight.shape)}")
    if router_bias is not None and router_bias.shape != (router_weight.shape[0],):
        raise ValueError(f"router_bias must be [E={router_weight.shape[0]}], got {tuple(router_bias.shape)}")
    num_tokens, hidden = x.shape
    if num_tokens > MAX_TOKENS or router_weight.stride(-1) != 1:
        out, res_out = rms_norm(x, weight, eps, residual)
        return out, res_out, F.linear(out, router_weight, router_bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual must be a row-contiguous {tuple(x.shape)} tensor, got {tuple(residual.shape)}")
    num_experts = router_weight.shape[0]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    logits = torch.empty(num_tokens, num_experts, dtype=x.dtype, device=x.device)
    block = next_power_of_2(hidden)
    if num_tokens:
        pdl = step_pdl(x.device)
        _rms_norm_router_kernel[(num_tokens, cdiv(num_experts, BLOCK_E))](
            x, residual, weight, router_weight, router_bias if router_bias is not None else router_weight,
            out, res_out, logits, hidden, num_experts, eps,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), router_weight.stride(0),
            logits.stride(0),
            HAS_BIAS=router_bias is not None, BLOCK_H=block, BLOCK_E=BLOCK_E, USE_PDL=pdl,
            num_warps=min(16, max(1, block // 256)), **pdl_launch(pdl),
        )
    return out, res_out, logits
