"""Gated activations in Triton: x [T, 2I] = [gate | up] -> act(gate) * up [T, I].

Two entry points share one kernel (the activation is a constexpr): SiLU-and-mul and GPT-OSS's clamped SwiGLU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch


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
    lora_ptr, entries_ptr,  # SKIP_LORA: token_lora_idx [T / TOP_K]; a LoRATable's entries [L, 1, 3]
    I, stride_x, stride_out, alpha, limit, stride_el,
    ACT: tl.constexpr,  # 0: silu(gate) * up, 1: clamped swiglu
    BLOCK: tl.constexpr, SKIP_LORA: tl.constexpr, TOP_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if SKIP_LORA:  # rows whose slot has weights in the table are written by the LoRA expand
        slot = tl.load(lora_ptr + row // TOP_K).to(tl.int64)
        if slot >= 0:
            if tl.load(entries_ptr + slot * stride_el + 2) > 0:
                return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gated_act(gate, up, ACT, alpha, limit)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, act: int, alpha: float, limit: float, out: torch.Tensor | None = None,
            skip: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"gated activation expects x [T, 2I], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    elif out.shape != (num_tokens, inter) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {inter}] with unit column stride, got {tuple(out.shape)}")
    lora, entries, top_k = skip if skip is not None else (x, x, 1)
    block = min(1024, next_power_of_2(max(inter, 16)))
    if num_tokens and inter:
        _act_and_mul_kernel[(num_tokens, cdiv(inter, block))](
            x, out, lora, entries, inter, x.stride(0), out.stride(0), float(alpha), float(limit),
            entries.stride(0) if skip is not None else 0, ACT=act, BLOCK=block, SKIP_LORA=skip is not None,
            TOP_K=top_k, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.silu_and_mul``."""
    return _launch(x, 0, 1.0, 0.0)


def swiglu_clamp_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Same contract as ``reference.swiglu_clamp_and_mul``."""
    return _launch(x, 1, alpha, limit)


def act_and_mul_without_lora(x: torch.Tensor, out: torch.Tensor, activation: str, alpha: float, limit: float, *,
                             token_lora_idx: torch.Tensor, entries: torch.Tensor, top_k: int) -> torch.Tensor:
    """act(gate) * up of x [T*A, 2I] into ``out`` [T*A, I], only for the rows (pair p, token p // top_k) whose
    adapter slot has no weights in the LoRA table ``entries`` [L, 1, 3] (slot -1, or rank 0): the LoRA expand with
    the activation (``fused_moe_lora(..., activation=...)``) writes the others. ``activation`` as
    ``fused_moe.ACT_CODES``."""
    codes = {"silu": 0, "swiglu_clamp": 1}
    if activation not in codes:
        raise ValueError(f"unknown activation {activation!r}; expected 'silu' or 'swiglu_clamp'")
    if token_lora_idx.shape != (x.shape[0] // max(top_k, 1),) or entries.dim() != 3 or entries.shape[2] != 3:
        raise ValueError(f"token_lora_idx must be [T*A / top_k] and entries [L, S, 3], got "
                         f"{tuple(token_lora_idx.shape)} and {tuple(entries.shape)}")
    return _launch(x, codes[activation], alpha, limit, out, (token_lora_idx.contiguous(), entries, top_k))
