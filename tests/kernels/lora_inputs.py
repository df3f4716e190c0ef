"""Random multi-LoRA inputs: mixed ranks zero-padded to the max rank, tokens without an adapter."""
from __future__ import annotations

import torch

RANKS = (8, 16, 32)


def padded_rank_mask(max_loras: int, max_rank: int) -> torch.Tensor:
    """[L, R] 1 where slot l's (mixed) rank covers r, 0 in the padding."""
    ranks = torch.tensor([RANKS[i % len(RANKS)] for i in range(max_loras)])
    return (torch.arange(max_rank)[None, :] < ranks[:, None]).float()


def token_adapters(num_tokens: int, max_loras: int) -> torch.Tensor:
    """Slots in shuffled order with every third token (and at least the first) without an adapter."""
    idx = torch.randint(0, max_loras, (num_tokens,), dtype=torch.int32)
    idx[::3] = -1
    return idx


def dense_lora(num_slices: int, max_loras: int, max_rank: int, k: int, n: int, dtype=torch.float32):
    mask = padded_rank_mask(max_loras, max_rank)
    lora_a = torch.randn(num_slices, max_loras, max_rank, k) * mask[None, :, :, None] / k ** 0.5
    lora_b = torch.randn(max_loras, n, max_rank) * mask[:, None, :]
    scaling = torch.rand(max_loras) + 0.5
    return lora_a.to(dtype), lora_b.to(dtype), scaling
