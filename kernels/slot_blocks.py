"""Programs over the row blocks that adapter slots actually use, not over slots x the worst case per slot.

At decode most slots own a block or two, so a grid dim of L slots times a per-slot worst case launches mostly
programs that leave at once (12k of them for GPT-OSS gate_up at M=16). Instead the grid runs over a static
bound of the blocks all slots use together, and program f finds its (slot, block) from the per-slot block
counts on the device: a cumsum over L values, no host sync, and the token count stays out of the binary.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_block(f, rows_ptr, L, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, ROWS_PADDED: tl.constexpr):
    """(slot, block within the slot, whether f lies past the used blocks) of flat block f.

    rows_ptr [L]: rows of each slot (a multiple of BLOCK_M if ROWS_PADDED, e.g. moe_align's
    num_tokens_post_pad; else a token count, rounded up to whole blocks here).
    """
    lv = tl.arange(0, BLOCK_L)
    rows = tl.load(rows_ptr + lv, mask=lv < L, other=0)
    if ROWS_PADDED:
        blocks = rows // BLOCK_M
    else:
        blocks = (rows + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)
    slot = tl.sum((ends <= f).to(tl.int32), 0)
    before = tl.sum(tl.where(lv < slot, blocks, 0), 0)
    return slot, f - before, f >= tl.sum(blocks, 0)


def flat_blocks(num_rows: int, num_slots: int, block_m: int, per_slot_groups: int = 1) -> int:
    """Static bound of the blocks all slots use together: ``num_rows`` rows in at most ``groups`` padded groups
    (groups = min(rows, slots x per_slot_groups)), each wasting at most block_m - 1 rows."""
    groups = min(num_rows, num_slots * per_slot_groups)
    return max(1, triton.cdiv(num_rows + groups * (block_m - 1), block_m))
