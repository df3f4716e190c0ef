"""Expert LoRA added in the base expert GEMM's epilogue: no separate expand, no read-modify-write of the output.

    shrink (fused_moe_lora.shrink) ─> buf [parts, T*A, R] fp32: scaling * A[slot][expert] @ x_row, per pair
    base GEMM tile acc [BLOCK_M, BLOCK_N] fp32 (+ INT8 scale, + bias)
       for the distinct slots among the tile's rows, LORA_CHUNK at a time:
           acc += [h in each row's slot band] @ [B^T[s][expert][:, cols] of the chunk's slots, stacked]
       then the activation (gate_up) or the routing weight (down), and the one store

A base tile holds one expert's pairs (moe_align), so its rows need B of that expert only, for each adapter slot
among them: a prefill chunk's rows share one slot (one B tile a column block), a decode tile's rows loop over a
few. Compared with ``fused_moe_lora``'s expand the output is written once: at prefill sizes the expand's read and
rewrite of [T*A, 2I] and [T*A, H] and the pre-activation round trip through memory are gone (gate_up applies the
activation itself, as without LoRA). Rows without an adapter (slot -1) and slots whose adapter does not target
the experts (rank 0) add nothing; their buffer rows (never written by the shrink) are not read into the sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.dot import dot
from loraplex.kernels.lora_shrink import block_r
from loraplex.kernels.lora_table import LoRATable
from loraplex.kernels.slot_blocks import tl_dtype

# Distinct slots a tile's epilogue handles per step: their B tiles are loaded together and multiplied in one
# product of inner size CHUNK * R (a one-slot prefill tile wastes the rest of the product; small next to the K loop)
LORA_CHUNK = 4


@dataclass(frozen=True, eq=False)
class EpilogueLoRA:
    """One expert target's LoRA for a base GEMM's epilogue: the table (B addresses and ranks per slot), the
    shrink's buffer and the token -> slot map."""

    table: LoRATable
    buf: torch.Tensor              # [parts, T*A, R] fp32 (fused_moe_lora.shrink)
    token_lora_idx: torch.Tensor   # [T] int32, -1 = no adapter

    def args(self) -> tuple:
        """Pointer and integer arguments, in the kernels' order: entries, buf, token map, R, entries' and
        buf's leading strides."""
        return (self.table.entries, self.buf, self.token_lora_idx, self.buf.shape[2], self.table.entries.stride(0),
                self.buf.stride(0))

    def constexprs(self) -> dict:
        return dict(HAS_LORA=True, LORA_DTYPE=tl_dtype(self.table.dtype), BLOCK_R=block_r(self.table.max_rank),
                    LORA_PARTS=self.buf.shape[0], LORA_CHUNK=LORA_CHUNK)


def no_lora_args(t: torch.Tensor) -> tuple:
    """Placeholders for ``EpilogueLoRA.args`` when the GEMM has no LoRA (never read)."""
    return t, t, t, 1, 0, 0


NO_LORA_CONSTEXPRS = dict(HAS_LORA=False, LORA_DTYPE=tl.bfloat16, BLOCK_R=16, LORA_PARTS=1, LORA_CHUNK=1)


def epilogue_args(lora: EpilogueLoRA | None, placeholder: torch.Tensor) -> tuple[tuple, dict]:
    """(positional args, constexprs) of the LoRA epilogue for a launch."""
    if lora is None:
        return no_lora_args(placeholder), NO_LORA_CONSTEXPRS
    return lora.args(), lora.constexprs()


@triton.jit
def lora_rows(idx_ptr, buf_ptr, entries_ptr, stride_el, tok, pairs64, row_ok, R, stride_split, BLOCK_R: tl.constexpr,
              LORA_PARTS: tl.constexpr):
    """(slot of each row [BLOCK_M] int32, -1 for none or for a slot without weights here; h [BLOCK_M, BLOCK_R] fp32:
    the shrink's rows, partials summed, zero where the slot is -1)."""
    slots = tl.load(idx_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    rank = tl.load(entries_ptr + slots.to(tl.int64) * stride_el + 2, mask=slots >= 0, other=0)
    slots = tl.where(rank > 0, slots, -1)  # the shrink left these rows unwritten
    r = tl.arange(0, BLOCK_R)
    ok = (slots >= 0)[:, None] & (r < R)[None, :]
    ptrs = buf_ptr + pairs64[:, None] * R + r[None, :]
    h = tl.load(ptrs, mask=ok, other=0.0)
    for part in range(1, LORA_PARTS):
        h += tl.load(ptrs + part * stride_split, mask=ok, other=0.0)
    return slots, h


@triton.jit
def _distinct(slots, BLOCK_M: tl.constexpr):
    """(first row of its slot [BLOCK_M], the distinct index of first rows (ascending by row), each row's distinct
    index, the number of distinct slots) of a tile's rows; rows of slot -1 count for none."""
    m = tl.arange(0, BLOCK_M)
    same = (slots[:, None] == slots[None, :]) & (slots >= 0)[:, None]
    first = (tl.sum((same & (m[None, :] < m[:, None])).to(tl.int32), 1) == 0) & (slots >= 0)
    first_idx = tl.cumsum(first.to(tl.int32), 0) - 1
    idx = tl.sum(tl.where(same & first[None, :], first_idx[None, :], 0), 1)
    return first, first_idx, idx, tl.sum(first.to(tl.int32), 0)


@triton.jit
def _stacked_b(entries_ptr, stride_el, slot, slot_ok, expert, cols, col_ok, N_B,
               LORA_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """[CHUNK * BLOCK_R, BLOCK_N]: B^T[slot][expert][:, cols] of CHUNK slots stacked along the rank (rows past a
    slot's rank, and slots not ok, zero), from one gathered load."""
    r = tl.arange(0, BLOCK_R)
    base = entries_ptr + slot.to(tl.int64) * stride_el
    rank = tl.load(base + 2, mask=slot_ok, other=0).to(tl.int32)
    b_ptr = tl.load(base + 1, mask=slot_ok, other=0).to(tl.pointer_type(LORA_DTYPE))
    rows = (expert * rank[:, None] + r[None, :]).to(tl.int64) * N_B  # [CHUNK, BLOCK_R]
    ok = (slot_ok[:, None] & (r[None, :] < rank[:, None]))[:, :, None] & col_ok[None, None, :]
    b = tl.load(b_ptr[:, None, None] + rows[:, :, None] + cols[None, None, :], mask=ok, other=0.0)
    return tl.reshape(b, (CHUNK * BLOCK_R, BLOCK_N))


@triton.jit
def add_lora(acc, acc2, slots, h, entries_ptr, stride_el, expert, cols, col_ok, N_B, second,
             TWO: tl.constexpr, LORA_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """(acc + the tile's delta at columns ``cols``, acc2 + the delta at ``second + cols`` if TWO) for B^T
    [E, r, N_B] of the slots among the rows (gate_up: second = I, the up half). The distinct slots go CHUNK at a
    time: their B tiles stacked along the rank ([CHUNK * R, BLOCK_N], one load) and each row's h placed in its
    slot's rank band ([BLOCK_M, CHUNK * R]), one product per chunk: a prefill tile (one slot) takes one step, a
    decode tile with many slots a few, and no step waits on the one before for its loads."""
    BLOCK_M: tl.constexpr = h.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    first, first_idx, idx, count = _distinct(slots, BLOCK_M)
    c = tl.arange(0, CHUNK)
    for start in range(0, count, CHUNK):
        pick = first[:, None] & (first_idx[:, None] == start + c[None, :])  # [BLOCK_M, CHUNK]
        slot = tl.sum(tl.where(pick, slots[:, None], 0), 0)  # [CHUNK]
        slot_ok = start + c < count
        band = (idx[:, None] == start + c[None, :]) & (slots >= 0)[:, None]
        hx = tl.reshape(tl.where(band[:, :, None], h[:, None, :], 0.0), (BLOCK_M, CHUNK * BLOCK_R))
        b = _stacked_b(entries_ptr, stride_el, slot, slot_ok, expert, cols, col_ok, N_B, LORA_DTYPE, BLOCK_R, CHUNK,
                       BLOCK_N)
        acc += dot(hx.to(b.dtype), b)
        if TWO:
            b2 = _stacked_b(entries_ptr, stride_el, slot, slot_ok, expert, second + cols, col_ok, N_B, LORA_DTYPE,
                            BLOCK_R, CHUNK, BLOCK_N)
            acc2 += dot(hx.to(b2.dtype), b2)
    return acc, acc2
