"""Shared fixtures: one tiny checkpoint per family (built once per session) and paged-cache helpers."""
from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.attention_metadata import AttentionMetadata
from loraplex.engine.testing.tiny import FAMILIES, make_tiny_checkpoint

BLOCK_SIZE = 4


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """family -> folder of a tiny random checkpoint (transformers' own classes, float32)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_checkpoint(f, root / f, seed=0) for f in FAMILIES}


def alloc_kv_caches(cfg, num_blocks: int, block_size: int = BLOCK_SIZE, dtype=torch.float32):
    """One zeroed (k, v) pair per layer, each [NB, BS, KV, D]."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


def shuffled_block_tables(max_lens: list[int], block_size: int = BLOCK_SIZE,
                          seed: int = 0) -> tuple[list[list[int]], int]:
    """Give each sequence enough blocks for ``max_lens`` tokens, drawn from a shuffled pool (non-contiguous,
    interleaved between sequences). Returns (tables, num_blocks)."""
    need = [(n + block_size - 1) // block_size for n in max_lens]
    pool = list(range(sum(need) + 3))  # a few spare blocks never used
    random.Random(seed).shuffle(pool)
    tables, i = [], 0
    for n in need:
        tables.append(pool[i:i + n])
        i += n
    return tables, len(pool)


def paged_metadata(tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                   block_size: int = BLOCK_SIZE) -> AttentionMetadata:
    """Metadata for sequences stored in the given block tables; the new tokens are each sequence's last ones."""
    slots = []
    for table, ctx, n_new in zip(tables, seq_lens, query_lens):
        for pos in range(ctx - n_new, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=bt,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()
