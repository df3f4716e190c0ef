"""Expert LoRA in Triton (gate_up or down): shrink and expand over pairs aligned by (adapter slot, expert).

    moe_align_lora ─> shrink: buf[p] = scaling[l] * A[l][e] @ x_row(p)      grid (flat blocks, SPLIT_K)
                   └> expand: y[p] += w(p) * B[l][e] @ buf[p]  (fused add)   grid (flat blocks x column groups)
    FUSED=1 (small M): one kernel, grid (flat blocks x column blocks); each program recomputes its rows'
                   rank-R h = scaling * A[l, e] @ x_row in registers (A re-read from L2 per column block),
                   then adds w(p) * B-tile @ h into y: one launch instead of two, no buffer.

Each slot's factors are read at its own rank r through the ``LoRATable`` (A [E, r, K] and B stored as B^T
[E, r, N]: address and rank per slot); a slot whose adapter does not target this module has rank 0 and its programs leave at once.

A slot's table holds only pairs of tokens using it; the grid's block dimension runs over the blocks all slots
use together (``slot_blocks``: each program finds its slot and block from num_tokens_post_pad), so tokens
without an adapter and idle slots launch nothing and the few programs past the used blocks exit at once.
Expand's program covers COLS column blocks of BLOCK_N (config key "COLS", default 1): the slot search, the
alignment rows and h are read once for them, and each next B tile is loaded before the current y tile is written,
so a decode step's few-row blocks keep more bytes in flight per program.

Split-K shrink writes one partial buffer per split that expand sums (decode: saves the zeroing launch), or, for
many pairs, adds into one zeroed buffer with relaxed atomics. Each pair has exactly one slot, so expand's
read-add-write of y needs no atomics. gate_up reads the token's row (x [T, K], pair p -> token p // A); down
reads the pair's own row (x [T*A, K]).

PDL=1 (sm_90+, see ``slot_blocks.pdl_enabled``): shrink and expand (or the fused kernel) are launched with
programmatic dependent launch. Expand starts while shrink runs and loads its B tile (weights) and alignment
rows (written by moe_align_lora, at least two kernels back) before ``pdl_wait``; it reads buf, y and the
routing weights only after it. Shrink and the fused kernel wait first, then trigger. Config keys "FUSED" and
"PDL" are chosen per M by ``loraplex tune``; the default is two plain launches.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.dot import dot
from loraplex.kernels.fused_moe import _grouped_pid
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.lora_shrink import block_r
from loraplex.kernels.lora_table import LoRATable
from loraplex.kernels.moe_align import moe_align_lora
from loraplex.kernels.reference_lora import expert_table
from loraplex.kernels.slot_blocks import (flat_blocks, pdl_enabled, pdl_launch, pdl_trigger, pdl_wait, slot_block,
                                          tl_dtype, weight_entry)
from loraplex.kernels.launch import cached_launch

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 1, "num_warps": 4,
                  "num_stages": 2, "FUSED": 0, "PDL": 0, "COLS": 1}


def default_config(k: int) -> dict:
    """DEFAULT_CONFIG with split-K sized for K and a wider N tile (used when the tuning file has no entry for the
    shape): the shrink has few programs per (slot, expert) block, so it needs split-K the way lora_shrink does."""
    from loraplex.kernels.lora_shrink import split_k_for

    cfg = dict(DEFAULT_CONFIG)
    cfg["SPLIT_K"] = split_k_for(k, cfg["BLOCK_K"])
    if cfg["SPLIT_K"] > 1:
        cfg.update(BLOCK_N=128, num_stages=3)
    return cfg


# Split-K partial sums go to SPLIT_K separate buffers that expand adds up (no zeroing launch, no atomics) while
# they stay this small (pairs x SPLIT_K rows, 128 B each at R = 32); past it, relaxed atomics into one zeroed
# buffer, so a long prefill does not read SPLIT_K times the rows in expand.
PARTIALS_MAX_ROWS = 16384


@triton.jit
def _shrink_rows(x_ptr, a_ptr, rows, row_ok, pid_k, K, R, stride_xt, stride_ar,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """[BLOCK_M, BLOCK_R] fp32: rows x[rows] @ A.T over split pid_k's share of K (a_ptr: this (slot, expert)'s A)."""
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xt + k[None, :]
    a_ptrs = a_ptr + r[None, :] * stride_ar + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = k0 + tl.arange(0, BLOCK_K) < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot(xt, at.to(xt.dtype))
        x_ptrs += BLOCK_K * SPLIT_K
        a_ptrs += BLOCK_K * SPLIT_K
    return acc


@triton.jit
def _slot_rows(lora, pid_m, sorted_ptr, expert_ids_ptr, num_pairs, capacity, num_blocks, BLOCK_M: tl.constexpr):
    """(expert int64, pairs [BLOCK_M], row_ok) of row block pid_m of step slot ``lora`` in the per-slot alignment
    tables (``moe_align_lora``: slot ``lora``'s rows at ``lora * capacity``, its experts at ``lora * num_blocks``)."""
    lora64 = lora.to(tl.int64)
    expert = tl.load(expert_ids_ptr + lora64 * num_blocks + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + lora64 * capacity + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit
def _add_delta(y_ptr, h, b, weights_ptr, pairs64, row_ok, cols, col_ok, stride_yt, HAS_WEIGHTS: tl.constexpr):
    """y[pairs, cols] += w(pair) * h @ b  (h [BLOCK_M, BLOCK_R] fp32, b [BLOCK_R, BLOCK_N])."""
    delta = dot(h.to(b.dtype), b)
    if HAS_WEIGHTS:
        delta *= tl.load(weights_ptr + pairs64, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pairs64[:, None] * stride_yt + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks", "L"])
def _moe_lora_shrink_kernel(
    x_ptr, entries_ptr, buf_ptr, scaling_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # x [T or T*A, K]; entries [L, 1, 3] (A [E, r, K] address, B address, r); buf [SPLIT_K or 1, T*A, R] fp32;
    # scaling [>= L]; tables [L, *]
    num_pairs, capacity, num_blocks, K, R, L,
    stride_xt, stride_el, stride_split,
    ROW_DIV: tl.constexpr,  # A for gate_up (token rows), 1 for down (pair rows)
    W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_L: tl.constexpr, PARTIALS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # the tables and x come from the kernels just before
    pdl_trigger(USE_PDL)  # expand may start: it waits for this grid before reading buf
    lora, pid_m, past = slot_block(tl.program_id(0), num_post_ptr, L, BLOCK_M, BLOCK_L, True)
    pid_k = tl.program_id(1)
    if past:  # past the blocks the slots use
        return
    a_ptr, rank = weight_entry(entries_ptr, lora, 0, stride_el, 0, 0, W_DTYPE)
    if rank == 0:  # the slot's adapter does not target these experts
        return
    expert, pairs, row_ok = _slot_rows(lora, pid_m, sorted_ptr, expert_ids_ptr, num_pairs, capacity, num_blocks,
                                       BLOCK_M)
    rows = (pairs // ROW_DIV).to(tl.int64)
    acc = _shrink_rows(x_ptr, a_ptr + expert * rank * K, rows, row_ok, pid_k, K, rank, stride_xt, K,
                       BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, EVEN_K)
    acc *= tl.load(scaling_ptr + lora).to(tl.float32)
    r = tl.arange(0, BLOCK_R)
    out_ptrs = buf_ptr + pairs.to(tl.int64)[:, None] * R + r[None, :]
    mask = row_ok[:, None] & (r < R)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    elif PARTIALS:  # this split's own buffer (written even when its K range is empty)
        tl.store(out_ptrs + pid_k * stride_split, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks", "num_flat", "L"])
def _moe_lora_expand_kernel(
    y_ptr, buf_ptr, entries_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # y [T*A, N]; buf [NUM_PARTS, T*A, R] fp32; entries [L, 1, 3] (A address, B^T [E, r, N] address, r);
    # topk_weights [T*A]; tables [L, *]
    num_pairs, capacity, num_blocks, num_flat, N, R, L,
    stride_yt, stride_el, stride_split,
    W_DTYPE: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_G: tl.constexpr, COLS: tl.constexpr, BLOCK_L: tl.constexpr, NUM_PARTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # NUM_G column groups of COLS column blocks each: a program adds its row block's delta over COLS * BLOCK_N
    # columns, so the slot search, the alignment rows and h (the split-K sum) are read once for all of them
    # ---- before pdl_wait: only the alignment tables (made before shrink), the LoRA table and the weights
    flat, pid_g = _grouped_pid(tl.program_id(0), num_flat, NUM_G, GROUP_M)
    lora, pid_m, past = slot_block(flat, num_post_ptr, L, BLOCK_M, BLOCK_L, True)
    if past:
        return
    b_ptr, rank = weight_entry(entries_ptr, lora, 0, stride_el, 0, 1, W_DTYPE)
    if rank == 0:  # the slot's adapter does not target these experts
        return
    expert, pairs, row_ok = _slot_rows(lora, pid_m, sorted_ptr, expert_ids_ptr, num_pairs, capacity, num_blocks,
                                       BLOCK_M)
    pairs64 = pairs.to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    b_rows = b_ptr + (expert * rank + r[:, None]) * N  # B stored as B^T [E, r, N]
    cols = pid_g * (COLS * BLOCK_N) + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(b_rows + cols[None, :], mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    # ---- after: shrink's buf, the base output y, the routing weights
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    h_ptrs = buf_ptr + pairs64[:, None] * R + r[None, :]
    h_ok = row_ok[:, None] & (r < R)[None, :]  # shrink wrote zeros past the slot's rank: the buffer's width masks
    h = tl.load(h_ptrs, mask=h_ok, other=0.0)
    for part in range(1, NUM_PARTS):  # split-K partial sums
        h += tl.load(h_ptrs + part * stride_split, mask=h_ok, other=0.0)
    for j in tl.static_range(COLS):  # unrolled; the next B tile is loaded before this one's y is written
        if j + 1 < COLS:
            nxt = cols + BLOCK_N
            nxt_ok = nxt < N
            b_nxt = tl.load(b_rows + nxt[None, :], mask=r_ok[:, None] & nxt_ok[None, :], other=0.0)
        _add_delta(y_ptr, h, b, weights_ptr, pairs64, row_ok, cols, col_ok, stride_yt, HAS_WEIGHTS)
        if j + 1 < COLS:
            b, cols, col_ok = b_nxt, nxt, nxt_ok


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks", "num_flat", "L"])
def _moe_lora_fused_kernel(
    y_ptr, x_ptr, entries_ptr, scaling_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # y [T*A, N]; x [T or T*A, K]; entries [L, 1, 3] (A [E, r, K] address, B^T [E, r, N] address, r);
    # scaling [>= L]; topk_weights [T*A]
    num_pairs, capacity, num_blocks, num_flat, K, N, L,
    stride_xt, stride_yt, stride_el,
    W_DTYPE: tl.constexpr, ROW_DIV: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_N: tl.constexpr, BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    # GROUP_M = 1 runs a row block's column blocks back to back (its A stays hot in L2)
    flat, pid_n = _grouped_pid(tl.program_id(0), num_flat, NUM_N, GROUP_M)
    lora, pid_m, past = slot_block(flat, num_post_ptr, L, BLOCK_M, BLOCK_L, True)
    if past:
        return
    a_ptr, rank = weight_entry(entries_ptr, lora, 0, stride_el, 0, 0, W_DTYPE)
    b_ptr, _ = weight_entry(entries_ptr, lora, 0, stride_el, 0, 1, W_DTYPE)
    if rank == 0:  # the slot's adapter does not target these experts
        return
    expert, pairs, row_ok = _slot_rows(lora, pid_m, sorted_ptr, expert_ids_ptr, num_pairs, capacity, num_blocks,
                                       BLOCK_M)
    pairs64 = pairs.to(tl.int64)
    # ---- shrink of this row block, whole K, in registers (A [E, r, K])
    h = _shrink_rows(x_ptr, a_ptr + expert * rank * K, (pairs // ROW_DIV).to(tl.int64), row_ok, 0, K, rank,
                     stride_xt, K, BLOCK_M, BLOCK_R, BLOCK_K, 1, EVEN_K)
    h *= tl.load(scaling_ptr + lora).to(tl.float32)
    # ---- expand of one column block (B stored as B^T [E, r, N])
    r = tl.arange(0, BLOCK_R)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(b_ptr + (expert * rank + r[:, None]) * N + cols[None, :],
                mask=(r < rank)[:, None] & col_ok[None, :], other=0.0)
    _add_delta(y_ptr, h, b, weights_ptr, pairs64, row_ok, cols, col_ok, stride_yt, HAS_WEIGHTS)


def shape_of(y: torch.Tensor, x: torch.Tensor, lora_a, topk_ids: torch.Tensor) -> dict[str, int]:
    """Tuning-file shape key dims (R the table's max rank)."""
    table = expert_table(lora_a, None) if isinstance(lora_a, LoRATable) else None
    if table is None:  # a stacked lora_a [L, E, R, K]
        _, num_experts, rank, k = lora_a.shape
    else:
        num_experts, rank, k = table.num_experts, table.max_rank, table.in_features
    return {"E": num_experts, "A": topk_ids.shape[1], "R": rank, "K": k, "N": y.shape[1]}


def _prepare(table: LoRATable, y_width: int, x: torch.Tensor, topk_ids: torch.Tensor, scaling: torch.Tensor,
             y: torch.Tensor | None = None) -> None:
    """The checks ``fused_moe_lora`` and ``moe_lora_shrink`` share (``y_width``: the output's N)."""
    table.check()
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if table.out_features != (y_width,) or (y is not None and y.shape[0] != num_pairs):
        raise ValueError(f"y must be [T*A={num_pairs}, N] with N = the LoRA B width {table.out_features[0]}; got y "
                         f"{tuple(y.shape) if y is not None else (num_pairs, y_width)}")
    if x.shape[0] not in (num_tokens, num_pairs) or x.shape[1] != table.in_features:
        raise ValueError(f"x must be [T, K] (gate_up) or [T*A, K] (down) with K={table.in_features}, got "
                         f"{tuple(x.shape)}")
    for name, t in (("x", x), ("y", y)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if scaling.dim() != 1 or scaling.shape[0] < table.num_slots:
        raise ValueError(f"scaling must be [>= L={table.num_slots}], got {tuple(scaling.shape)}")


def _align_for(table: LoRATable, topk_ids, token_lora_idx, bm: int, align):
    sorted_ids, expert_ids, num_post = align or moe_align_lora(topk_ids, token_lora_idx, table.num_experts,
                                                               table.num_slots, bm)
    if sorted_ids.shape[1] != expert_ids.shape[1] * bm:
        raise ValueError(f"align tables were made with block size {sorted_ids.shape[1] // max(expert_ids.shape[1], 1)}"
                         f" but the config's BLOCK_M is {bm}; call moe_align_lora with block_size={bm}")
    return sorted_ids, expert_ids, num_post


class _Plan(NamedTuple):
    """What a call's config and shapes decide (``_plan``): grids and keyword arguments of the kernels it launches."""
    fused: bool
    num_flat: int         # row blocks all slots use together (the grids' block dimension)
    fused_grid: tuple
    fused_kw: dict
    buf_shape: tuple      # [parts, T*A, R] float32 split-K partial sums (or parts 1)
    zeroed: bool          # atomics: the buffer starts at zero
    shrink_grid: tuple
    shrink_kw: dict
    expand_grid: tuple
    expand_kw: dict


@tuning.plan_cache
def _plan(cfg: dict, *, num_tokens, top_k, x_rows, num_loras, num_experts, rank, k, n, num_blocks, dtype,
          has_weights, pdl_ok) -> _Plan:
    """The launches of one call (``tuning.plan_cache``: remembered per config and shapes; read the plan only)."""
    num_pairs = num_tokens * top_k
    bm, bn, bk, split_k = (int(cfg[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
    fused = bool(int(cfg.get("FUSED", 0)))
    pdl = bool(int(cfg.get("PDL", 0))) and pdl_ok
    launch = dict(num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))
    row_div = top_k if x_rows == num_tokens and top_k > 1 else 1  # gate_up reads token rows, down pair rows
    w_dtype, rank_tile, block_l = tl_dtype(dtype), block_r(rank), next_power_of_2(num_loras)
    # blocks all slots use together: every (slot, expert) group pads at most bm - 1 rows
    num_flat = min(flat_blocks(num_pairs, num_loras, bm, num_experts), num_loras * num_blocks)
    num_n = cdiv(n, bn)
    fused_kw = dict(W_DTYPE=w_dtype, ROW_DIV=row_div, HAS_WEIGHTS=has_weights, BLOCK_M=bm, BLOCK_N=bn,
                    BLOCK_R=rank_tile, BLOCK_K=bk, EVEN_K=k % bk == 0, GROUP_M=int(cfg["GROUP_M"]), NUM_N=num_n,
                    BLOCK_L=block_l, USE_PDL=pdl, **launch, **pdl_launch(pdl))
    # split-K: one buffer per split while small, else relaxed atomics into one zeroed buffer
    partials = split_k > 1 and num_pairs * split_k <= PARTIALS_MAX_ROWS
    zeroed = split_k > 1 and not partials
    shrink_pdl = pdl and not zeroed  # right after the zeroing memset (atomics, prefill sizes): a plain launch
    shrink_kw = dict(ROW_DIV=row_div, W_DTYPE=w_dtype, BLOCK_M=bm, BLOCK_R=rank_tile, BLOCK_K=bk, SPLIT_K=split_k,
                     EVEN_K=k % (bk * split_k) == 0, BLOCK_L=block_l, PARTIALS=partials, USE_PDL=shrink_pdl,
                     **launch, **pdl_launch(shrink_pdl))
    buf_shape = (split_k if partials else 1, num_pairs, rank)
    cols = max(1, min(int(cfg.get("COLS", 1)), num_n))
    num_g = cdiv(num_n, cols)
    expand_kw = dict(W_DTYPE=w_dtype, HAS_WEIGHTS=has_weights, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=rank_tile,
                     GROUP_M=int(cfg["GROUP_M"]), NUM_G=num_g, COLS=cols, BLOCK_L=block_l, NUM_PARTS=buf_shape[0],
                     USE_PDL=pdl, **launch, **pdl_launch(pdl))
    return _Plan(fused, num_flat, (num_flat * num_n,), fused_kw, buf_shape, zeroed, (num_flat, split_k), shrink_kw,
                 (num_flat * num_g,), expand_kw)


def _plan_for(cfg: dict, table: LoRATable, x: torch.Tensor, topk_ids: torch.Tensor, n: int, tables,
              has_weights: bool) -> _Plan:
    num_tokens, top_k = topk_ids.shape
    return _plan(cfg, num_tokens=num_tokens, top_k=top_k, x_rows=x.shape[0], num_loras=table.num_slots,
                 num_experts=table.num_experts, rank=table.max_rank, k=table.in_features, n=n,
                 num_blocks=tables[1].shape[1], dtype=table.dtype, has_weights=has_weights,
                 pdl_ok=pdl_enabled(x.device))


def _shrink(x, table: LoRATable, scaling, tables, plan: _Plan) -> torch.Tensor:
    """Launch the shrink: h = scaling[l] * A[l][e] @ x_row(p) per routed pair, as [parts, T*A, R] float32 (split-K
    partial sums to add up, or parts 1)."""
    sorted_ids, expert_ids, num_post = tables
    alloc = torch.zeros if plan.zeroed else torch.empty  # every partial row a program reads is written
    buf = alloc(plan.buf_shape, dtype=torch.float32, device=x.device)
    _moe_lora_shrink_kernel[plan.shrink_grid](
        x, table.entries, buf, scaling, sorted_ids, expert_ids, num_post, buf.shape[1], sorted_ids.shape[1],
        expert_ids.shape[1], table.in_features, table.max_rank, table.num_slots, x.stride(0), table.entries.stride(0),
        buf.stride(0), **plan.shrink_kw)
    return buf


def moe_lora_shrink(x: torch.Tensor, lora_a, topk_ids: torch.Tensor, token_lora_idx: torch.Tensor,
                    scaling: torch.Tensor, *, out_features: int, config: dict,
                    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The shrink half of ``fused_moe_lora`` alone, for a GEMM that adds the expand in its epilogue
    (``fused_moe_mxfp4``'s decode path): [parts, T*A, R] float32, row p = scaling[l] * A[l][e] @ x_row(p) for the
    pair's slot l and expert e (rows of pairs without an adapter unwritten), split-K partials to be summed over
    parts. ``config``: the LoRA config (BLOCK_M, BLOCK_K, SPLIT_K, num_warps, num_stages, PDL)."""
    table = expert_table(lora_a, None)
    _prepare(table, out_features, x, topk_ids, scaling)
    tables = _align_for(table, topk_ids, token_lora_idx, int(config["BLOCK_M"]), align)
    plan = _plan_for(config, table, x, topk_ids, out_features, tables, False)
    return _shrink(x, table, scaling, tables, plan)


def moe_lora_expand(y: torch.Tensor, x: torch.Tensor, buf: torch.Tensor, lora, topk_ids: torch.Tensor,
                    token_lora_idx: torch.Tensor, scaling: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
                    config: dict, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """The expand half of ``fused_moe_lora`` (in place): y[p] += w(p) * B[l][e] @ buf[p] for ``buf``, the rows
    ``moe_lora_shrink`` made from ``x`` with the same ``config`` and alignment (the shrink launched before the base
    GEMM that writes y, so that the two overlap). ``config`` must not be FUSED (one kernel: no buffer)."""
    table = expert_table(lora, None)
    _prepare(table, y.shape[1], x, topk_ids, scaling, y)
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k == 0:
        return
    tables = _align_for(table, topk_ids, token_lora_idx, int(config["BLOCK_M"]), align)
    plan = _plan_for(config, table, x, topk_ids, y.shape[1], tables, topk_weights is not None)
    if plan.fused:
        raise ValueError("a FUSED config runs shrink and expand in one kernel: call fused_moe_lora")
    if tuple(buf.shape) != plan.buf_shape or buf.dtype != torch.float32:
        raise ValueError(f"buf must be the float32 {plan.buf_shape} rows moe_lora_shrink made with this config, got "
                         f"{buf.dtype} {tuple(buf.shape)}")
    sorted_ids, expert_ids, num_post = tables
    weights = topk_weights.reshape(-1).contiguous() if topk_weights is not None else scaling
    _moe_lora_expand_kernel[plan.expand_grid](
        y, buf, table.entries, weights, sorted_ids, expert_ids, num_post, num_tokens * top_k, sorted_ids.shape[1],
        expert_ids.shape[1], plan.num_flat, y.shape[1], table.max_rank, table.num_slots, y.stride(0),
        table.entries.stride(0), buf.stride(0), **plan.expand_kw)


def fused_moe_lora(y: torch.Tensor, x: torch.Tensor, lora_a, lora_b, topk_ids: torch.Tensor,
                   token_lora_idx: torch.Tensor, scaling: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
                   config: dict | None = None,
                   align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Same contract as ``reference_lora.fused_moe_lora`` (in place). ``align`` reuses a ``moe_align_lora``
    result made with the same BLOCK_M (the engine aligns once per layer for gate_up and down)."""
    table = expert_table(lora_a, lora_b)
    _prepare(table, y.shape[1], x, topk_ids, scaling, y)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    num_loras, rank, k = table.num_slots, table.max_rank, table.in_features
    n = y.shape[1]
    if num_pairs == 0:
        return
    cfg = config or tuning.get_config("fused_moe_lora", shape_of(y, x, table, topk_ids), num_tokens,
                                      default_config(k))
    sorted_ids, expert_ids, num_post = tables = _align_for(table, topk_ids, token_lora_idx, int(cfg["BLOCK_M"]),
                                                           align)
    capacity, num_blocks = sorted_ids.shape[1], expert_ids.shape[1]
    plan = _plan_for(cfg, table, x, topk_ids, n, tables, topk_weights is not None)
    ent = table.entries
    # [T*A] routing weights made before any launch here (a copy must not sit between shrink and expand)
    weights = topk_weights.reshape(-1).contiguous() if topk_weights is not None else scaling
    if plan.fused:  # one kernel: no buffer, SPLIT_K unused
        _moe_lora_fused_kernel[plan.fused_grid](
            y, x, ent, scaling, weights, sorted_ids, expert_ids, num_post, num_pairs, capacity,
            num_blocks, plan.num_flat, k, n, num_loras, x.stride(0), y.stride(0), ent.stride(0), **plan.fused_kw)
        return
    buf = _shrink(x, table, scaling, tables, plan)
    _moe_lora_expand_kernel[plan.expand_grid](
        y, buf, ent, weights, sorted_ids, expert_ids, num_post, num_pairs, capacity, num_blocks, plan.num_flat, n,
        rank, num_loras, y.stride(0), ent.stride(0), buf.stride(0), **plan.expand_kw)
