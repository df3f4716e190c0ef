"""Content hashes of full KV blocks, chained so that a hash names the whole prefix up to its block.

    block i hash = sha256(pickle((hash of block i-1, token ids of block i, extra_key)))

Chaining makes equal hashes mean equal prefixes (not only equal blocks); ``extra_key`` (the adapter id)
keeps two adapters' K/V for the same tokens apart. sha256 rather than ``hash()``: tenants choose the tokens,
so a collision must be infeasible, not merely unlikely.
"""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Hashable, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_key: Hashable | None = None) -> BlockHash:
    """Hash of one full block given the hash of the block before it (None for the first block)."""
    payload = pickle.dumps((parent_hash, tuple(token_ids), _key(extra_key)), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(payload).digest()


_PLAIN = (type(None), bool, int, float, str, bytes)


def _key(extra_key: Hashable | None) -> Hashable:
    """Plain values (ids, names, tuples of them) enter the hash by value; any other object (an adapter handle)
    by its type name and ``hash()`` — identity unless the class defines value hashing."""
    if isinstance(extra_key, _PLAIN) or (isinstance(extra_key, tuple) and all(isinstance(x, _PLAIN) for x in extra_key)):
        return extra_key
    return ("object", type(extra_key).__qualname__, hash(extra_key))


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra_key: Hashable | None = None,
                     num_blocks: int | None = None) -> list[BlockHash]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids`` (all full blocks by default)."""
    n_full = len(token_ids) // block_size
    n = n_full if num_blocks is None else min(num_blocks, n_full)
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(n):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        hashes.append(parent)
    return hashes
