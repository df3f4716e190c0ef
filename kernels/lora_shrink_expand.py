"""Dense LoRA shrink and expand fused into one Triton kernel, for small ranks (decode).

Each program owns (a token block of one adapter slot) x (a column block of one output slice) -- token blocks
of all slots together, found from the segment lengths (``slot_blocks``) -- and recomputes
h = scaling * x_rows @ A[l, s].T in registers ([BLOCK_M, R], fp32) and adds h @ B[l, s][cols].T into y, both
factors read at the slot's own rank through the ``LoRATable`` (a slice with rank 0 does nothing). The
column blocks of one token block run next to each other, so x rows and A stay in L2 between them; the
[S, T, R] buffer and the second launch of the two-kernel path disappear. Worth it while R is small and the
shrink's K loop is cheaper than a launch; ``lora_shrink`` + ``lora_expand`` remain the general path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.dot import dot
from loraplex.kernels.lora_expand import MAX_SLICES
from loraplex.kernels.lora_shrink import block_r, lora_segments
from loraplex.kernels.lora_table import as_table
from loraplex.kernels.reference_lora import dense_table
from loraplex.kernels.slot_blocks import flat_blocks, segment_rows, slot_block, tl_dtype, weight_entry
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


@cached_launch
@triton.jit(do_not_specialize=["L"])
def _lora_shrink_expand_kernel(
    y_ptr, x_ptr, entries_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr,
    # y [T, N]; x [T, K]; entries [L, S, 3] (A address, B address, rank); order [T]; seg_* [L]; scaling [>= L]
    K, L, OFF1, OFF2, W0, W1, W2,
    stride_yt, stride_xt, stride_el, stride_es,
    W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    pid_n = pid % NUM_N
    lora, pid_m, past = slot_block(pid // NUM_N, seg_len_ptr, L, BLOCK_M, BLOCK_L, False)
    width = tl.where(sl == 0, W0, tl.where(sl == 1, W1, W2))
    if past | (pid_n * BLOCK_N >= width):  # early exit
        return
    a_ptr, rank = weight_entry(entries_ptr, lora, sl, stride_el, stride_es, 0, W_DTYPE)
    b_ptr, _ = weight_entry(entries_ptr, lora, sl, stride_el, stride_es, 1, W_DTYPE)
    if rank == 0:  # the slot's adapter does not target this slice
        return
    offset = tl.where(sl == 0, 0, tl.where(sl == 1, OFF1, OFF2))
    tok, row_ok = segment_rows(order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    # ---- shrink: h = x_rows @ A.T (A [rank, K] row-major)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + k[None, :]
    a_ptrs = a_ptr + r[None, :].to(tl.int64) * K + k[:, None]
    h = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = k0 + k < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        h += dot(xt, at.to(xt.dtype))
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    h *= tl.load(scaling_ptr + lora).to(tl.float32)
    # ---- expand into this column block (B stored as B^T [rank, width]), fused add
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    b = tl.load(b_ptr + r[:, None].to(tl.int64) * width + cols[None, :],
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    delta = dot(h.to(b.dtype), b)
    cols = offset + cols
    y_ptrs = y_ptr + tok[:, None] * stride_yt + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def shape_of(y: torch.Tensor, lora_a, output_slices) -> dict[str, int]:
    """Tuning-file shape key dims (N is the widest slice)."""
    table = as_table(lora_a, output_slices=output_slices, which="a")
    return {"S": table.num_slices, "R": table.max_rank, "K": table.in_features, "N": max(output_slices)}


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, lora_a, lora_b, token_lora_idx: torch.Tensor,
                       scaling: torch.Tensor, output_slices: tuple[int, ...], *, config: dict | None = None,
                       segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Same contract as ``reference_lora.lora_shrink_expand`` (in place)."""
    table = dense_table(lora_a, lora_b, output_slices)
    table.check()
    num_slices, max_loras, rank, in_features = table.num_slices, table.num_slots, table.max_rank, table.in_features
    if x.shape != (y.shape[0], in_features):
        raise ValueError(f"x must be [T={y.shape[0]}, K={in_features}], got {tuple(x.shape)}")
    if len(output_slices) != num_slices or sum(output_slices) != y.shape[1] or \
            tuple(output_slices) != tuple(table.out_features):
        raise ValueError(f"output_slices {tuple(output_slices)} must have S={num_slices} widths summing to "
                         f"y's N={y.shape[1]} and equal to the LoRA B widths {tuple(table.out_features)}")
    if num_slices > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} output slices are supported, got {num_slices}")
    for name, t in (("x", x), ("y", y)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if scaling.dim() != 1 or scaling.shape[0] < max_loras:
        raise ValueError(f"scaling must be [>= L={max_loras}], got {tuple(scaling.shape)}")
    num_tokens = y.shape[0]
    if num_tokens == 0:
        return
    cfg = config or tuning.get_config("lora_shrink_expand", shape_of(y, table, output_slices), num_tokens,
                                      DEFAULT_CONFIG)
    order, seg_start, seg_len = segments or lora_segments(token_lora_idx, max_loras)
    widths = list(output_slices) + [0] * (MAX_SLICES - num_slices)
    offsets = [0, widths[0], widths[0] + widths[1]]
    bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    num_n = cdiv(max(output_slices), bn)
    grid = (flat_blocks(num_tokens, max_loras, bm) * num_n, num_slices)
    ent = table.entries
    _lora_shrink_expand_kernel[grid](
        y, x, ent, order, seg_start, seg_len, scaling, in_features, max_loras,
        offsets[1], offsets[2], *widths,
        y.stride(0), x.stride(0), ent.stride(0), ent.stride(1),
        W_DTYPE=tl_dtype(table.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=block_r(rank), BLOCK_K=bk, NUM_N=num_n,
        EVEN_K=in_features % bk == 0, BLOCK_L=next_power_of_2(max_loras), num_warps=int(cfg["num_warps"]),
        num_stages=int(cfg["num_stages"]),
    )
