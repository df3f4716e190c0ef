"""LoRA expand in Triton, with the add into the base output fused: y[t, slice s] += buf[s, t, :r] @ B[l, s].T.

Grid: (token blocks of all slots together x column blocks, slices); each program finds its slot from the
segment lengths (``slot_blocks``), so idle slots launch nothing. Programs are ordered in groups of GROUP_M
token blocks per column block so a B tile stays in L2 while its token blocks pass. Each token has one
adapter, so the read-add-write of y needs no atomics; programs past the used blocks or their slice's width
leave at once, and so do those of a (slot, slice) with rank 0. Each slot's B is read at its own rank through the
``LoRATable`` (stored as B^T [r, N_s]: a tile's rows are contiguous runs of columns). Up to three output slices
(q/k/v or gate/up) are passed as scalars, so no per-call host tensors.
Config "COMPACT": c > 0 launches a 1-D grid of (token blocks / c) x (column blocks of all slices together), each
program walking the used (token block, slice, column block) items with a stride of the grid (GROUP_M unused):
c times fewer idle programs at a decode graph's table, none for the columns past a narrow slice's width.
Config "PDL": 1 (sm_90+) launches it with programmatic dependent launch: the programs start while the kernel
before (the grouping, or shrink) finishes and wait for it before their first read (``slot_blocks.pdl_wait``),
which hides the launch gap at decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.dot import dot
from loraplex.kernels.fused_moe import _grouped_pid
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.lora_shrink import block_r, lora_segments
from loraplex.kernels.lora_table import LoRATable, as_table
from loraplex.kernels.reference_lora import check_slices
from loraplex.kernels.slot_blocks import (block_at, flat_blocks, pdl_enabled, pdl_launch, pdl_trigger, pdl_wait,
                                          segment_rows, slot_block, tl_dtype, used_blocks, weight_entry)
from loraplex.kernels.launch import cached_launch

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2, "PDL": 0}
MAX_SLICES = 3


@triton.jit
def _expand_rows(y_ptr, buf_ptr, b_ptr, rank, order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, pid_n, sl,
                 R, offset, width, stride_yt, stride_bs, stride_bt,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program's work: token block ``pid_m`` of slot ``lora`` x column block ``pid_n`` of slice ``sl``."""
    tok, row_ok = segment_rows(order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    h = tl.load(buf_ptr + sl * stride_bs + tok[:, None] * stride_bt + r[None, :],  # zeros past the rank
                mask=row_ok[:, None] & (r < R)[None, :], other=0.0)
    b = tl.load(b_ptr + r[:, None].to(tl.int64) * width + cols[None, :],  # B stored as B^T [rank, width]
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    delta = dot(h.to(b.dtype), b)  # [BLOCK_M, BLOCK_N] fp32
    # ---- fused add into the base output
    cols = offset + cols
    y_ptrs = y_ptr + tok[:, None] * stride_yt + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit(do_not_specialize=["num_flat", "L"])
def _lora_expand_kernel(
    y_ptr, buf_ptr, entries_ptr, order_ptr, seg_start_ptr, seg_len_ptr,
    # y [T, N]; buf [S, T, R] fp32; entries [L, S, 3] (A, B^T addresses, rank); order [T]; seg_start, seg_len [L]
    num_flat, R, L, OFF1, OFF2, W0, W1, W2,
    stride_yt, stride_bs, stride_bt, stride_el, stride_es,
    W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_N: tl.constexpr, BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # the segments may come from the kernel just before
    pdl_trigger(USE_PDL)
    # ---- grouped program order over (token block, column block); token blocks of all slots together
    flat, pid_n = _grouped_pid(tl.program_id(0), num_flat, NUM_N, GROUP_M)
    sl = tl.program_id(1)
    lora, pid_m, past = slot_block(flat, seg_len_ptr, L, BLOCK_M, BLOCK_L, False)
    width = tl.where(sl == 0, W0, tl.where(sl == 1, W1, W2))
    if past | (pid_n * BLOCK_N >= width):  # early exit
        return
    b_ptr, rank = weight_entry(entries_ptr, lora, sl, stride_el, stride_es, 1, W_DTYPE)
    if rank == 0:  # the slot's adapter does not target this slice
        return
    offset = tl.where(sl == 0, 0, tl.where(sl == 1, OFF1, OFF2))
    _expand_rows(y_ptr, buf_ptr, b_ptr, rank, order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, pid_n, sl, R,
                 offset, width, stride_yt, stride_bs, stride_bt, BLOCK_M, BLOCK_N, BLOCK_R)


@cached_launch
@triton.jit(do_not_specialize=["L"])
def _lora_expand_compact_kernel(
    y_ptr, buf_ptr, entries_ptr, order_ptr, seg_start_ptr, seg_len_ptr,
    R, L, OFF1, OFF2, W0, W1, W2,
    stride_yt, stride_bs, stride_bt, stride_el, stride_es,
    W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr,
):
    """COMPACT: a 1-D grid smaller than the worst case walks the used work items w = (flat block, column block
    of one slice), w = pid, pid + grid, ...; a slice has only its own column blocks (k, v narrower than q)."""
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    n0 = tl.cdiv(W0, BLOCK_N)
    n01 = n0 + tl.cdiv(W1, BLOCK_N)
    per_block = n01 + tl.cdiv(W2, BLOCK_N)
    blocks, ends, lv = used_blocks(seg_len_ptr, L, BLOCK_M, BLOCK_L, False)
    for w in range(tl.program_id(0), tl.sum(blocks, 0) * per_block, tl.num_programs(0)):
        lora, pid_m = block_at(w // per_block, blocks, ends, lv)
        c = w % per_block
        sl = (c >= n0).to(tl.int32) + (c >= n01).to(tl.int32)
        pid_n = c - tl.where(sl == 0, 0, tl.where(sl == 1, n0, n01))
        width = tl.where(sl == 0, W0, tl.where(sl == 1, W1, W2))
        offset = tl.where(sl == 0, 0, tl.where(sl == 1, OFF1, OFF2))
        b_ptr, rank = weight_entry(entries_ptr, lora, sl, stride_el, stride_es, 1, W_DTYPE)
        if rank > 0:  # the slot's adapter targets this slice
            _expand_rows(y_ptr, buf_ptr, b_ptr, rank, order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, pid_n,
                         sl, R, offset, width, stride_yt, stride_bs, stride_bt, BLOCK_M, BLOCK_N, BLOCK_R)


def shape_of(y: torch.Tensor, buf: torch.Tensor, output_slices) -> dict[str, int]:
    """Tuning-file shape key dims (N is the widest slice)."""
    return {"S": buf.shape[0], "R": buf.shape[2], "N": max(output_slices)}


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: LoRATable | torch.Tensor, token_lora_idx: torch.Tensor,
                output_slices: tuple[int, ...], *, config: dict | None = None,
                segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Same contract as ``reference_lora.lora_expand`` (in place). ``segments`` reuses ``lora_segments``."""
    table = as_table(lora_b, output_slices=output_slices, which="b")
    table.check()
    check_slices(y, buf, table, output_slices)
    if len(output_slices) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} output slices are supported, got {len(output_slices)}")
    if y.stride(-1) != 1 or not buf.is_contiguous():
        raise ValueError("y must be row-contiguous and buf [S, T, R] contiguous")
    num_tokens = y.shape[0]
    max_loras = table.num_slots
    if num_tokens == 0:
        return
    cfg = config or tuning.get_config("lora_expand", shape_of(y, buf, output_slices), num_tokens, DEFAULT_CONFIG)
    order, seg_start, seg_len = segments or lora_segments(token_lora_idx, max_loras)
    widths = list(output_slices) + [0] * (MAX_SLICES - len(output_slices))
    offsets = [0, widths[0], widths[0] + widths[1]]
    block_m, block_n = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
    num_n = cdiv(max(output_slices), block_n)
    num_flat = flat_blocks(num_tokens, max_loras, block_m)
    pdl = bool(int(cfg.get("PDL", 0))) and pdl_enabled(y.device)
    ent = table.entries
    compact = int(cfg.get("COMPACT", 0))
    if compact:
        col_blocks = sum(cdiv(w, block_n) for w in output_slices)
        _lora_expand_compact_kernel[(cdiv(num_flat, compact) * col_blocks,)](
            y, buf, ent, order, seg_start, seg_len, buf.shape[2], max_loras, offsets[1], offsets[2], *widths,
            y.stride(0), buf.stride(0), buf.stride(1), ent.stride(0), ent.stride(1),
            W_DTYPE=tl_dtype(table.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r(buf.shape[2]),
            BLOCK_L=next_power_of_2(max_loras), USE_PDL=pdl, num_warps=int(cfg["num_warps"]),
            num_stages=int(cfg["num_stages"]), **pdl_launch(pdl),
        )
        return
    _lora_expand_kernel[(num_flat * num_n, len(output_slices))](
        y, buf, ent, order, seg_start, seg_len, num_flat, buf.shape[2], max_loras, offsets[1], offsets[2], *widths,
        y.stride(0), buf.stride(0), buf.stride(1), ent.stride(0), ent.stride(1),
        W_DTYPE=tl_dtype(table.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r(buf.shape[2]),
        GROUP_M=int(cfg["GROUP_M"]), NUM_N=num_n, BLOCK_L=next_power_of_2(max_loras),
        USE_PDL=pdl, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]), **pdl_launch(pdl),
    )
