"""Neox-style rotary embedding (rotate halves) for q and k in one Triton launch.

Grid (T, q head blocks + k head blocks): a program looks up its token's position once, loads that row's cos and
sin [D/2] from the float32 table, and rotates BLOCK_H heads of q or of k:

    out[:D/2] = x1 * cos - x2 * sin        out[D/2:] = x2 * cos + x1 * sin        (x1, x2 = x[:D/2], x[D/2:])

q and k are usually strided views of the fused qkv projection (row stride Q*D + 2*KV*D); they are read through
their strides and the results written to new contiguous tensors, so inputs are left as they are (as in the
reference). No host sync: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch

MAX_TILE = 1024  # elements per half-tile (BLOCK_H x BLOCK_HALF) of one program


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, tok, head0, num_heads,  # x [T, N, D] (last dim unit stride); out [T, N, D] contiguous
    stride_xt, stride_xh, stride_ot, stride_oh,
    cos, sin,  # [BLOCK_HALF] float32 of this token
    HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    heads = head0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
    src = x_ptr + tok * stride_xt + heads[:, None].to(tl.int64) * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = out_ptr + tok * stride_ot + heads[:, None].to(tl.int64) * stride_oh + cols[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _rotary_kernel(
    pos_ptr, cs_ptr,  # positions [T] (int32 / int64); cos_sin_cache [max_pos, D] float32
    q_ptr, k_ptr, q_out_ptr, k_out_ptr,  # q [T, Q, D], k [T, KV, D] (strided); outputs contiguous
    num_q_heads, num_kv_heads, HALF, stride_cs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    # ---- this token's cos / sin row, in float32 (the table's precision)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cs_row = cs_ptr + pos * stride_cs + cols
    cos = tl.load(cs_row, mask=cols < HALF, other=0.0)
    sin = tl.load(cs_row + HALF, mask=cols < HALF, other=0.0)
    # ---- the first q blocks rotate q heads, the rest k heads
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if blk < num_q_blocks:
        _rotate_heads(q_ptr, q_out_ptr, tok, blk * BLOCK_H, num_q_heads, stride_qt, stride_qh, stride_qot,
                      stride_qoh, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    else:
        _rotate_heads(k_ptr, k_out_ptr, tok, (blk - num_q_blocks) * BLOCK_H, num_kv_heads, stride_kt, stride_kh,
                      stride_kot, stride_koh, cos, sin, HALF, BLOCK_H, BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.rotary_embedding``: positions [T]; q [T, Q, D]; k [T, KV, D] (any strides
    with unit last-dim stride, same float dtype); cos_sin_cache [max_pos, D] float32 -> new contiguous (q, k).

    Rounding: the math runs in float32 with the table's float32 cos / sin and rounds once to q's dtype. The
    reference first casts cos / sin to q's dtype and rounds every product and sum in it, so in bfloat16 the two
    differ by a few bf16 ulps (this one is the closer to the exact value); in float32 they agree to ~1 ulp.
    Positions are not range-checked (that would need a host sync); they must lie in [0, max_pos).
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary_embedding expects q [T, Q, D] and k [T, KV, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] (even head dim), got "
                         f"{tuple(cos_sin_cache.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    cos_sin_cache = cos_sin_cache.float()  # no-op for the engine's float32 table
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    block_half = next_power_of_2(half)
    block_h = max(1, min(next_power_of_2(max(num_q_heads, num_kv_heads)), MAX_TILE // block_half))
    num_blocks = cdiv(num_q_heads, block_h) + cdiv(num_kv_heads, block_h)
    if num_tokens:
        _rotary_kernel[(num_tokens, num_blocks)](
            positions, cos_sin_cache, q, k, q_out, k_out,
            num_q_heads, num_kv_heads, half, cos_sin_cache.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
        )
    return q_out, k_out
