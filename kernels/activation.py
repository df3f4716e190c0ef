"""Gated activations in Triton: x [T, 2I] = [gate | up] -> act(gate) * up [T, I].

Two entry points share one kernel (the activation is a constexpr): SiLU-and-mul and GPT-OSS's clamped SwiGLU.
On sm_90+ a PDL launch (``slot_blocks.step_pdl``) that waits for the kernel before it first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.slot_blocks import pdl_launch, pdl_wait, step_pdl


@triton.jit
def gated_act(gate, up, ACT: tl.constexpr, alpha, limit):
    """act(gate) * up on float32 tiles: ACT 0 = SiLU-and-mul, 1 = GPT-OSS's clamped SwiGLU (alpha, limit). Shared
    with the fused MoE gate_up epilogue."""
    if ACT == 0:
        y = gate * tl.sigmoid(gate) * up
    else:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        y = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    return y


@cached_launch
@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr,  # x [T, 2I]; out [T, I]
    I, stride_x, stride_out, alpha, limit,
    ACT: tl.constexpr,  # 0: silu(gate) * up, 1: clamped swiglu
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gated_act(gate, up, ACT, alpha, limit)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, act: int, alpha: float, limit: float) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"gated activation expects x [T, 2I], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    block = min(1024, next_power_of_2(max(inter, 16)))
    if num_tokens and inter:
        pdl = step_pdl(x.device)
        _act_and_mul_kernel[(num_tokens, cdiv(inter, block))](
            x, out, inter, x.stride(0), out.stride(0), float(alpha), float(limit), ACT=act, BLOCK=block,
            USE_PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.silu_and_mul``."""
    return _launch(x, 0, 1.0, 0.0)


def swiglu_clamp_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Same contract as ``reference.swiglu_clamp_and_mul``."""
    return _launch(x, 1, alpha, limit)
