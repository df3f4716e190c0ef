"""The KV cache manager: block tables of sequences over one BlockPool, with prefix caching (torch-free).

    seq.block_ids:  [ b4 | b9 | b1 | b6 ]        logical block i holds tokens [i*BS, (i+1)*BS)
                      ^ shared, cached  ^ last, partly filled, private

Life of a sequence's blocks:
    get_computed_blocks(seq)      prefix hit: cached full blocks (no references taken yet)
    allocate_slots(seq, n, hit)   take the hit's blocks (+1 ref) and enough new blocks for n more tokens
    cache_full_blocks(seq)        after a step: hash blocks that became full and computed
    free(seq)                     -1 ref on every block; cached ones stay findable until reused
    trim(seq)                     release trailing blocks past its tokens (rejected speculative drafts' slots)
    fork(parent, child)           the child shares every block (+1 ref)
    take_blocks_to_copy()         the step's copy-on-write copies, (src, dst), for SchedulerOutput.blocks_to_copy
    swap_out(group) / swap_in(group)   move a whole group's blocks to the CPU pool and back (see swap.py)

Copy-on-write: after a fork, parent and child share even the partly filled last block. The first of them to
write into a shared block gets a fresh block, a pending copy (src -> dst) and the new id in its table; the
last holder writes in place. Full blocks are never written, so never copied:

    before:  parent [ b0 | b1 | b2: 2 of 4 ]   child [ b0 | b1 | b2 ]    b2 ref 2
    child allocate_slots(1):                   child [ b0 | b1 | b5 ]    copy (b2 -> b5); b2 ref 1, b5 ref 1

A pending copy holds one extra reference ("pin") on its source until the scheduler drains the list, so the
source cannot be reused before the runner copies it; a pin never counts as a sharer.
"""
from __future__ import annotations

from collections import Counter

from loraplex.engine.kv_cache.block_pool import BlockPool
from loraplex.engine.kv_cache.prefix_hash import BlockHash, hash_block_tokens
from loraplex.engine.kv_cache.swap import SwapSpace
from loraplex.engine.sequence import Sequence, SequenceGroup


class KVCacheManager:
    """Owns every sequence's ``block_ids``. Counters: ``prefix_cache_queries`` / ``prefix_cache_hits`` in
    tokens (hit rate = hits / queries), ``num_free_blocks``, ``usage``, ``num_cached_blocks``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.swap_space = SwapSpace(num_cpu_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._seqs: dict[int, Sequence] = {}                 # seq_id -> sequence holding blocks
        self._block_hashes: dict[int, list[BlockHash]] = {}  # seq_id -> hashes of its cached full blocks
        self._copies: list[tuple[int, int]] = []              # pending copy-on-write (src, dst) of this step
        self._pins: Counter[int] = Counter()                  # src block -> pending copies reading it
        self.num_cow_copies = 0                               # copies ever recorded (tests, metrics)

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
        if computed_blocks:
            if self._num_blocks_short(seq, num_new_tokens, computed_blocks) > 0:
                return False
            self.pool.touch(computed_blocks)  # prefix hit: out of the free queue before allocating new blocks
            seq.block_ids = list(computed_blocks)
            seq.num_computed_tokens = len(computed_blocks) * self.block_size
            self._block_hashes[seq.seq_id] = [self.pool.blocks[b].block_hash for b in computed_blocks]
            need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        else:
            # one pass over the written blocks serves the room check and the copies (_num_blocks_short's count)
            shared = self._shared_write_blocks(seq, num_new_tokens)
            need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
            if need + len(shared) > self.pool.num_free_blocks:
                return False
            if shared:
                self._copy_on_write(seq, shared)
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        self._seqs[seq.seq_id] = seq
        return True

    # ---- copy-on-write ---------------------------------------------------------------------------------
    def _sharers(self, block_id: int) -> int:
        """Block tables holding the block (its ref count without pending-copy pins)."""
        return self.pool.ref_cnt(block_id) - self._pins[block_id]

    def _shared_write_blocks(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices into ``seq.block_ids`` of blocks that the next ``num_new_tokens`` writes touch and that
        another table also holds."""
        if num_new_tokens <= 0 or not seq.block_ids:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min(self.num_blocks_for(seq.num_computed_tokens + num_new_tokens), len(seq.block_ids))
        blocks, table = self.pool.blocks, seq.block_ids
        # ref count = sharers + pins: a block with one reference has no other sharer (the common case, no lookup)
        return [i for i in range(first, last) if blocks[table[i]].ref_cnt > 1 and self._sharers(table[i]) > 1]

    def _copy_on_write(self, seq: Sequence, shared: list[int]) -> None:
        """Give ``seq`` a private copy of each block at the ``shared`` indices of its table (_shared_write_blocks)."""
        for i in shared:
            src = seq.block_ids[i]
            dst = self.pool.allocate(1)[0]
            if i * self.block_size < seq.num_computed_tokens:  # holds computed tokens: copy them
                self._copies.append((src, dst))
                self._pins[src] += 1
                self.pool.touch([src])
                self.num_cow_copies += 1
            self.pool.release([src])  # still held by the other sharers
            seq.block_ids[i] = dst

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The pending copy-on-write copies ``(src, dst)`` since the last call, and forget them (the scheduler
        drains this once at the end of ``schedule()`` into ``SchedulerOutput.blocks_to_copy``; the runner must
        copy before the forward pass)."""
        copies, self._copies = self._copies, []
        for src, _ in copies:
            self._unpin(src)
        return copies

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        return list(self._copies)

    def _unpin(self, src: int) -> None:
        self._pins[src] -= 1
        if not self._pins[src]:
            del self._pins[src]
        self.pool.release([src])

    def _drop_copies_into(self, block_ids: list[int]) -> None:
        """Forget pending copies whose destination was just freed (nothing will read it)."""
        dead = {b for b in block_ids if self.pool.ref_cnt(b) == 0}
        if not dead or not self._copies:
            return
        keep = []
        for src, dst in self._copies:
            if dst in dead:
                self._unpin(src)
            else:
                keep.append((src, dst))
        self._copies = keep

    def _num_blocks_short(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int]) -> int:
        num_computed = len(computed_blocks) * self.block_size if computed_blocks else seq.num_computed_tokens
        have = len(computed_blocks) if computed_blocks else len(seq.block_ids)
        need = self.num_blocks_for(num_computed + num_new_tokens) - have
        if not computed_blocks:
            need += len(self._shared_write_blocks(seq, num_new_tokens))
        # touching a free cached block takes it out of the free queue too
        free = self.pool.num_free_blocks - sum(self.pool.ref_cnt(b) == 0 for b in computed_blocks)
        return need - free

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its blocks go to the free queue tail-first (the prompt's head, most
        likely shared, is evicted last). Cached blocks stay findable until reused."""
        self._release_gpu(seq)
        self.swap_space.release(seq.seq_id)  # a swapped-out sequence: its CPU blocks

    def trim(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Release the trailing blocks of ``seq`` past the first ``num_tokens`` (default: its tokens), tail first:
        the slots speculative decoding allocated for drafts that were rejected. Blocks holding computed tokens
        are never released (``num_tokens`` is raised to ``num_computed_tokens``); released blocks carry no hash
        (only full computed blocks are cached)."""
        keep = self.num_blocks_for(max(seq.num_tokens if num_tokens is None else num_tokens, seq.num_computed_tokens))
        extra = seq.block_ids[keep:]
        if not extra:
            return
        del seq.block_ids[keep:]
        self.pool.release(list(reversed(extra)))
        self._drop_copies_into(extra)

    def _release_gpu(self, seq: Sequence) -> None:
        self.pool.release(list(reversed(seq.block_ids)))
        self._drop_copies_into(seq.block_ids)
        seq.block_ids = []
        self._seqs.pop(seq.seq_id, None)
        self._block_hashes.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (+1 reference each). The first write into a shared
        partly filled block copies it (``allocate_slots``, ``take_blocks_to_copy``). Parallel sampling and beam
        search fork this way; ``free(seq)`` releases a pruned beam."""
        if child.block_ids:
            raise ValueError(f"child sequence {child.seq_id} already has blocks")
        self.pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        self._block_hashes[child.seq_id] = list(self._block_hashes.get(parent.seq_id, []))
        self._seqs[child.seq_id] = child

    # ---- swapping --------------------------------------------------------------------------------------
    def _swappable(self, group: SequenceGroup) -> list[Sequence]:
        return [s for s in group.seqs if s.block_ids and not s.status.is_finished]

    def _gpu_tables(self, group: SequenceGroup) -> dict[int, list[int]]:
        """seq_id -> the blocks holding computed tokens (the rest hold nothing worth moving)."""
        return {s.seq_id: s.block_ids[:self.num_blocks_for(s.num_computed_tokens)] for s in self._swappable(group)}

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has a block for every distinct computed GPU block of the group's sequences."""
        need = len({b for t in self._gpu_tables(group).values() for b in t})
        return need <= self.swap_space.num_free_blocks and self.swap_space.pool is not None

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move every unfinished sequence of the group to the CPU pool (all or nothing): their GPU blocks are
        released (cached ones stay findable), ``num_computed_tokens`` is kept. Returns the distinct
        ``(gpu, cpu)`` copies for the runner. RuntimeError when ``can_swap_out`` is False. The caller sets the
        sequences' status to SWAPPED."""
        if not self.can_swap_out(group):
            raise RuntimeError(f"request {group.request_id!r} cannot be swapped out: CPU pool too small "
                               f"({self.swap_space.num_free_blocks} free); check can_swap_out first")
        tables = self._gpu_tables(group)
        src_of = {dst: src for src, dst in self._copies}  # a block still waiting for its CoW copy
        mapping = self.swap_space.store(tables)
        for s in self._swappable(group):
            self._release_gpu(s)  # also forgets pending copies into its blocks
        return [(src_of.get(g, g), c) for g, c in mapping]

    def can_swap_in(self, group: SequenceGroup, num_extra_blocks: int = 0) -> bool:
        """Whether the GPU pool has a block for every distinct CPU block of the group, plus
        ``num_extra_blocks`` (e.g. one per sequence for its next token)."""
        need = len({b for s in group.seqs for b in self.swap_space.tables.get(s.seq_id, [])})
        return need + num_extra_blocks <= self.pool.num_free_blocks

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Bring the group's swapped sequences back: fresh GPU blocks, sharing preserved, CPU blocks released,
        full blocks registered in the prefix cache again. Returns the distinct ``(cpu, gpu)`` copies.
        RuntimeError when ``can_swap_in`` is False. The caller sets the status back to RUNNING."""
        if not self.can_swap_in(group):
            raise RuntimeError(f"request {group.request_id!r} cannot be swapped in: "
                               f"{self.pool.num_free_blocks} GPU blocks free; check can_swap_in first")
        mapping: dict[int, int] = {}
        for s in group.seqs:
            cpu_table = self.swap_space.tables.get(s.seq_id)
            if cpu_table is None:
                continue
            if s.block_ids:
                raise RuntimeError(f"sequence {s.seq_id} is swapped out but holds GPU blocks {s.block_ids}")
            for c in cpu_table:
                if c in mapping:
                    self.pool.touch([mapping[c]])
                else:
                    mapping[c] = self.pool.allocate(1)[0]
            s.block_ids = [mapping[c] for c in cpu_table]
            self.swap_space.release(s.seq_id)
            self._seqs[s.seq_id] = s
            self.cache_full_blocks(s)
        return list(mapping.items())

    def is_swapped(self, seq: Sequence) -> bool:
        return self.swap_space.is_swapped(seq.seq_id)

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.swap_space.num_free_blocks

    # ---- checks ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless: each block's ref count == its occurrences in live block tables plus the
        pending copies reading it; free queue == blocks with ref 0; every table covers its computed tokens; the
        pool's index is consistent; the CPU pool's ref counts match the swapped tables."""
        counts = [0] * self.num_blocks
        for seq in self._seqs.values():
            if len(set(seq.block_ids)) != len(seq.block_ids):
                raise AssertionError(f"sequence {seq.seq_id} holds a block twice: {seq.block_ids}")
            if len(seq.block_ids) < self.num_blocks_for(seq.num_computed_tokens):
                raise AssertionError(f"sequence {seq.seq_id}: {seq.num_computed_tokens} computed tokens "
                                     f"but {len(seq.block_ids)} blocks")
            for b in seq.block_ids:
                counts[b] += 1
            if self.swap_space.is_swapped(seq.seq_id):
                raise AssertionError(f"sequence {seq.seq_id} holds GPU blocks and a CPU table at once")
        for src, dst in self._copies:
            if counts[dst] == 0:
                raise AssertionError(f"pending copy ({src} -> {dst}) into a block no table holds")
        for block in self.pool.blocks:
            pins = self._pins[block.block_id]
            if block.ref_cnt != counts[block.block_id] + pins:
                raise AssertionError(f"block {block.block_id}: ref count {block.ref_cnt}, but "
                                     f"{counts[block.block_id]} block tables hold it and {pins} copies read it")
        if sum(self._pins.values()) != len(self._copies):
            raise AssertionError(f"{sum(self._pins.values())} pins for {len(self._copies)} pending copies")
        self.pool.check_invariants()
        self.swap_space.check_invariants()
