"""The physical KV blocks: reference counts, the free queue, and the prefix-cache index (torch-free).

    free queue (LRU):  head -> [ b7  b2  b9 ... ] <- tail        freed blocks join at the tail,
                                                                 allocation takes from the head
    cache index:       hash -> block id                          full blocks that hold known tokens

A freed block keeps its hash and stays findable in the cache index while it waits in the free queue; a
prefix hit on it takes it back out of the queue (``touch``). Only when allocation reuses it for new tokens
is its hash dropped. So the least recently freed cached blocks are evicted first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loraplex.engine.kv_cache.prefix_hash import BlockHash


@dataclass
class KVBlock:
    """Metadata of one physical block; ``block_hash`` is set while the block is in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each. Callers hand over block ids, never objects."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference, cached or not (a cached free block is evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable through the prefix-cache index, in use or free."""
        return len(self._cached)

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def free_queue(self) -> list[int]:
        """Free block ids, next to be reused first."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, each with ref count 1; evicts their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Add one reference to each block (prefix hit, fork); a free block leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 join the free queue's
        tail, in that order (so pass a sequence's blocks tail-first to have its tail evicted first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} released with ref count {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block id holding the tokens named by ``block_hash``, if cached."""
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full block under its hash. False (nothing changed) when the block is already cached or
        another block already holds these tokens (two sequences computed the same prefix at once)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        """Internal consistency: free queue == blocks with ref 0; the index points at blocks with that hash."""
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref count {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in self._free):
                raise AssertionError(f"block {block.block_id}: ref count {block.ref_cnt} but "
                                     f"{'in' if block.block_id in self._free else 'not in'} the free queue")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"cache index points hash at block {block_id}, which holds another hash")
        hashed = sum(b.block_hash is not None for b in self.blocks)
        if hashed != len(self._cached):
            raise AssertionError(f"{hashed} blocks carry a hash but the index has {len(self._cached)}")
