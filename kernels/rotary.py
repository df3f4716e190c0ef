"""Neox-style rotary embedding (rotate halves) for q and k in one Triton launch.

Grid (T, q head blocks + k head blocks): a program looks up its token's position once, loads that row's cos and
sin [D/2] from the float32 table, and rotates BLOCK_H heads of q or of k:

    out[:D/2] = x1 * cos - x2 * sin        out[D/2:] = x2 * cos + x1 * sin        (x1, x2 = x[:D/2], x[D/2:])

q and k are usually strided views of the fused qkv projection (row stride Q*D + 2*KV*D); they are read through
their strides and the results written to new contiguous tensors, so inputs are left as they are (as in the
reference). No host sync: CUDA-graph capturable.

``rotary_embedding_and_cache`` is the attention layer's form: the same rotation, with k written straight into
its paged-cache slot and v copied into its own, in one launch instead of rotary + reshape_and_cache (an eager step
launches one kernel fewer per layer, and rotated k makes no round trip through memory). On sm_90+ both are PDL
launches (``slot_blocks.step_pdl``): the programs wait for the kernel before (the q/k/v projection or its LoRA
expand) before they read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.slot_blocks import pdl_launch, pdl_trigger, pdl_wait, step_pdl

MAX_TILE = 1024  # elements per half-tile (BLOCK_H x BLOCK_HALF) of one program


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, tok, dst_row, head0, num_heads,  # x [T, N, D] (last dim unit stride); out [rows, N, D]
    stride_xt, stride_xh, stride_ot, stride_oh,
    pos_ptr, cs_ptr, stride_cs,  # positions [T]; cos_sin_cache [max_pos, D] float32
    HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Heads head0 .. head0 + BLOCK_H of token ``tok``'s row of x, rotated into row ``dst_row`` of out with the
    token's cos / sin row (float32, the table's precision)."""
    cols = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cs_row = cs_ptr + pos * stride_cs + cols
    cos = tl.load(cs_row, mask=cols < HALF, other=0.0)
    sin = tl.load(cs_row + HALF, mask=cols < HALF, other=0.0)
    heads = head0 + tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
    src = x_ptr + tok * stride_xt + heads[:, None].to(tl.int64) * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = out_ptr + dst_row * stride_ot + heads[:, None].to(tl.int64) * stride_oh + cols[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _rotary_kernel(
    pos_ptr, cs_ptr,  # positions [T] (int32 / int64); cos_sin_cache [max_pos, D] float32
    q_ptr, k_ptr, q_out_ptr, k_out_ptr,  # q [T, Q, D], k [T, KV, D] (strided); outputs contiguous
    num_q_heads, num_kv_heads, HALF, stride_cs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if blk < num_q_blocks:  # the first q blocks rotate q heads, the rest k heads
        _rotate_heads(q_ptr, q_out_ptr, tok, tok, blk * BLOCK_H, num_q_heads, stride_qt, stride_qh, stride_qot,
                      stride_qoh, pos_ptr, cs_ptr, stride_cs, HALF, BLOCK_H, BLOCK_HALF)
    else:
        _rotate_heads(k_ptr, k_out_ptr, tok, tok, (blk - num_q_blocks) * BLOCK_H, num_kv_heads, stride_kt,
                      stride_kh, stride_kot, stride_koh, pos_ptr, cs_ptr, stride_cs, HALF, BLOCK_H, BLOCK_HALF)


@cached_launch
@triton.jit
def _rotary_cache_kernel(
    pos_ptr, cs_ptr, slot_ptr,  # positions [T]; cos_sin_cache [max_pos, D] float32; slot_mapping [T] (-1: none)
    q_ptr, k_ptr, v_ptr, q_out_ptr, kc_ptr, vc_ptr,  # q, k, v [T, *, D] (strided); q_out contiguous; caches
    num_q_heads, num_kv_heads, HALF, stride_cs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_qot, stride_qoh,
    ROW: tl.constexpr,  # KV * D: a token's row of one cache (contiguous)
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_ROW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (T, q head blocks + k head blocks + 1): q heads rotated into q_out, k heads rotated straight into the
    k cache at the token's slot, the last program of a token copies its v row into the v cache."""
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    num_k_blocks = tl.cdiv(num_kv_heads, BLOCK_H)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if blk == num_q_blocks + num_k_blocks:  # ---- v: copied as it is
        if slot >= 0:
            for start in range(0, ROW, BLOCK_ROW):
                offs = start + tl.arange(0, BLOCK_ROW)
                mask = offs < ROW
                v = tl.load(v_ptr + tok * stride_vt + offs, mask=mask)
                tl.store(vc_ptr + slot * ROW + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)
    elif blk < num_q_blocks:  # ---- q heads
        _rotate_heads(q_ptr, q_out_ptr, tok, tok, blk * BLOCK_H, num_q_heads, stride_qt, stride_qh, stride_qot,
                      stride_qoh, pos_ptr, cs_ptr, stride_cs, HALF, BLOCK_H, BLOCK_HALF)
    elif slot >= 0:  # ---- k heads, straight into the token's cache slot (-1: a padding row, nothing written)
        _rotate_heads(k_ptr, kc_ptr, tok, slot, (blk - num_q_blocks) * BLOCK_H, num_kv_heads, stride_kt, stride_kh,
                      ROW, HEAD_DIM, pos_ptr, cs_ptr, stride_cs, HALF, BLOCK_H, BLOCK_HALF)


def _check(positions, q, k, cos_sin_cache) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary_embedding expects q [T, Q, D] and k [T, KV, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    head_dim = q.shape[2]
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] (even head dim), got "
                         f"{tuple(cos_sin_cache.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [{q.shape[0]}], got {tuple(positions.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")


def _tiles(num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_HALF): heads per program and the half-row tile."""
    block_half = next_power_of_2(head_dim // 2)
    return max(1, min(next_power_of_2(max(num_q_heads, num_kv_heads)), MAX_TILE // block_half)), block_half


def _table(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    return cos_sin_cache.float()  # no-op for the engine's float32 table


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.rotary_embedding``: positions [T]; q [T, Q, D]; k [T, KV, D] (any strides
    with unit last-dim stride, same float dtype); cos_sin_cache [max_pos, D] float32 -> new contiguous (q, k).

    Rounding: the math runs in float32 with the table's float32 cos / sin and rounds once to q's dtype. The
    reference first casts cos / sin to q's dtype and rounds every product and sum in it, so in bfloat16 the two
    differ by a few bf16 ulps (this one is the closer to the exact value); in float32 they agree to ~1 ulp.
    Positions are not range-checked (that would need a host sync); they must lie in [0, max_pos).
    """
    _check(positions, q, k, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin_cache = _table(cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    block_h, block_half = _tiles(num_q_heads, num_kv_heads, head_dim)
    num_blocks = cdiv(num_q_heads, block_h) + cdiv(num_kv_heads, block_h)
    if num_tokens:
        pdl = step_pdl(q.device)
        _rotary_kernel[(num_tokens, num_blocks)](
            positions, cos_sin_cache, q, k, q_out, k_out,
            num_q_heads, num_kv_heads, head_dim // 2, cos_sin_cache.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            BLOCK_H=block_h, BLOCK_HALF=block_half, USE_PDL=pdl, num_warps=4, **pdl_launch(pdl),
        )
    return q_out, k_out


def rotary_embedding_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.rotary_embedding_and_cache``: ``rotary_embedding`` then ``reshape_and_cache``
    of the rotated k and of v, in one launch (rotated k goes straight to its cache slot) -> the rotated q [T, Q, D]
    (new, contiguous). v [T, KV, D] needs each token's KV * D values contiguous (a view of a fused qkv row is);
    the caches [NB, BS, KV, D] contiguous, of q's dtype (k is rounded once, as the two launches round it)."""
    _check(positions, q, k, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if v.shape != k.shape or v.stride(2) != 1 or v.stride(1) != head_dim:
        raise ValueError(f"v must be [T, KV, D] = {tuple(k.shape)} with each token's row contiguous, got "
                         f"{tuple(v.shape)} with strides {v.stride()}")
    if (k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be contiguous [*, *, "
                         f"{num_kv_heads}, {head_dim}]")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"caches of {k_cache.dtype} / {v_cache.dtype} for q of {q.dtype}: rotary_embedding and "
                         "reshape_and_cache round k twice there; call them apart")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin_cache = _table(cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_h, block_half = _tiles(num_q_heads, num_kv_heads, head_dim)
    row = num_kv_heads * head_dim
    num_blocks = cdiv(num_q_heads, block_h) + cdiv(num_kv_heads, block_h) + 1
    if num_tokens:
        pdl = step_pdl(q.device)
        _rotary_cache_kernel[(num_tokens, num_blocks)](
            positions, cos_sin_cache, slot_mapping, q, k, v, q_out, k_cache, v_cache,
            num_q_heads, num_kv_heads, head_dim // 2, cos_sin_cache.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), q_out.stride(0), q_out.stride(1),
            ROW=row, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_HALF=block_half,
            BLOCK_ROW=min(1024, next_power_of_2(row)), USE_PDL=pdl, num_warps=4, **pdl_launch(pdl),
        )
    return q_out
