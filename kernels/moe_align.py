"""MoE alignment in Triton: routed pairs grouped by expert (and by adapter slot for the LoRA variant), each
group padded to the GEMM's BLOCK_M. Same contracts as ``reference_lora.moe_align`` / ``moe_align_lora``.

One launch over a grid (experts, slots), no fills before it: each program histograms its slot's pairs over
the experts (cheap at decode sizes, so every program does it rather than wait for a separate count pass),
turns the counts into padded offsets, writes its expert's block ids, pads and pairs (token order, in-block
prefix sums), and a share of the unused tail. The LoRA variant's programs of a slot no token uses (most of a
decode graph's table: it holds one slot per row of the batch) read only the token -> slot map, not the pairs,
before writing their share of the slot's (all unused) row. Buffers have the static capacity of
``moe_align_capacity``: no host sync. At decode a launch costs more than the work, so one launch instead of
five is the point. On sm_90+ a PDL launch (``slot_blocks.step_pdl``): the programs wait for the kernel before
them (in an expert layer, the routing) before they read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.reference_lora import moe_align_capacity
from loraplex.kernels.intmath import next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.slot_blocks import pdl_launch, pdl_trigger, pdl_wait, step_pdl


@triton.jit
def _align_program(
    expert, lora, ids_ptr, lora_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, counts_ptr, offsets_ptr,
    # topk_ids [T*A]; token_lora_idx [T]; sorted_ids [L, capacity]; expert_ids [L, num_blocks];
    # num_tokens_post_pad [L]; counts, offsets [L, E] (pairs per expert, start of its padded group)
    num_pairs, num_experts, capacity, num_blocks,
    TOP_K: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAD_BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two > E: bin E collects the pairs of other slots
    BLOCK: tl.constexpr,
):
    """Program (expert, slot ``lora``) of an alignment (module docstring)."""
    lora64 = lora.to(tl.int64)
    # ---- does any token use this slot? (a decode graph's table has many idle slots: they skip the histogram)
    if HAS_LORA:
        slot_tokens = 0
        for start in range(0, num_pairs // TOP_K, BLOCK):
            toks = start + tl.arange(0, BLOCK)
            slot_tokens += tl.sum((tl.load(lora_ptr + toks, mask=toks < num_pairs // TOP_K, other=-1) == lora)
                                  .to(tl.int32), 0)
        used = slot_tokens > 0
    else:
        used = True
    # ---- this slot's pairs per expert
    hist = tl.zeros([BLOCK_E], tl.int32)
    if used:
        for start in range(0, num_pairs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < num_pairs
            e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
            hit = ok & (e >= 0) & (e < num_experts)
            if HAS_LORA:
                hit = hit & (tl.load(lora_ptr + offs // TOP_K, mask=ok, other=-1) == lora)
            hist += tl.histogram(tl.where(hit, e, num_experts), BLOCK_E)
    ev = tl.arange(0, BLOCK_E)
    counts = tl.where(ev < num_experts, hist, 0)
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    offset = tl.sum(tl.where(ev < expert, padded, 0), 0)
    mine = tl.sum(tl.where(ev == expert, counts, 0), 0)
    total = tl.sum(padded, 0)
    tl.store(counts_ptr + lora * num_experts + expert, mine)
    tl.store(offsets_ptr + lora * num_experts + expert, offset)
    if expert == 0:
        tl.store(num_post_ptr + lora, total)
    # ---- unused tail (sorted_ids past `total`, blocks past total / BLOCK_SIZE), shared by the programs
    for t in range(total + expert * BLOCK, capacity, BLOCK * num_experts):
        offs = t + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + lora64 * capacity + offs, tl.full([BLOCK], 0, tl.int32) + num_pairs,
                 mask=offs < capacity)
    for b in range(total // BLOCK_SIZE + expert * BLOCK, num_blocks, BLOCK * num_experts):
        bo = b + tl.arange(0, BLOCK)
        tl.store(expert_ids_ptr + lora64 * num_blocks + bo, tl.full([BLOCK], -1, tl.int32), mask=bo < num_blocks)
    if mine > 0:  # an expert with pairs of this slot
        # ---- block -> expert, and the pad after this expert's pairs
        my_padded = (mine + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
        first_block = offset // BLOCK_SIZE
        for b in range(0, my_padded // BLOCK_SIZE, BLOCK):
            bo = b + tl.arange(0, BLOCK)
            tl.store(expert_ids_ptr + lora64 * num_blocks + first_block + bo,
                     tl.full([BLOCK], 0, tl.int32) + expert, mask=bo < my_padded // BLOCK_SIZE)
        pad = tl.arange(0, PAD_BLOCK)
        tl.store(sorted_ptr + lora64 * capacity + offset + mine + pad,
                 tl.full([PAD_BLOCK], 0, tl.int32) + num_pairs, mask=pad < my_padded - mine)
        # ---- scatter this expert's pairs in token order
        placed = 0
        for start in range(0, num_pairs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < num_pairs
            hit = ok & (tl.load(ids_ptr + offs, mask=ok, other=-1) == expert)
            if HAS_LORA:
                hit = hit & (tl.load(lora_ptr + offs // TOP_K, mask=ok, other=-1) == lora)
            hit_i = hit.to(tl.int32)
            rank = tl.cumsum(hit_i, 0) - 1 + placed
            tl.store(sorted_ptr + lora64 * capacity + offset + rank, offs.to(tl.int32), mask=hit)
            placed += tl.sum(hit_i, 0)


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks"])
def _moe_align_kernel(
    ids_ptr, lora_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, counts_ptr, offsets_ptr,
    num_pairs, num_experts, capacity, num_blocks,
    TOP_K: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAD_BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (experts, slots): one alignment (``_align_program``'s arguments)."""
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    _align_program(tl.program_id(0), tl.program_id(1), ids_ptr, lora_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                   counts_ptr, offsets_ptr, num_pairs, num_experts, capacity, num_blocks, TOP_K, HAS_LORA, BLOCK_SIZE,
                   PAD_BLOCK, BLOCK_E, BLOCK)


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks", "lora_capacity", "lora_num_blocks", "L"])
def _moe_align_pair_kernel(
    ids_ptr, lora_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, counts_ptr, offsets_ptr,
    lora_sorted_ptr, lora_expert_ids_ptr, lora_num_post_ptr, lora_counts_ptr, lora_offsets_ptr,
    num_pairs, num_experts, capacity, num_blocks, lora_capacity, lora_num_blocks, L,
    TOP_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAD_BLOCK: tl.constexpr, LORA_BLOCK_SIZE: tl.constexpr,
    LORA_PAD_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (experts, L + 1): slots 0..L-1 align the pairs by (adapter slot, expert) at LORA_BLOCK_SIZE (the LoRA
    tables), the last row aligns every pair by expert at BLOCK_SIZE (the base GEMMs' tables): both alignments of an
    expert layer with LoRA in one launch."""
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    expert = tl.program_id(0)
    lora = tl.program_id(1)
    if lora < L:
        _align_program(expert, lora, ids_ptr, lora_ptr, lora_sorted_ptr, lora_expert_ids_ptr, lora_num_post_ptr,
                       lora_counts_ptr, lora_offsets_ptr, num_pairs, num_experts, lora_capacity, lora_num_blocks,
                       TOP_K, True, LORA_BLOCK_SIZE, LORA_PAD_BLOCK, BLOCK_E, BLOCK)
    else:
        _align_program(expert, lora - L, ids_ptr, lora_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, counts_ptr,
                       offsets_ptr, num_pairs, num_experts, capacity, num_blocks, TOP_K, False, BLOCK_SIZE,
                       PAD_BLOCK, BLOCK_E, BLOCK)


def _outputs(slots: int, capacity: int, num_blocks: int, num_experts: int, device) -> tuple:
    """An alignment's outputs, every entry of which its kernel writes: (sorted_ids [L, P], expert_ids
    [L, P / block_size], num_tokens_post_pad [L], counts [L, E], offsets [L, E])."""
    return (torch.empty(slots, capacity, dtype=torch.int32, device=device),
            torch.empty(slots, num_blocks, dtype=torch.int32, device=device),
            torch.empty(slots, dtype=torch.int32, device=device),
            torch.empty(slots, num_experts, dtype=torch.int32, device=device),
            torch.empty(slots, num_experts, dtype=torch.int32, device=device))


def _check_ids(topk_ids: torch.Tensor, token_lora_idx: torch.Tensor | None = None) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, A], got {tuple(topk_ids.shape)}")
    if token_lora_idx is not None and token_lora_idx.shape != (topk_ids.shape[0],):
        raise ValueError(f"token_lora_idx must be [T={topk_ids.shape[0]}], got {tuple(token_lora_idx.shape)}")


def _align(topk_ids: torch.Tensor, token_lora_idx: torch.Tensor | None, num_experts: int, max_loras: int,
           block_size: int):
    """(sorted_ids [L, P], expert_ids [L, P / block_size], num_tokens_post_pad [L], counts [L, E],
    offsets [L, E])."""
    _check_ids(topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    cap, num_blocks = moe_align_capacity(num_pairs, num_experts, block_size)
    dev = topk_ids.device
    if num_pairs == 0:
        zeros = torch.zeros(max_loras, num_experts, dtype=torch.int32, device=dev)
        return (torch.full((max_loras, cap), num_pairs, dtype=torch.int32, device=dev),
                torch.full((max_loras, num_blocks), -1, dtype=torch.int32, device=dev),
                torch.zeros(max_loras, dtype=torch.int32, device=dev), zeros, zeros.clone())
    out = _outputs(max_loras, cap, num_blocks, num_experts, dev)
    ids = topk_ids.contiguous()
    has_lora = token_lora_idx is not None
    pdl = step_pdl(dev)
    _moe_align_kernel[(num_experts, max_loras)](
        ids, token_lora_idx if has_lora else ids, *out, num_pairs, num_experts, cap, num_blocks, TOP_K=top_k,
        HAS_LORA=has_lora, BLOCK_SIZE=block_size, PAD_BLOCK=next_power_of_2(block_size),
        BLOCK_E=next_power_of_2(num_experts + 1), BLOCK=1024, USE_PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """Same contract as ``reference_lora.moe_align``."""
    sorted_ids, expert_ids, num_post, _, _ = _align(topk_ids, None, num_experts, 1, block_size)
    return sorted_ids[0], expert_ids[0], num_post


def moe_align_lora(topk_ids: torch.Tensor, token_lora_idx: torch.Tensor, num_experts: int, max_loras: int,
                   block_size: int):
    """Same contract as ``reference_lora.moe_align_lora``."""
    _check_ids(topk_ids, token_lora_idx)
    return _align(topk_ids, token_lora_idx.contiguous(), num_experts, max_loras, block_size)[:3]


def moe_align_pair(topk_ids: torch.Tensor, token_lora_idx: torch.Tensor, num_experts: int, max_loras: int,
                   block_size: int, lora_block_size: int):
    """``(moe_align(topk_ids, E, block_size), moe_align_lora(topk_ids, token_lora_idx, E, max_loras,
    lora_block_size))`` in one launch: an expert layer with LoRA needs both, and in an eager step every launch
    costs host time."""
    _check_ids(topk_ids, token_lora_idx)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return (moe_align(topk_ids, num_experts, block_size),
                moe_align_lora(topk_ids, token_lora_idx, num_experts, max_loras, lora_block_size))
    dev = topk_ids.device
    cap, num_blocks = moe_align_capacity(num_pairs, num_experts, block_size)
    lora_cap, lora_blocks = moe_align_capacity(num_pairs, num_experts, lora_block_size)
    base = _outputs(1, cap, num_blocks, num_experts, dev)
    lora = _outputs(max_loras, lora_cap, lora_blocks, num_experts, dev)
    ids = topk_ids.contiguous()
    pdl = step_pdl(dev)
    _moe_align_pair_kernel[(num_experts, max_loras + 1)](
        ids, token_lora_idx.contiguous(), *base, *lora, num_pairs, num_experts, cap, num_blocks, lora_cap,
        lora_blocks, max_loras, TOP_K=top_k, BLOCK_SIZE=block_size, PAD_BLOCK=next_power_of_2(block_size),
        LORA_BLOCK_SIZE=lora_block_size, LORA_PAD_BLOCK=next_power_of_2(lora_block_size),
        BLOCK_E=next_power_of_2(num_experts + 1), BLOCK=1024, USE_PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return (base[0][0], base[1][0], base[2]), lora[:3]


def group_by_slot(token_lora_idx: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens grouped by adapter slot (token order kept), tokens without an adapter left out, in one launch:
    (order [T] int32, seg_start [L] int32, seg_len [L] int32); slot l's tokens are
    order[seg_start[l] : seg_start[l] + seg_len[l]]. moe_align with the slot as the "expert", top-1, blocks of one."""
    sorted_ids, _, _, counts, offsets = _align(token_lora_idx.reshape(-1, 1), None, max_loras, 1, 1)
    return sorted_ids[0], offsets[0], counts[0]
