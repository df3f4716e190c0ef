"""MoE alignment in Triton: routed pairs grouped by expert (and by adapter slot for the LoRA variant), each
group padded to the GEMM's BLOCK_M. Same contracts as ``reference_lora.moe_align`` / ``moe_align_lora``.

Two launches over a grid (experts, slots): a count pass writes counts [L, E]; the align pass turns them into
padded offsets (exclusive prefix sum in registers), writes its expert's block ids and scatters its pairs in
token order (in-block prefix sums). Buffers have the static capacity of ``moe_align_capacity``: no host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.reference_lora import moe_align_capacity


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_count_kernel(
    ids_ptr, lora_ptr, counts_ptr,  # topk_ids [T*A]; token_lora_idx [T]; counts [L, E] int32
    num_pairs, num_experts,
    TOP_K: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr,
):
    expert = tl.program_id(0)
    lora = tl.program_id(1)
    cnt = 0
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < num_pairs
        hit = ok & (tl.load(ids_ptr + offs, mask=ok, other=-1) == expert)
        if HAS_LORA:
            hit = hit & (tl.load(lora_ptr + offs // TOP_K, mask=ok, other=-1) == lora)
        cnt += tl.sum(hit.to(tl.int32), 0)
    tl.store(counts_ptr + lora * num_experts + expert, cnt)


@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks"])
def _moe_align_kernel(
    ids_ptr, lora_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # counts [L, E]; sorted_ids [L, capacity]; expert_ids [L, num_blocks]; num_tokens_post_pad [L]
    num_pairs, num_experts, capacity, num_blocks,
    TOP_K: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    expert = tl.program_id(0)
    lora = tl.program_id(1)
    # ---- padded offsets from the counts of this slot
    ev = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + lora * num_experts + ev, mask=ev < num_experts, other=0)
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    offset = tl.sum(tl.where(ev < expert, padded, 0), 0)
    if expert == 0:
        tl.store(num_post_ptr + lora, tl.sum(padded, 0))
    mine = tl.load(counts_ptr + lora * num_experts + expert)
    if mine == 0:  # expert without tokens
        return
    # ---- block -> expert
    first_block = offset // BLOCK_SIZE
    my_blocks = (mine + BLOCK_SIZE - 1) // BLOCK_SIZE
    for b in range(0, my_blocks, BLOCK):
        bo = b + tl.arange(0, BLOCK)
        tl.store(expert_ids_ptr + lora * num_blocks + first_block + bo, tl.full([BLOCK], 0, tl.int32) + expert,
                 mask=bo < my_blocks)
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
        tl.store(sorted_ptr + lora * capacity + offset + rank, offs.to(tl.int32), mask=hit)
        placed += tl.sum(hit_i, 0)


def _align(topk_ids: torch.Tensor, token_lora_idx: torch.Tensor | None, num_experts: int, max_loras: int,
           block_size: int):
    """(sorted_ids [L, P], expert_ids [L, P / block_size], num_tokens_post_pad [L], counts [L, E])."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, A], got {tuple(topk_ids.shape)}")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    cap, num_blocks = moe_align_capacity(num_pairs, num_experts, block_size)
    dev = topk_ids.device
    sorted_ids = torch.full((max_loras, cap), num_pairs, dtype=torch.int32, device=dev)
    expert_ids = torch.full((max_loras, num_blocks), -1, dtype=torch.int32, device=dev)
    num_post = torch.zeros(max_loras, dtype=torch.int32, device=dev)
    if num_pairs == 0:
        return sorted_ids, expert_ids, num_post, torch.zeros(max_loras, num_experts, dtype=torch.int32, device=dev)
    counts = torch.empty(max_loras, num_experts, dtype=torch.int32, device=dev)  # every entry is written
    ids = topk_ids.contiguous()
    lora = token_lora_idx if token_lora_idx is not None else ids
    has_lora = token_lora_idx is not None
    grid = (num_experts, max_loras)
    _moe_count_kernel[grid](ids, lora, counts, num_pairs, num_experts, TOP_K=top_k, HAS_LORA=has_lora,
                            BLOCK=1024, num_warps=4)
    _moe_align_kernel[grid](ids, lora, counts, sorted_ids, expert_ids, num_post, num_pairs, num_experts, cap,
                            num_blocks, TOP_K=top_k, HAS_LORA=has_lora, BLOCK_SIZE=block_size,
                            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK=1024, num_warps=4)
    return sorted_ids, expert_ids, num_post, counts


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """Same contract as ``reference_lora.moe_align``."""
    sorted_ids, expert_ids, num_post, _ = _align(topk_ids, None, num_experts, 1, block_size)
    return sorted_ids[0], expert_ids[0], num_post


def moe_align_lora(topk_ids: torch.Tensor, token_lora_idx: torch.Tensor, num_experts: int, max_loras: int,
                   block_size: int):
    """Same contract as ``reference_lora.moe_align_lora``."""
    if token_lora_idx.shape != (topk_ids.shape[0],):
        raise ValueError(f"token_lora_idx must be [T={topk_ids.shape[0]}], got {tuple(token_lora_idx.shape)}")
    return _align(topk_ids, token_lora_idx.contiguous(), num_experts, max_loras, block_size)[:3]


def group_by_slot(token_lora_idx: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens grouped by adapter slot (token order kept), tokens without an adapter left out:
    (order [T] int32 -- the first sum(counts) entries are valid, counts [L] int32). moe_align with the slot
    as the "expert", top-1 and blocks of one."""
    sorted_ids, _, _, counts = _align(token_lora_idx.reshape(-1, 1), None, max_loras, 1, 1)
    return sorted_ids[0], counts[0]
