from __future__ import annotations

import pytest

from loraplex.engine.kv_cache import BlockPool, hash_block_tokens, hash_full_blocks


def test_allocate_and_release_ref_counts():
    pool = BlockPool(4, 2)
    assert pool.num_free_blocks == 4
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    assert [pool.ref_cnt(b) for b in range(4)] == [1, 1, 1, 0]
    pool.touch([1])
    assert pool.ref_cnt(1) == 2
    pool.release([1, 2])
    assert pool.ref_cnt(1) == 1 and pool.ref_cnt(2) == 0 and pool.is_free(2)
    assert pool.num_free_blocks == 2
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="block 2 released with ref count 0"):
        pool.release([2])
    with pytest.raises(RuntimeError, match="asked for 3 blocks, 2 free"):
        pool.allocate(3)


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        BlockPool(4, 0)


def test_free_queue_is_lru_and_allocation_evicts_hash():
    pool = BlockPool(4, 2)
    a, b, c, d = pool.allocate(4)
    h1, h2 = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    assert pool.cache(b, h1) and pool.cache(c, h2)
    pool.release([c, a, b, d])  # freed in this order
    assert pool.free_queue() == [c, a, b, d]
    assert pool.lookup(h1) == b and pool.lookup(h2) == c and pool.num_cached_blocks == 2  # still findable
    pool.touch([b])  # prefix hit on a free cached block takes it out of the queue
    assert pool.free_queue() == [c, a, d] and pool.ref_cnt(b) == 1
    assert pool.allocate(1) == [c]  # least recently freed first, and it loses its hash
    assert pool.lookup(h2) is None and pool.blocks[c].block_hash is None
    assert pool.lookup(h1) == b and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_cache_refuses_duplicates():
    pool = BlockPool(3, 2)
    a, b, _ = pool.allocate(3)
    h = hash_block_tokens(None, [5, 6])
    assert pool.cache(a, h)
    assert not pool.cache(b, h)  # same tokens computed twice: the first block stays the cached one
    assert not pool.cache(a, hash_block_tokens(None, [7, 8]))  # a block has one hash
    assert pool.lookup(h) == a and pool.blocks[b].block_hash is None
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(3, 2)
    pool.allocate(1)
    pool.blocks[0].ref_cnt = 0  # in use per the queue, unreferenced per the count
    with pytest.raises(AssertionError, match="block 0: ref count 0 but not in the free queue"):
        pool.check_invariants()


def test_hashes_chain_and_salt():
    toks = list(range(8))
    hs = hash_full_blocks(toks, 4)
    assert len(hs) == 2 and hs[0] == hash_block_tokens(None, toks[:4]) and hs[1] == hash_block_tokens(hs[0], toks[4:])
    # same block content after a different prefix: different hash
    assert hash_full_blocks([9, 9, 9, 9] + toks[4:], 4)[1] != hs[1]
    assert hash_full_blocks(toks, 4, extra_key="adapter-a")[0] != hs[0]
    assert hash_full_blocks(toks, 4, extra_key="adapter-a") == hash_full_blocks(toks, 4, extra_key="adapter-a")
    assert len(hash_full_blocks(toks[:7], 4)) == 1  # partial blocks are never hashed

    class Handle:  # an opaque adapter object: identity
        pass
    h1, h2 = Handle(), Handle()
    assert hash_block_tokens(None, toks[:4], h1) != hash_block_tokens(None, toks[:4], h2)
    assert hash_block_tokens(None, toks[:4], h1) == hash_block_tokens(None, toks[:4], h1)
