"""LoRA shrink in Triton: buf[s, t, :r] = scaling[l] * x[t] @ A[l, s].T for tokens grouped by adapter.

Tokens are grouped by step slot on the device (a counting sort, no host sync); grid (token blocks of all
slots together, slices * SPLIT_K), each program finding its slot from the segment lengths (``slot_blocks``),
so tokens without an adapter and idle slots launch nothing. A program reads its slot's A through the
``LoRATable`` (address and rank r of each (slot, slice)), so every adapter is read at its own rank; a slice
with rank 0 (not targeted) leaves its rows zero. Split-K programs add their partial sums with relaxed
atomics into a zeroed fp32 buffer. The token count is not a compile-time constant: one compile serves every
batch size and context length.
Config "FUSE_SLICES": 1 computes every slice of a token block in one program, the slices' A rows side by side
as one product's columns (S rounded up to a power of two, times the rank tile), so x is read once instead of once
per slice: for prefill-sized batches of a multi-slice target (qkv), where x is the bytes that count; the grid's
second dim is then SPLIT_K alone. Not with COMPACT.
Config "COMPACT": c > 0 launches the grid's token-block dim divided by c, 1-D, each program walking the used
(token block, slice, split) items with a stride of the grid: a decode graph's table (one slot per row) then
launches c times fewer programs that do nothing, and each program scans the segment lengths once. c = 0: the
grid above.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.dot import dot
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.lora_table import LoRATable, as_table
from loraplex.kernels.slot_blocks import (block_at, flat_blocks, segment_rows, slot_block, tl_dtype, used_blocks,
                                         weight_entry)
from loraplex.kernels.launch import cached_launch

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}


def split_k_for(k: int, block_k: int) -> int:
    """Split-K for a shape without a tuned entry: a rank-R shrink has few (token block, slot) programs, so the
    K loop is split until each split walks about 4 BLOCK_K tiles (at most 16 splits). K = 2880 on the H200:
    32.7 us with SPLIT_K = 1, 5.2 us tuned with SPLIT_K = 16 (docs/performance.md)."""
    return max(1, min(16, -(-k // (4 * block_k))))


def default_config(k: int) -> dict:
    """DEFAULT_CONFIG with split-K sized for K (used when the tuning file has no entry for the shape)."""
    cfg = dict(DEFAULT_CONFIG)
    cfg["SPLIT_K"] = split_k_for(k, cfg["BLOCK_K"])
    if cfg["SPLIT_K"] > 1:
        cfg.update(num_warps=2, num_stages=3)
    return cfg


@triton.jit
def _shrink_product(x_ptr, a_cols, col_ok, tok, row_ok, scale, out_ptrs, pid_k, K, stride_xt,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
    """scale * x[tok] @ A^T over K split ``pid_k``'s share, stored at ``out_ptrs`` [BLOCK_M, BLOCK_N] where ``row_ok``
    and ``col_ok`` (split-K: relaxed atomic adds into the zeroed buffer); column n of the product reads the K-contiguous
    A row that starts at ``a_cols`` [1, BLOCK_N]."""
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + k[None, :]
    a_ptrs = a_cols + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot(xt, at.to(xt.dtype))
        x_ptrs += BLOCK_K * SPLIT_K
        a_ptrs += BLOCK_K * SPLIT_K
    acc *= scale
    out_mask = row_ok[:, None] & col_ok[None, :]  # columns past the rank stay zero
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


@triton.jit
def _shrink_rows(x_ptr, a_ptr, rank, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr, lora, pid_m, sl,
                 pid_k, K, stride_xt, stride_bs, stride_bt,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """One program's work: token block ``pid_m`` of slot ``lora``, slice ``sl``, K split ``pid_k`` (rank > 0)."""
    tok, row_ok = segment_rows(order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    a_cols = a_ptr + r[None, :].to(tl.int64) * K  # A [rank, K] row-major
    _shrink_product(x_ptr, a_cols, r < rank, tok, row_ok, tl.load(scaling_ptr + lora).to(tl.float32),
                    buf_ptr + sl * stride_bs + tok[:, None] * stride_bt + r[None, :], pid_k, K, stride_xt, BLOCK_M,
                    BLOCK_R, BLOCK_K, SPLIT_K, EVEN_K)


@triton.jit
def _shrink_slices(x_ptr, entries_ptr, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr, lora, pid_m,
                   pid_k, K, stride_xt, stride_el, stride_es, stride_bs, stride_bt, W_DTYPE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   EVEN_K: tl.constexpr, NUM_S: tl.constexpr, S_TILE: tl.constexpr):
    """FUSE_SLICES: token block ``pid_m`` of slot ``lora``, K split ``pid_k``, every slice at once: column
    n = s * BLOCK_R + r of the product is row r of slice s's A (each slice's own address and rank), so each x tile is
    loaded once for all NUM_S slices (S_TILE: NUM_S rounded up to a power of two)."""
    tok, row_ok = segment_rows(order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, BLOCK_M)
    n = tl.arange(0, S_TILE * BLOCK_R)
    sl = n // BLOCK_R
    r = n % BLOCK_R
    entry = entries_ptr + lora.to(tl.int64) * stride_el + sl * stride_es
    rank = tl.load(entry + 2, mask=sl < NUM_S, other=0).to(tl.int32)  # 0: a slice the adapter does not target
    col_ok = r < rank
    a_base = tl.multiple_of(tl.load(entry, mask=col_ok, other=0).to(tl.pointer_type(W_DTYPE)), 16)  # 16-byte aligned
    _shrink_product(x_ptr, a_base[None, :] + r[None, :].to(tl.int64) * K, col_ok, tok, row_ok,
                    tl.load(scaling_ptr + lora).to(tl.float32),
                    buf_ptr + sl[None, :] * stride_bs + tok[:, None] * stride_bt + r[None, :], pid_k, K, stride_xt,
                    BLOCK_M, S_TILE * BLOCK_R, BLOCK_K, SPLIT_K, EVEN_K)


@cached_launch
@triton.jit(do_not_specialize=["L"])
def _lora_shrink_kernel(
    x_ptr, entries_ptr, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr,
    # x [T, K]; entries [L, S, 3] (A address, B address, rank); buf [S, T, R] fp32; order [T] tokens sorted by
    # slot; seg_* [L]; scaling [>= L]
    K, L,
    stride_xt, stride_el, stride_es, stride_bs, stride_bt,
    W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_L: tl.constexpr, NUM_S: tl.constexpr = 1,
    S_TILE: tl.constexpr = 0,
):
    lora, pid_m, past = slot_block(tl.program_id(0), seg_len_ptr, L, BLOCK_M, BLOCK_L, False)
    pid_z = tl.program_id(1)
    if past:  # past the token blocks the slots use
        return
    if S_TILE:  # FUSE_SLICES: the grid's second dim is the K split alone
        _shrink_slices(x_ptr, entries_ptr, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr, lora, pid_m,
                       pid_z, K, stride_xt, stride_el, stride_es, stride_bs, stride_bt, W_DTYPE, BLOCK_M, BLOCK_R,
                       BLOCK_K, SPLIT_K, EVEN_K, NUM_S, S_TILE)
        return
    sl = pid_z // SPLIT_K
    a_ptr, rank = weight_entry(entries_ptr, lora, sl, stride_el, stride_es, 0, W_DTYPE)
    if rank == 0:  # this slot's adapter does not target the slice: its rows stay zero
        return
    _shrink_rows(x_ptr, a_ptr, rank, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr, lora, pid_m, sl,
                 pid_z % SPLIT_K, K, stride_xt, stride_bs, stride_bt, BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, EVEN_K)


@cached_launch
@triton.jit(do_not_specialize=["L"])
def _lora_shrink_compact_kernel(
    x_ptr, entries_ptr, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr,  # as _lora_shrink_kernel
    K, L,
    stride_xt, stride_el, stride_es, stride_bs, stride_bt,
    W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_L: tl.constexpr, NUM_Z: tl.constexpr,
):
    """COMPACT: a 1-D grid smaller than the worst case walks the used work items w = (flat block, slice, split),
    w = pid, pid + grid, ...; one scan of the segment lengths per program, programs past the work leave at once."""
    blocks, ends, lv = used_blocks(seg_len_ptr, L, BLOCK_M, BLOCK_L, False)
    for w in range(tl.program_id(0), tl.sum(blocks, 0) * NUM_Z, tl.num_programs(0)):
        lora, pid_m = block_at(w // NUM_Z, blocks, ends, lv)
        pid_z = w % NUM_Z
        sl = pid_z // SPLIT_K
        a_ptr, rank = weight_entry(entries_ptr, lora, sl, stride_el, stride_es, 0, W_DTYPE)
        if rank > 0:  # a slice the slot's adapter does not target keeps its rows zero
            _shrink_rows(x_ptr, a_ptr, rank, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr, lora,
                         pid_m, sl, pid_z % SPLIT_K, K, stride_xt, stride_bs, stride_bt, BLOCK_M, BLOCK_R, BLOCK_K,
                         SPLIT_K, EVEN_K)


def lora_segments(token_lora_idx: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens grouped by adapter slot, on the device: (order [T] int32, seg_start [L] int32, seg_len [L] int32).

    Slot l's tokens are order[seg_start[l] : seg_start[l] + seg_len[l]] in token order; tokens without an
    adapter (-1) are in no segment. One small Triton launch (moe_align's counting sort; no radix sort).
    The engine should compute it once per step and pass it to every layer's shrink and expand (``segments=``).
    """
    from loraplex.kernels.moe_align import group_by_slot

    return group_by_slot(token_lora_idx, max_loras)


def shape_of(x: torch.Tensor, lora_a) -> dict[str, int]:
    """Tuning-file shape key dims (S slices, R the table's max rank, K in features)."""
    table = as_table(lora_a, which="a")
    return {"S": table.num_slices, "R": table.max_rank, "K": table.in_features}


def block_r(max_rank: int) -> int:
    """The rank tile: the table's max rank, a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(max_rank))


def lora_shrink(x: torch.Tensor, lora_a: LoRATable | torch.Tensor, token_lora_idx: torch.Tensor,
                scaling: torch.Tensor, *, config: dict | None = None,
                segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same contract as ``reference_lora.lora_shrink``; ``config`` overrides the tuned config (the tuner),
    ``segments`` reuses a ``lora_segments`` result of the step."""
    table = as_table(lora_a, which="a")
    table.check()
    num_tokens, in_features = x.shape
    num_slices, max_loras, rank = table.num_slices, table.num_slots, table.max_rank
    if table.in_features != in_features:
        raise ValueError(f"lora_a has K={table.in_features} but x has {in_features} features")
    if token_lora_idx.shape != (num_tokens,) or scaling.dim() != 1 or scaling.shape[0] < max_loras:
        raise ValueError(f"token_lora_idx must be [T={num_tokens}] and scaling [>= L={max_loras}], got "
                         f"{tuple(token_lora_idx.shape)} and {tuple(scaling.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or tuning.get_config("lora_shrink", shape_of(x, table), num_tokens, default_config(in_features))
    split_k = int(cfg["SPLIT_K"])
    buf = torch.zeros(num_slices, num_tokens, rank, dtype=torch.float32, device=x.device)  # unwritten rows: 0
    if num_tokens == 0:
        return buf
    order, seg_start, seg_len = segments or lora_segments(token_lora_idx, max_loras)
    block_m, block_k = int(cfg["BLOCK_M"]), int(cfg["BLOCK_K"])
    ent = table.entries
    num_flat, num_z = flat_blocks(num_tokens, max_loras, block_m), num_slices * split_k
    compact = int(cfg.get("COMPACT", 0))
    fuse = int(cfg.get("FUSE_SLICES", 0))
    if fuse and compact:
        raise ValueError("lora_shrink config: FUSE_SLICES and COMPACT cannot be combined")
    kernel, grid, extra = _lora_shrink_kernel, (num_flat, num_z), {}
    if fuse:  # every slice of a token block in one program (module docstring)
        grid, extra = (num_flat, split_k), {"NUM_S": num_slices, "S_TILE": next_power_of_2(num_slices)}
    if compact:  # a smaller 1-D grid walking the used work (module docstring)
        kernel, grid, extra = _lora_shrink_compact_kernel, (cdiv(num_flat, compact) * num_z,), {"NUM_Z": num_z}
    kernel[grid](
        x, ent, buf, order, seg_start, seg_len, scaling, in_features, max_loras,
        x.stride(0), ent.stride(0), ent.stride(1), buf.stride(0), buf.stride(1),
        W_DTYPE=tl_dtype(table.dtype), BLOCK_M=block_m, BLOCK_R=block_r(rank), BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_K=in_features % (block_k * split_k) == 0, BLOCK_L=next_power_of_2(max_loras),
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]), **extra,
    )
    return buf
