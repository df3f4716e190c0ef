"""Inputs of one paged forward pass where each sequence computes an arbitrary run of tokens (the model runner's
``prepare`` reads its tokens from the sequences; a verify step also computes draft tokens they do not hold yet).

    entries[i] = (token_ids, start, block_ids): compute token_ids at positions start .. start + n - 1
    -> input_ids [T], positions [T], AttentionMetadata (slot_mapping [T], block_tables [B, W], seq_lens [B],
       query_start_loc [B+1]), and the row of each entry's first token in the step
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.attention_metadata import AttentionMetadata


@dataclass
class PagedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    first_rows: list[int]   # entry i's tokens are rows first_rows[i] .. first_rows[i] + n_i - 1


def paged_batch(entries: list[tuple[list[int], int, list[int]]], block_size: int,
                device: torch.device) -> PagedBatch:
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    seq_lens: list[int] = []
    qsl = [0]
    width = max(len(blocks) for _, _, blocks in entries)
    tables = torch.zeros(len(entries), width, dtype=torch.int32)
    for i, (tokens, start, blocks) in enumerate(entries):
        n = len(tokens)
        ids.extend(tokens)
        pos = torch.arange(start, start + n, dtype=torch.int64)
        table = torch.tensor(blocks, dtype=torch.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        tables[i, :len(blocks)] = table.to(torch.int32)
    attn = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device, non_blocking=True),
        block_tables=tables.to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device, non_blocking=True),
        max_query_len=max(len(t) for t, _, _ in entries), max_seq_len=max(seq_lens))
    return PagedBatch(torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True),
                      torch.cat(positions).to(device, non_blocking=True), attn, qsl[:-1])


class DecodeRow:
    """One token of a verify step as a one-token decode row of ``DecodeGraphs`` (cuda_graphs.py): it reads
    ``row.seq`` (seq_id, num_computed_tokens = the token's position, num_pending_tokens, token_ids_slice) and
    ``row.block_ids``; row j of a sequence's k + 1 verify tokens attends to positions 0 .. start + j, exactly what
    the causal mask gives it in the multi-token forward (its earlier drafts' K/V are written in the same layer
    before attention reads them)."""

    __slots__ = ("seq_id", "num_computed_tokens", "token", "block_ids", "num_new_tokens", "prompt_logprobs")
    num_pending_tokens = 0

    def __init__(self, seq_id: int, position: int, token: int, block_ids: list[int]) -> None:
        self.seq_id, self.num_computed_tokens, self.token, self.block_ids = seq_id, position, token, block_ids
        self.num_new_tokens, self.prompt_logprobs = 1, None

    @property
    def seq(self) -> "DecodeRow":
        return self

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return [self.token]


@dataclass
class RowStep:
    """A ``SchedulerOutput`` look-alike of decode rows (``DecodeGraphs.run`` / ``can_run`` read ``scheduled``)."""

    scheduled: list[DecodeRow]
