"""The packed token bitmask of a step: filled on the host for the constrained rows, applied to logits on the device.

    layout: int32 [R, W], W = ceil(V / 32); token t of row r is allowed iff bit (t % 32) of word t // 32 is set
            (llguidance's and xgrammar's format); -1 (all bits set) = unconstrained

    mask = TokenBitmask.allocate(num_rows, vocab_size, pin=True)   # K constrained rows + one all-allowed row
    matcher.fill_bitmask(mask.host, mask.row_of[seq_id])
    logits = apply_token_bitmask(logits, device_rows)              # disallowed -> -inf, out of place

The host tensor is new every step (pinned memory from torch's caching host allocator on CUDA, which keeps a block
until the non-blocking copy that reads it has run), so a step never overwrites a mask still being uploaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class TokenBitmask:
    """One step's masks: ``host`` int32 [K + 1, W] (row K allows everything), ``row_of`` {seq_id: row < K}."""

    host: torch.Tensor
    row_of: dict[int, int] = field(default_factory=dict)

    @classmethod
    def allocate(cls, seq_ids: list[int], vocab_size: int, *, pin: bool) -> "TokenBitmask":
        host = torch.empty((len(seq_ids) + 1, bitmask_width(vocab_size)), dtype=torch.int32, pin_memory=pin)
        host[-1] = -1
        return cls(host, {seq_id: i for i, seq_id in enumerate(seq_ids)})

    @property
    def free_row(self) -> int:
        return self.host.shape[0] - 1

    def rows_for(self, seq_ids: list[int], device: torch.device) -> torch.Tensor | None:
        """int32 [N, W] on ``device``: row i is the mask of ``seq_ids[i]`` (all-allowed for a free row), or None
        when no row is constrained. Non-blocking on CUDA (pinned host memory)."""
        idx = [self.row_of.get(s, self.free_row) for s in seq_ids]
        if all(i == self.free_row for i in idx):
            return None
        dev = self.host.to(device, non_blocking=True)
        if idx == list(range(len(idx))):
            return dev[:len(idx)]
        index = torch.tensor(idx, dtype=torch.int64, pin_memory=device.type == "cuda")
        return dev.index_select(0, index.to(device, non_blocking=True))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with every token whose bit is clear in ``bitmask`` [N, W] (int32, same device) set to -inf;
    a new tensor. Tokens past ``32 * W`` are disallowed."""
    n, v = logits.shape
    if bitmask.dim() != 2 or bitmask.shape[0] != n or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [{n}, W], got {bitmask.dtype} {tuple(bitmask.shape)}")
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    # little-endian bytes of each word: byte j of word w holds tokens 32w + 8j .. 32w + 8j + 7
    bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [N, 4W, 8]
    allowed = bits.view(n, -1).bool()
    width = allowed.shape[1]
    if width >= v:
        return logits.masked_fill(~allowed[:, :v], float("-inf"))
    out = torch.full_like(logits, float("-inf"))
    out[:, :width] = logits[:, :width].masked_fill(~allowed, float("-inf"))
    return out
