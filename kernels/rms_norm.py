"""Fused RMSNorm (optionally with the residual add) in Triton: one program per token row. On sm_90+ a PDL launch
(``slot_blocks.step_pdl``): each program loads the norm's weight, then waits for the kernel before it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.slot_blocks import pdl_launch, pdl_trigger, pdl_wait, step_pdl


@cached_launch
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  # x, residual [T, H]; weight [H]; out, new residual [T, H]
    H, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    # ---- normalise in fp32 after rounding the sum to the input dtype (as the reference does)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = xf * tl.rsqrt(var + eps)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Same contract as ``reference.rms_norm``. x [T, H]; weight [H]; residual [T, H] or None."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm expects x [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be a row-contiguous {tuple(x.shape)} tensor, got {tuple(residual.shape)}")
    block = next_power_of_2(hidden)
    if num_tokens:
        pdl = step_pdl(x.device)
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, res_out, hidden, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_H=block, USE_PDL=pdl, num_warps=min(16, max(1, block // 256)),
            **pdl_launch(pdl),
        )
    return out if residual is None else (out, res_out)
