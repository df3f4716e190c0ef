"""Copy-on-write after forks (parallel sampling, beams) and swapping whole groups to the CPU pool."""
from __future__ import annotations

import itertools

import pytest

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_cache.swap import choose_preemption_mode
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence, SequenceGroup

BS = 4
_ids = itertools.count(1000)


def prefilled(kv: KVCacheManager, tokens, request_id="r") -> SequenceGroup:
    g = SequenceGroup(request_id, [Sequence(next(_ids), request_id, list(tokens))], SamplingParams(n=4, seed=0))
    assert kv.allocate_slots(g.seq, len(tokens))
    g.seq.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(g.seq)
    return g


def fork_n(kv: KVCacheManager, g: SequenceGroup, n: int) -> list[Sequence]:
    parent = g.seq
    for _ in range(n - 1):
        child = parent.fork(next(_ids))
        kv.fork(parent, child)
        g.add_seq(child)
    return g.seqs


def decode_step(kv: KVCacheManager, seqs: list[Sequence], tokens: list[int]) -> list[tuple[int, int]]:
    """Each sequence appends a token and gets a slot for it; the step's copies are drained like the scheduler."""
    for s, t in zip(seqs, tokens):
        s.append_token(t)
        assert kv.allocate_slots(s, 1)
    kv.check_invariants()
    copies = kv.take_blocks_to_copy()
    for s in seqs:
        s.num_computed_tokens += 1
        kv.cache_full_blocks(s)
    kv.check_invariants()
    return copies


def test_n4_fork_shares_the_prompt_and_copies_only_the_last_partial_block():
    kv = KVCacheManager(32, BS)
    g = prefilled(kv, range(1, 11))           # 10 tokens: 2 full blocks + 1 block holding 2 tokens
    seqs = fork_n(kv, g, 4)
    prompt_blocks = list(g.seq.block_ids)
    assert all(s.block_ids == prompt_blocks for s in seqs)
    assert [kv.pool.ref_cnt(b) for b in prompt_blocks] == [4, 4, 4]
    kv.check_invariants()

    copies = decode_step(kv, seqs, [50, 51, 52, 53])
    last = prompt_blocks[-1]
    assert len(copies) == 3 and all(src == last for src, _ in copies)  # the 4th writer writes in place
    assert len({dst for _, dst in copies}) == 3
    assert [kv.pool.ref_cnt(b) for b in prompt_blocks[:2]] == [4, 4]   # full prompt blocks: shared, never copied
    assert kv.pool.ref_cnt(last) == 1
    assert sorted(s.block_ids[-1] for s in seqs) == sorted([last] + [d for _, d in copies])
    assert kv.num_cow_copies == 3

    # memory: 2 shared + 4 private last blocks, against 4 independent requests of 3 blocks each
    used = kv.num_blocks - kv.num_free_blocks
    independent = 4 * kv.num_blocks_for(11)
    print(f"n=4 fork: {used} blocks in use vs {independent} for four independent requests")
    assert independent - used >= 2 * 3  # at least the shared full prompt blocks, saved three times
    assert decode_step(kv, seqs, [1, 2, 3, 4]) == []  # private blocks now: no more copies
    for s in seqs:
        kv.free(s)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_full_shared_blocks_are_never_copied():
    kv = KVCacheManager(16, BS)
    g = prefilled(kv, range(1, 9))            # exactly 2 full blocks
    seqs = fork_n(kv, g, 3)
    assert decode_step(kv, seqs, [7, 8, 9]) == []
    assert len({s.block_ids[-1] for s in seqs}) == 3 and all(kv.pool.ref_cnt(b) == 3 for b in seqs[0].block_ids[:2])


def test_copy_needs_a_free_block_and_failure_changes_nothing():
    kv = KVCacheManager(3, BS)
    g = prefilled(kv, range(1, 11))           # all 3 blocks used
    a, b = fork_n(kv, g, 2)
    b.append_token(5)
    assert not kv.can_allocate(b, 1) and not kv.allocate_slots(b, 1)
    assert b.block_ids == a.block_ids and kv.pending_copies == []
    kv.check_invariants()


def test_pending_copy_pins_its_source_and_a_freed_destination_drops_the_copy():
    kv = KVCacheManager(8, BS)
    g = prefilled(kv, range(1, 7))            # 1 full + 1 partial block
    a, b = fork_n(kv, g, 2)
    src = a.block_ids[-1]
    a.append_token(9)
    assert kv.allocate_slots(a, 1)
    (s, dst), = kv.pending_copies
    assert s == src
    kv.free(b)                                 # the other sharer leaves before the runner copied
    assert kv.pool.ref_cnt(src) == 1 and not kv.pool.is_free(src)  # pinned until drained
    kv.check_invariants()
    assert kv.take_blocks_to_copy() == [(src, dst)] and kv.pool.is_free(src)
    kv.check_invariants()
    # a copy whose destination is freed in the same step is forgotten (and unpins its source)
    c = a.fork(next(_ids))
    kv.fork(a, c)
    assert kv.allocate_slots(c, 1) and len(kv.pending_copies) == 1
    kv.free(c)
    assert kv.pending_copies == [] and kv.take_blocks_to_copy() == []
    kv.check_invariants()


def test_swap_round_trip_preserves_sharing_and_frees_both_pools():
    kv = KVCacheManager(16, BS, num_cpu_blocks=8)
    g = prefilled(kv, range(1, 11))
    seqs = fork_n(kv, g, 3)
    decode_step(kv, seqs, [40, 41, 42])        # 2 shared full blocks + 3 private last blocks
    tables = {s.seq_id: list(s.block_ids) for s in seqs}
    assert kv.can_swap_out(g)
    out = kv.swap_out(g)
    kv.check_invariants()
    assert len(out) == 5 and len({c for _, c in out}) == 5          # 5 distinct GPU blocks -> 5 CPU blocks
    assert kv.num_free_blocks == 16 and kv.num_free_cpu_blocks == 3 and all(not s.block_ids for s in seqs)
    gpu_to_cpu = dict(out)
    shared_cpu = gpu_to_cpu[tables[seqs[0].seq_id][0]]
    assert kv.swap_space.pool.ref_cnt(shared_cpu) == 3
    assert all(kv.is_swapped(s) and s.num_computed_tokens == 11 for s in seqs)

    assert kv.can_swap_in(g, num_extra_blocks=3)
    back = kv.swap_in(g)
    kv.check_invariants()
    assert len(back) == 5 and kv.num_free_cpu_blocks == 8
    cpu_to_gpu = dict(back)
    for s in seqs:  # each sequence's table maps block for block through the CPU and back
        assert s.block_ids == [cpu_to_gpu[gpu_to_cpu[b]] for b in tables[s.seq_id]]
    assert kv.pool.ref_cnt(seqs[0].block_ids[0]) == 3 and seqs[0].block_ids[:2] == seqs[2].block_ids[:2]
    assert decode_step(kv, seqs, [1, 2, 3]) == []  # private last blocks (3 of 4 filled): written in place
    for s in seqs:
        kv.free(s)
    kv.check_invariants()
    assert kv.num_free_blocks == 16 and kv.num_free_cpu_blocks == 8


def test_swap_is_all_or_nothing_and_abort_frees_cpu_blocks():
    kv = KVCacheManager(16, BS, num_cpu_blocks=2)
    g = prefilled(kv, range(1, 11))           # 3 blocks > 2 CPU blocks
    assert not kv.can_swap_out(g)
    with pytest.raises(RuntimeError, match="cannot be swapped out: CPU pool too small"):
        kv.swap_out(g)
    assert len(g.seq.block_ids) == 3 and kv.num_free_cpu_blocks == 2
    kv.check_invariants()
    assert not KVCacheManager(4, BS).can_swap_out(g)  # no CPU pool at all

    kv2 = KVCacheManager(4, BS, num_cpu_blocks=4)
    h = prefilled(kv2, range(1, 7))
    kv2.swap_out(h)
    filler = prefilled(kv2, range(100, 113), "filler")  # takes 4 blocks: no room to swap back
    assert not kv2.can_swap_in(h)
    with pytest.raises(RuntimeError, match="cannot be swapped in"):
        kv2.swap_in(h)
    kv2.free(filler.seq)
    kv2.free(h.seq)                            # abort while swapped: CPU blocks released
    kv2.check_invariants()
    assert kv2.num_free_cpu_blocks == 4 and kv2.num_free_blocks == 4


def test_swap_out_reads_a_pending_copys_source():
    kv = KVCacheManager(16, BS, num_cpu_blocks=8)
    g = prefilled(kv, range(1, 7))
    a, b = fork_n(kv, g, 2)
    b.append_token(3)
    assert kv.allocate_slots(b, 1)            # b's last block waits for its copy from a's
    (src, dst), = kv.pending_copies
    out = dict(kv.swap_out(g))
    assert src in out and dst not in out      # the data still lives in src
    assert kv.pending_copies == []
    kv.check_invariants()


@pytest.mark.parametrize("mode, seqs, tokens, room, expected", [
    ("recompute", 4, 5000, True, "recompute"),
    ("swap", 1, 10, True, "swap"),
    ("swap", 1, 10, False, "recompute"),      # no CPU room: fall back rather than stall
    ("auto", 4, 10, True, "swap"),            # forked sequences keep their sharing
    ("auto", 1, 10, True, "recompute"),       # short: a prefill is cheaper than a PCIe round trip
    ("auto", 1, 2048, True, "swap"),
    ("auto", 4, 2048, False, "recompute"),
])
def test_choose_preemption_mode(mode, seqs, tokens, room, expected):
    assert choose_preemption_mode(mode, num_seqs=seqs, num_computed_tokens=tokens, can_swap_out=room) == expected


def test_choose_preemption_mode_rejects_unknown_modes():
    with pytest.raises(ValueError, match="preemption mode must be one of recompute, swap, auto, got 'fast'"):
        choose_preemption_mode("fast", num_seqs=1, num_computed_tokens=1, can_swap_out=True)
