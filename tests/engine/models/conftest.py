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
    return AttentionMetadata.from_block_tables(tables, seq_lens, query_lens, block_size)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()
