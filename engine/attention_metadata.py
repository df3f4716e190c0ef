"""What every attention layer needs to know about one step, built once per step by the model runner.

    tokens of the step:   [ seq0 new tokens | seq1 new tokens | ... ]      (T in all)
    query_start_loc:      [0, n0, n0+n1, ...]                              [B+1] int32
    seq_lens:             context length of each sequence after this step  [B]   int32
    block_tables:         physical blocks of each sequence, logical order  [B, max_blocks] int32 (pad: 0)
    slot_mapping:         where each new token's K/V goes (block*BS+off)   [T]   int64

A decode token is just a sequence with one new token; a prefill chunk one with several. ``scheduled_tokens`` and
``token_slots`` build these arrays on the host for the eager step (``ModelRunner.prepare``) and the mixed-step
graphs' static buffers (mixed_graphs.py) alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def query_start_loc(counts: np.ndarray) -> np.ndarray:
    """[n + 1] int64: 0, then the running sum of each sequence's new tokens."""
    qsl = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    return qsl


def scheduled_tokens(scheduled: list) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """(token ids [T], starts [n], counts [n], query_start_loc [n + 1]) of a step's scheduled sequences, each
    computing its ``num_new_tokens`` tokens from its ``num_computed_tokens`` on."""
    n = len(scheduled)
    starts = np.fromiter((s.seq.num_computed_tokens for s in scheduled), dtype=np.int64, count=n)
    counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=n)
    ids: list[int] = []
    for s, start, count in zip(scheduled, starts.tolist(), counts.tolist()):
        ids.extend(s.seq.token_ids_slice(start, start + count))
    return ids, starts, counts, query_start_loc(counts)


def token_slots(starts: np.ndarray, counts: np.ndarray, qsl: np.ndarray, block_tables: np.ndarray,
                block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions [T], slot_mapping [T]) int64 of the step's tokens; ``block_tables`` [>= n, W] holds sequence
    i's blocks in row i."""
    row = np.repeat(np.arange(len(counts)), counts)  # sequence of each token
    positions = np.arange(int(qsl[-1]), dtype=np.int64) - qsl[:-1][row] + starts[row]
    slots = block_tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return positions, slots


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def from_block_tables(cls, tables: list[list[int]], seq_lens: list[int], query_lens: list[int], block_size: int,
                          device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for sequences stored in the given block tables, whose new tokens are each one's last
        ``query_lens[b]`` positions. For tests and warm-up; the model runner builds its own from the scheduler."""
        slots = [table[pos // block_size] * block_size + pos % block_size
                 for table, ctx, n_new in zip(tables, seq_lens, query_lens) for pos in range(ctx - n_new, ctx)]
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=bt.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )

    @classmethod
    def contiguous(cls, seq_lens: list[int], query_lens: list[int], block_size: int,
                   device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for sequences stored in consecutive blocks (sequence b owns a contiguous run of blocks)."""
        tables, next_block = [], 0
        for ctx in seq_lens:
            n_blocks = (ctx + block_size - 1) // block_size
            tables.append(list(range(next_block, next_block + n_blocks)))
            next_block += n_blocks
        return cls.from_block_tables(tables, seq_lens, query_lens, block_size, device)

    @staticmethod
    def blocks_needed(seq_lens: list[int], block_size: int) -> int:
        return sum((s + block_size - 1) // block_size for s in seq_lens)
