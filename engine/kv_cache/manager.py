"""The KV cache manager: block tables of sequences over one BlockPool, with prefix caching (torch-free).

    seq.block_ids:  [ b4 | b9 | b1 | b6 ]        logical block i holds tokens [i*BS, (i+1)*BS)
                      ^ shared, cached  ^ last, partly filled, private

Life of a sequence's blocks:
    get_computed_blocks(seq)      prefix hit: cached full blocks (no references taken yet)
    allocate_slots(seq, n, hit)   take the hit's blocks (+1 ref) and enough new blocks for n more tokens
    cache_full_blocks(seq)        after a step: hash blocks that became full and computed
    free(seq)                     -1 ref on every block; cached ones stay findable until reused
    fork(parent, child)           the child shares every block (+1 ref) — copy-on-write comes with n > 1
"""
from __future__ import annotations

from loraplex.engine.kv_cache.block_pool import BlockPool
from loraplex.engine.kv_cache.prefix_hash import BlockHash, hash_block_tokens
from loraplex.engine.sequence import Sequence


class KVCacheManager:
    """Owns every sequence's ``block_ids``. Counters: ``prefix_cache_queries`` / ``prefix_cache_hits`` in
    tokens (hit rate = hits / queries), ``num_free_blocks``, ``usage``, ``num_cached_blocks``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._seqs: dict[int, Sequence] = {}                 # seq_id -> sequence holding blocks
        self._block_hashes: dict[int, list[BlockHash]] = {}  # seq_id -> hashes of its cached full blocks

    # ---- counters -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence, record: bool = True) -> tuple[list[int], int]:
        """The longest run of cached full blocks that prefixes ``seq``: ``(block_ids, num_cached_tokens)``.

        Never the whole sequence: the last token must be computed to produce logits, so only full blocks
        within the first ``num_tokens - 1`` tokens count. Takes no references (``allocate_slots`` does).
        With ``record`` the call adds ``num_tokens`` queried tokens and the hit tokens to the counters; a caller
        that may retry (the scheduler, when blocks run out) passes False and calls ``record_prefix_query``
        once the request is admitted.
        """
        if not self.enable_prefix_caching or seq.block_ids:
            return [], 0
        n_full = (seq.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        parent: BlockHash | None = None
        for i in range(n_full):
            parent = hash_block_tokens(parent, seq.token_ids_slice(i * self.block_size, (i + 1) * self.block_size),
                                       seq.extra_key)
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        if record:
            self.record_prefix_query(seq.num_tokens, len(block_ids) * self.block_size)
        return block_ids, len(block_ids) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup in the hit-rate counters (tokens)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are full and computed but not yet hashed (call after a step)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        for i in range(len(hashes), n_full):
            parent = hashes[-1] if hashes else None
            h = hash_block_tokens(parent, seq.token_ids_slice(i * self.block_size, (i + 1) * self.block_size),
                                  seq.extra_key)
            self.pool.cache(seq.block_ids[i], h)
            hashes.append(h)

    # ---- allocation ------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed."""
        return self._num_blocks_short(seq, num_new_tokens, computed_blocks or []) <= 0

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` after its computed ones.

        With ``computed_blocks`` (a prefix hit from ``get_computed_blocks``, only for a sequence without
        blocks) the hit blocks are taken first and ``seq.num_computed_tokens`` becomes the hit's token count;
        ``num_new_tokens`` then counts tokens after the hit. Returns False, changing nothing, when the pool
        lacks free blocks.
        """
        computed_blocks = computed_blocks or []
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if computed_blocks and seq.block_ids:
            raise ValueError(f"sequence {seq.seq_id} already has blocks; a prefix hit applies only to a new one")
        if self._num_blocks_short(seq, num_new_tokens, computed_blocks) > 0:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)  # prefix hit: out of the free queue before allocating new blocks
            seq.block_ids = list(computed_blocks)
            seq.num_computed_tokens = len(computed_blocks) * self.block_size
            self._block_hashes[seq.seq_id] = [self.pool.blocks[b].block_hash for b in computed_blocks]
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        self._seqs[seq.seq_id] = seq
        return True

    def _num_blocks_short(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int]) -> int:
        num_computed = len(computed_blocks) * self.block_size if computed_blocks else seq.num_computed_tokens
        have = len(computed_blocks) if computed_blocks else len(seq.block_ids)
        need = self.num_blocks_for(num_computed + num_new_tokens) - have
        # touching a free cached block takes it out of the free queue too
        free = self.pool.num_free_blocks - sum(self.pool.ref_cnt(b) == 0 for b in computed_blocks)
        return need - free

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its blocks go to the free queue tail-first (the prompt's head, most
        likely shared, is evicted last). Cached blocks stay findable until reused."""
        self.pool.release(list(reversed(seq.block_ids)))
        seq.block_ids = []
        self._seqs.pop(seq.seq_id, None)
        self._block_hashes.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (+1 reference each). Writes into a shared partial
        block need copy-on-write (next issue: the scheduler's ``blocks_to_copy``)."""
        if child.block_ids:
            raise ValueError(f"child sequence {child.seq_id} already has blocks")
        self.pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        self._block_hashes[child.seq_id] = list(self._block_hashes.get(parent.seq_id, []))
        self._seqs[child.seq_id] = child

    # ---- checks ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless: each block's ref count == its occurrences in live block tables; free
        queue == blocks with ref 0; every table covers its computed tokens; the pool's index is consistent."""
        counts = [0] * self.num_blocks
        for seq in self._seqs.values():
            if len(set(seq.block_ids)) != len(seq.block_ids):
                raise AssertionError(f"sequence {seq.seq_id} holds a block twice: {seq.block_ids}")
            if len(seq.block_ids) < self.num_blocks_for(seq.num_computed_tokens):
                raise AssertionError(f"sequence {seq.seq_id}: {seq.num_computed_tokens} computed tokens "
                                     f"but {len(seq.block_ids)} blocks")
            for b in seq.block_ids:
                counts[b] += 1
        for block in self.pool.blocks:
            if block.ref_cnt != counts[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref count {block.ref_cnt}, "
                                     f"but {counts[block.block_id]} block tables hold it")
        self.pool.check_invariants()
