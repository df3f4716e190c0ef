"""Expert LoRA added in the base expert GEMM's epilogue: no separate expand, no read-modify-write of the output.

    shrink (fused_moe_lora.shrink) ─> buf [parts, T*A, R] fp32: scaling * A[slot][expert] @ x_row, per pair
    base GEMM tile acc [BLOCK_M, BLOCK_N] fp32 (+ INT8 scale, + bias)
       for each distinct slot s among the tile's rows (a loop, ascending):
           acc += where(row's slot == s, h, 0) @ B^T[s][expert][:, cols]
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
from loraplex.kernels.slot_blocks import tl_dtype, weight_entry

_NONE = tl.constexpr(1 << 30)  # larger than any slot: "no slot left"


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
                    LORA_PARTS=self.buf.shape[0])


def no_lora_args(t: torch.Tensor) -> tuple:
    """Placeholders for ``EpilogueLoRA.args`` when the GEMM has no LoRA (never read)."""
    return t, t, t, 1, 0, 0


NO_LORA_CONSTEXPRS = dict(HAS_LORA=False, LORA_DTYPE=tl.bfloat16, BLOCK_R=16, LORA_PARTS=1)


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
def _b_tiles(entries_ptr, stride_el, slot, expert, cols, col_ok, N_B, second, TWO: tl.constexpr,
             LORA_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr):
    """B^T[slot][expert][:, cols] (and [:, second + cols] if TWO) [BLOCK_R, BLOCK_N]; zeros past the slot's rank
    and for slot _NONE."""
    valid = slot < _NONE
    b_ptr, rank = weight_entry(entries_ptr, tl.where(valid, slot, 0), 0, stride_el, 0, 1, LORA_DTYPE)
    rank = tl.where(valid, rank, 0)
    r = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + (expert * rank + r[:, None]) * N_B
    ok = (r < rank)[:, None] & col_ok[None, :]
    b = tl.load(b_rows + cols[None, :], mask=ok, other=0.0)
    if TWO:
        b2 = tl.load(b_rows + second + cols[None, :], mask=ok, other=0.0)
    else:
        b2 = b
    return b, b2


@triton.jit
def add_lora(acc, acc2, slots, h, entries_ptr, stride_el, expert, cols, col_ok, N_B, second,
             TWO: tl.constexpr, LORA_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr):
    """(acc + the tile's delta at columns ``cols``, acc2 + the delta at ``second + cols`` if TWO) for B^T
    [E, r, N_B] of each distinct slot among the rows (gate_up: second = I, the up half). Slots ascending; the next
    slot's B tiles are loaded before this slot's product, so the loads of consecutive slots overlap."""
    cur = tl.min(tl.where(slots >= 0, slots, _NONE), 0)
    b, b2 = _b_tiles(entries_ptr, stride_el, cur, expert, cols, col_ok, N_B, second, TWO, LORA_DTYPE, BLOCK_R)
    while cur < _NONE:
        nxt = tl.min(tl.where(slots > cur, slots, _NONE), 0)
        nb, nb2 = _b_tiles(entries_ptr, stride_el, nxt, expert, cols, col_ok, N_B, second, TWO, LORA_DTYPE, BLOCK_R)
        mine = tl.where((slots == cur)[:, None], h, 0.0).to(b.dtype)
        acc += dot(mine, b)
        if TWO:
            acc2 += dot(mine, b2)
        cur, b, b2 = nxt, nb, nb2
    return acc, acc2
