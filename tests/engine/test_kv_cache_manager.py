from __future__ import annotations

import itertools

import pytest

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sequence import Sequence

BS = 4
_ids = itertools.count()


def seq(tokens, extra_key=None) -> Sequence:
    return Sequence(next(_ids), f"r{next(_ids)}", list(tokens), extra_key=extra_key)


def compute_all(kv: KVCacheManager, s: Sequence) -> None:
    """Allocate and 'run' the whole uncomputed part of ``s``, then register its full blocks."""
    assert kv.allocate_slots(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.cache_full_blocks(s)
    kv.check_invariants()


def test_allocate_free_ref_counts_and_usage():
    kv = KVCacheManager(8, BS)
    a = seq(range(10))
    assert kv.allocate_slots(a, 10)
    assert len(a.block_ids) == 3 and kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    assert all(kv.pool.ref_cnt(b) == 1 for b in a.block_ids)
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2)            # 12 tokens: still 3 blocks
    assert len(a.block_ids) == 3
    assert kv.allocate_slots(a, 3)            # 13 tokens: a 4th block
    assert len(a.block_ids) == 4 and kv.num_free_blocks == 4
    kv.check_invariants()
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 8 and kv.usage == 0.0
    kv.check_invariants()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(4, BS)
    a, b = seq(range(12)), seq(range(100, 108))
    assert kv.allocate_slots(a, 12)
    assert not kv.can_allocate(b, 8)
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.num_free_blocks == 1
    assert kv.can_allocate(b, 4) and kv.allocate_slots(b, 4)
    kv.check_invariants()
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0, got -1"):
        kv.allocate_slots(b, -1)


def test_prefix_hit_of_three_shared_blocks():
    kv = KVCacheManager(16, BS)
    shared = list(range(1, 13))               # 3 full blocks
    a = seq(shared + [50, 51, 52])
    assert kv.get_computed_blocks(a) == ([], 0)
    compute_all(kv, a)
    assert kv.num_cached_blocks == 3          # the 4th block is partial: not cached
    b = seq(shared + [60, 61])
    hit, n_hit = kv.get_computed_blocks(b)
    assert hit == a.block_ids[:3] and n_hit == 12
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (15 + 14, 12)
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 2, hit)
    assert b.num_computed_tokens == 12 and b.block_ids[:3] == hit and len(b.block_ids) == 4
    assert [kv.pool.ref_cnt(x) for x in hit] == [2, 2, 2]
    assert kv.num_free_blocks == free_before - 1
    kv.check_invariants()
    kv.free(a)
    assert [kv.pool.ref_cnt(x) for x in hit] == [1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 16 and kv.num_cached_blocks == 3
    kv.check_invariants()


def test_hit_never_covers_the_last_token():
    kv = KVCacheManager(8, BS)
    a = seq(range(12))                        # exactly 3 full blocks
    compute_all(kv, a)
    assert kv.num_cached_blocks == 3
    hit, n = kv.get_computed_blocks(seq(range(12)))
    assert n == 8 and hit == a.block_ids[:2]  # the last token must be computed to get logits
    hit, n = kv.get_computed_blocks(seq(range(13)))
    assert n == 12 and hit == a.block_ids


def test_freed_cached_blocks_are_reused_least_recently_freed_first():
    kv = KVCacheManager(5, BS)
    a, b = seq(range(0, 9)), seq(range(100, 109))  # 2 full blocks + 1 partial each
    compute_all(kv, a)
    kv.free(a)                                 # a's blocks are free but still cached
    compute_all(kv, b)                         # takes the 2 never-used blocks, then a's tail (freed first)
    assert kv.num_cached_blocks == 4
    hit, n = kv.get_computed_blocks(seq(range(0, 9)))
    assert n == 8, "a's full blocks must survive: b took the spare blocks and a's partial tail"
    kv.free(b)
    # free queue now: a's 2 cached blocks (freed first), then b's blocks tail-first
    queue = kv.pool.free_queue()
    assert queue[:2] == [hit[1], hit[0]]
    c = seq(range(200, 204))
    assert kv.allocate_slots(c, 4)
    assert c.block_ids == [hit[1]]             # least recently freed wins, and loses its hash
    assert kv.get_computed_blocks(seq(range(0, 9))) == ([hit[0]], 4)
    assert kv.get_computed_blocks(seq(range(100, 109)))[1] == 8  # b's blocks still findable
    kv.check_invariants()


def test_hit_on_free_cached_blocks_counts_them_when_checking_space():
    kv = KVCacheManager(3, BS)
    a = seq(range(8))
    compute_all(kv, a)
    kv.free(a)                                 # 3 free blocks, 2 of them cached
    b = seq(list(range(8)) + [9, 9, 9, 9, 9])  # hit 2 blocks + needs 2 new = 4 > 3
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.allocate_slots(b, 5, hit)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and kv.num_free_blocks == 3
    assert kv.allocate_slots(b, 4, hit)        # 2 + 1 = 3 fits
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_extra_key_separates_caches():
    kv = KVCacheManager(16, BS)
    prompt = list(range(1, 10))
    a = seq(prompt, extra_key="adapter-a")
    compute_all(kv, a)
    assert kv.get_computed_blocks(seq(prompt, extra_key="adapter-b")) == ([], 0)
    assert kv.get_computed_blocks(seq(prompt)) == ([], 0)  # base model
    assert kv.get_computed_blocks(seq(prompt, extra_key="adapter-a"))[1] == 8


def test_prefix_caching_off():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = seq(range(9))
    compute_all(kv, a)
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(seq(range(9))) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_decode_blocks_get_cached_as_they_fill():
    kv = KVCacheManager(8, BS)
    a = seq(range(6))
    compute_all(kv, a)
    assert kv.num_cached_blocks == 1
    for t in (6, 7):                             # two decode steps fill block 2
        a.append_token(t)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 2
    assert kv.get_computed_blocks(seq(range(9)))[1] == 8


def test_fork_shares_blocks():
    kv = KVCacheManager(8, BS)
    parent = seq(range(10))
    compute_all(kv, parent)
    child = Sequence(next(_ids), parent.request_id, parent.prompt_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert all(kv.pool.ref_cnt(b) == 2 for b in parent.block_ids)
    kv.check_invariants()
    with pytest.raises(ValueError, match="already has blocks"):
        kv.fork(parent, child)
    kv.free(parent)
    assert all(kv.pool.ref_cnt(b) == 1 for b in child.block_ids) and kv.num_free_blocks == 5
    kv.check_invariants()
    kv.free(child)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_check_invariants_detects_a_leaked_reference():
    kv = KVCacheManager(4, BS)
    a = seq(range(5))
    assert kv.allocate_slots(a, 5)
    kv.pool.touch([a.block_ids[0]])             # a reference nobody's table accounts for
    with pytest.raises(AssertionError, match=f"block {a.block_ids[0]}: ref count 2, but 1 block tables hold it"):
        kv.check_invariants()
