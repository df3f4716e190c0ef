"""Programs over the row blocks that adapter slots actually use, not over slots x the worst case per slot.

At decode most slots own a block or two, so a grid dim of L slots times a per-slot worst case launches mostly
programs that leave at once (12k of them for GPT-OSS gate_up at M=16). Instead the grid runs over a static
bound of the blocks all slots use together, and program f finds its (slot, block) from the per-slot block
counts on the device: a cumsum over L values, no host sync, and the token count stays out of the binary.

``weight_entry`` reads one (slot, slice) of a ``LoRATable`` (lora_table.py): the address of A or B and its rank.

Also shared by the launchers: programmatic dependent launch (PDL, sm_90+). A kernel launched with
``launch_pdl=True`` may start while the kernel before it in the stream is still running; ``pdl_wait`` (PTX
``griddepcontrol.wait``) blocks until that kernel finished and its writes are visible, ``pdl_trigger`` lets the
next PDL-launched kernel start. Rule kept by every kernel here: trigger only after its own wait, so a
trigger implies everything earlier in the stream is done; before its wait a kernel reads only weights and
tables written at least two kernels earlier, and writes nothing. The tuned kernels (LoRA, MXFP4 GEMMs) take PDL
from their configs; a step's small kernels (norms, rotary + KV write, paged attention, routing, alignment,
activation) from ``step_pdl``. Off (a plain launch, the constexpr branches compiled out) under
TRITON_INTERPRET, on CPUs, before sm_90 and on a Triton without ``tl.extra.cuda.gdc_wait``.
"""
from __future__ import annotations

import functools
import os

import triton
import triton.language as tl
from loraplex.kernels.intmath import cdiv

try:  # Triton >= 3.3 on NVIDIA
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover  (older Triton: PDL stays off, see pdl_enabled)
    _gdc_wait = None


@triton.jit
def used_blocks(rows_ptr, L, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, ROWS_PADDED: tl.constexpr):
    """(blocks of each slot [BLOCK_L], their running ends, the slot index vector): one scan of ``rows_ptr`` [L] (rows of
    each slot: a multiple of BLOCK_M if ROWS_PADDED, e.g. moe_align's num_tokens_post_pad; else a token count,
    rounded up to whole blocks here) that ``block_at`` reads for any number of flat blocks."""
    lv = tl.arange(0, BLOCK_L)
    rows = tl.load(rows_ptr + lv, mask=lv < L, other=0)
    if ROWS_PADDED:
        blocks = rows // BLOCK_M
    else:
        blocks = (rows + BLOCK_M - 1) // BLOCK_M
    return blocks, tl.cumsum(blocks, 0), lv


@triton.jit
def block_at(f, blocks, ends, lv):
    """(slot, block within the slot) of flat block f, from ``used_blocks``."""
    slot = tl.sum((ends <= f).to(tl.int32), 0)
    return slot, f - tl.sum(tl.where(lv < slot, blocks, 0), 0)


@triton.jit
def slot_block(f, rows_ptr, L, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, ROWS_PADDED: tl.constexpr):
    """(slot, block within the slot, whether f lies past the used blocks) of flat block f (``used_blocks``)."""
    blocks, ends, lv = used_blocks(rows_ptr, L, BLOCK_M, BLOCK_L, ROWS_PADDED)
    slot, within = block_at(f, blocks, ends, lv)
    return slot, within, f >= tl.sum(blocks, 0)


@triton.jit
def segment_rows(order_ptr, seg_start_ptr, seg_len_ptr, lora, pid_m, BLOCK_M: tl.constexpr):
    """(token ids [BLOCK_M] int64, which of them exist) of token block ``pid_m`` of slot ``lora``'s segment
    (``lora_segments``: tokens grouped by slot)."""
    count = tl.load(seg_len_ptr + lora)
    start = tl.load(seg_start_ptr + lora)
    idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = idx < count
    return tl.load(order_ptr + start + idx, mask=row_ok, other=0).to(tl.int64), row_ok


@triton.jit
def weight_entry(entries_ptr, lora, sl, stride_el, stride_es, WHICH: tl.constexpr, W_DTYPE: tl.constexpr):
    """(pointer to factor WHICH (0: A, 1: B) of step slot ``lora``, slice ``sl``; its rank, 0 = no weights) from
    a ``LoRATable``'s entries [L, S, 3] (address of A, address of B, rank)."""
    base = entries_ptr + lora.to(tl.int64) * stride_el + sl * stride_es
    rank = tl.load(base + 2).to(tl.int32)
    ptr = tl.multiple_of(tl.load(base + WHICH).to(tl.pointer_type(W_DTYPE)), 16)  # factors are 16-byte aligned
    return ptr, rank


def tl_dtype(dtype):
    """The Triton element type of a torch float dtype (a LoRATable's factors, read through addresses)."""
    import torch

    types = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in types:
        raise ValueError(f"LoRA factors must be float32, bfloat16 or float16, got {dtype}")
    return types[dtype]


def flat_blocks(num_rows: int, num_slots: int, block_m: int, per_slot_groups: int = 1) -> int:
    """Static bound of the blocks all slots use together: ``num_rows`` rows in at most ``groups`` padded groups
    (groups = min(rows, slots x per_slot_groups)), each wasting at most block_m - 1 rows."""
    groups = min(num_rows, num_slots * per_slot_groups)
    return max(1, cdiv(num_rows + groups * (block_m - 1), block_m))


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel of the stream (and its writes) when launched with PDL; nothing otherwise."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next PDL-launched kernel start (call after ``pdl_wait``); nothing without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def pdl_enabled(device) -> bool:
    """Whether a launch on ``device`` (torch.device) may use PDL: an NVIDIA device of compute capability >= 9 (a
    ROCm build's "cuda" devices report their gfx version there, and have no PDL), not the interpreter, and a Triton
    with the grid-dependency intrinsics."""
    if _gdc_wait is None or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or device.type != "cuda":
        return False
    return _sm90_or_later(device.index)


@functools.cache
def _sm90_or_later(index: int | None) -> bool:
    import torch

    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


# LORAPLEX_STEP_PDL=0 (read once, at import): the step's small kernels launch plainly (A/B timing)
STEP_PDL = os.environ.get("LORAPLEX_STEP_PDL", "1") != "0"


def step_pdl(device) -> bool:
    """Whether a step's small kernels launch with PDL: ``STEP_PDL`` and ``pdl_enabled``. Each waits before its first
    read of the step's data, so its launch, and its loads of weights, overlap the kernel before it."""
    return STEP_PDL and pdl_enabled(device)


def pdl_launch(use_pdl: bool) -> dict:
    """Launch options of a kernel launched with PDL (``{}`` otherwise, so the interpreter never sees them)."""
    return {"launch_pdl": True} if use_pdl else {}
