"""Random multi-LoRA inputs: adapters of mixed ranks (8 / 16 / 32) each at its own rank in a ``LoRATable``, empty
slots, slices an adapter does not target, tokens without an adapter."""
from __future__ import annotations

import torch

from loraplex.kernels.lora_table import LoRATable

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
    """The stacked (zero-padded) layout: lora_a [S, L, R, K], lora_b [L, N, R], scaling [L]."""
    mask = padded_rank_mask(max_loras, max_rank)
    lora_a = torch.randn(num_slices, max_loras, max_rank, k) * mask[None, :, :, None] / k ** 0.5
    lora_b = torch.randn(max_loras, n, max_rank) * mask[:, None, :]
    scaling = torch.rand(max_loras) + 0.5
    return lora_a.to(dtype), lora_b.to(dtype), scaling


def dense_table(num_slots: int, k: int, widths: tuple[int, ...], *, empty: tuple[int, ...] = (),
                untargeted: tuple[tuple[int, int], ...] = (), max_rank: int = 32,
                dtype=torch.float32) -> LoRATable:
    """Slot l at rank RANKS[l % 3], each factor at its own rank; slots in ``empty`` hold nothing, (slot, slice)
    pairs in ``untargeted`` have no weights for that slice."""
    slots = []
    for l in range(num_slots):
        r = RANKS[l % len(RANKS)]
        row = []
        for s, n in enumerate(widths):
            if l in empty or (l, s) in untargeted:
                row.append(None)
                continue
            row.append(((torch.randn(r, k) / k ** 0.5).to(dtype), torch.randn(n, r).to(dtype)))
        slots.append(row)
    return LoRATable.from_factors(slots, in_features=k, out_features=widths, max_rank=max_rank)


def expert_table(num_slots: int, num_experts: int, k: int, n: int, *, empty: tuple[int, ...] = (),
                 max_rank: int = 32, ranks: tuple[int, ...] = RANKS, dtype=torch.float32) -> LoRATable:
    """Expert factors A [E, r, K], B [E, N, r] per slot at rank ranks[l % len(ranks)]; ``empty`` slots hold none."""
    slots = []
    for l in range(num_slots):
        r = ranks[l % len(ranks)]
        if l in empty:
            slots.append([None])
            continue
        slots.append([((torch.randn(num_experts, r, k) / k ** 0.5).to(dtype),
                       (torch.randn(num_experts, n, r) / r ** 0.5).to(dtype))])
    return LoRATable.from_factors(slots, in_features=k, out_features=(n,), max_rank=max_rank, num_experts=num_experts)
