"""Scheduler tests, driven by a fake model that samples deterministic tokens."""
from __future__ import annotations

import itertools

import pytest

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.scheduler_output import SchedulerOutput
from loraplex.engine.sequence import SequenceGroup, SequenceStatus

VOCAB = 1000
EOS = 0
_ids = itertools.count()


def fake_next_token(token_ids: list[int]) -> int:
    """The 'model': a function of the whole stream, so a sequence recomputed after preemption must continue
    exactly as it would have. Never EOS."""
    return 1 + (sum((i + 1) * t for i, t in enumerate(token_ids)) * 7919) % (VOCAB - 1)


def step(sched: Scheduler, out: SchedulerOutput, override: dict[str, int] | None = None) -> list[SequenceGroup]:
    """Check the step the way the model runner would use it, sample where asked, update."""
    sampled = {}
    for s in out.scheduled:
        assert s.num_new_tokens >= 1
        assert s.seq.num_computed_tokens + s.num_new_tokens <= s.seq.num_tokens
        assert s.block_ids == s.seq.block_ids
        assert len(s.block_ids) * sched.kv.block_size >= s.seq.num_computed_tokens + s.num_new_tokens
        assert s.sample == (s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens)
        if s.sample:
            tok = fake_next_token(s.seq.all_token_ids)
            sampled[s.seq.seq_id] = (override or {}).get(s.seq.request_id, tok)
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    assert out.blocks_to_copy == []
    return sched.update(out, sampled)


def run(sched: Scheduler, max_steps: int = 5000):
    finished, outputs = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished, outputs
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with unfinished requests"
        outputs.append(out)
        finished += step(sched, out)
        sched.kv.check_invariants()
    raise AssertionError("requests did not finish")


def group(prompt, max_tokens=4, arrival=None, adapter=None, extra_key=None, rid=None, **params) -> SequenceGroup:
    rid = rid or f"req-{next(_ids)}"
    return SequenceGroup.from_prompt(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                                     arrival_time=float(next(_ids)) if arrival is None else arrival,
                                     adapter=adapter, extra_key=extra_key)


def make(num_blocks=64, block_size=4, prefix_caching=True, can_admit=None, **cfg) -> Scheduler:
    cfg.setdefault("eos_token_ids", [EOS])
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size, prefix_caching),
                     can_admit=can_admit)


def expected_output(prompt, max_tokens):
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(fake_next_token(toks))
    return toks[len(prompt):]


# ---- config and add() --------------------------------------------------------------------------------------
def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_loras must be None"):
        SchedulerConfig(max_loras=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) must be >= max_model_len \(1024\)"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024)


def test_add_errors():
    sched = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="request 'e' has an empty prompt"):
        sched.add(group([], rid="e"))
    with pytest.raises(ValueError) as e:
        sched.add(group(range(32)))
    assert "prompt of 32 tokens" in str(e.value) and "max_model_len=32" in str(e.value)
    with pytest.raises(ValueError) as e:
        sched.add(group(range(10), max_tokens=10))      # 20 tokens = 5 blocks > 4
    assert "needs up to 5 KV blocks (20 tokens) but the cache has only 4" in str(e.value)
    sched.add(group(range(10), max_tokens=6, rid="ok"))  # 16 tokens = 4 blocks: fits
    with pytest.raises(ValueError, match="request id 'ok' is already in flight"):
        sched.add(group(range(3), rid="ok"))
    assert sched.num_waiting == 1 and sched.num_running == 0


# ---- policy ----------------------------------------------------------------------------------------------
def test_runs_to_completion_with_expected_tokens():
    sched = make()
    groups = [group(range(1, 1 + n), max_tokens=m) for n, m in ((5, 3), (9, 1), (13, 6))]
    for g in groups:
        sched.add(g)
    finished, _ = run(sched)
    assert {g.request_id for g in finished} == {g.request_id for g in groups}
    for g in groups:
        assert g.seq.output_token_ids == expected_output(g.seq.prompt_token_ids, g.sampling_params.max_tokens)
        assert g.seq.status is SequenceStatus.FINISHED_LENGTH and g.seq.finish_reason == "length"
        assert g.first_token_time is not None and g.finished_time >= g.first_token_time
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_chunked_prefill_splits_under_the_token_budget():
    sched = make(max_num_batched_tokens=8)
    a, b = group(range(1, 21), max_tokens=2), group(range(100, 106), max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [(a.request_id, 8, False)]
    step(sched, out)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [(a.request_id, 8, False)]
    step(sched, out)
    out = sched.schedule()  # a's last 4 tokens, then b's first 4 share the budget
    assert [(s.seq.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        (a.request_id, 4, True), (b.request_id, 4, False)]
    step(sched, out)
    out = sched.schedule()  # a decodes first, then b finishes its prefill
    assert [(s.seq.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        (a.request_id, 1, True), (b.request_id, 2, True)]
    step(sched, out)
    run(sched)
    assert a.seq.output_token_ids == expected_output(range(1, 21), 2)
    assert b.seq.output_token_ids == expected_output(range(100, 106), 2)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    a, b = group(range(1, 11), max_tokens=3), group(range(50, 60), max_tokens=3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [(a.request_id, 10)]
    step(sched, out)
    out = sched.schedule()  # 1 decode + 10 > 16? no: 11 fits
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [(a.request_id, 1), (b.request_id, 10)]
    step(sched, out)
    run(sched)
    assert b.seq.output_token_ids == expected_output(range(50, 60), 3)


def test_decodes_come_first_and_keep_their_token():
    sched = make(max_num_batched_tokens=6)
    a, b = group(range(1, 4), max_tokens=5), group(range(10, 13), max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched, sched.schedule())  # both prefills (3 + 3)
    long = group(range(200, 230), max_tokens=2)
    sched.add(long)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        (a.request_id, 1), (b.request_id, 1), (long.request_id, 4)]
    step(sched, out)
    out = sched.schedule()  # the running prefill chunk comes after earlier arrivals' decodes
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        (a.request_id, 1), (b.request_id, 1), (long.request_id, 4)]


def test_max_num_seqs_limits_admission():
    sched = make(max_num_seqs=2)
    gs = [group(range(i * 10 + 1, i * 10 + 4), max_tokens=3) for i in range(3)]
    for g in gs:
        sched.add(g)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == [gs[0].request_id, gs[1].request_id]
    assert sched.num_running == 2 and sched.num_waiting == 1
    run(sched)
    assert gs[2].seq.output_token_ids == expected_output(gs[2].seq.prompt_token_ids, 3)


def test_prefix_hit_sets_computed_tokens():
    sched = make(block_size=4)
    shared = list(range(1, 13))
    first = group(shared + [90], max_tokens=2)
    sched.add(first)
    run(sched)
    second = group(shared + [91, 92], max_tokens=2)
    sched.add(second)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 2 and second.seq.num_computed_tokens == 12
    assert sched.kv.prefix_cache_hits == 12
    step(sched, out)
    run(sched)
    assert second.seq.output_token_ids == expected_output(shared + [91, 92], 2)


# ---- preemption ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_recompute_in_a_tiny_pool(prefix_caching):
    sched = make(num_blocks=6, block_size=4, max_num_batched_tokens=8, prefix_caching=prefix_caching)
    groups = [group(range(10 * i + 1, 10 * i + 1 + n), max_tokens=m)
              for i, (n, m) in enumerate(((7, 10), (5, 12), (9, 8), (6, 14), (3, 9)))]
    for g in groups:
        sched.add(g)
    finished, outputs = run(sched)
    preempted = [rid for o in outputs for rid in o.preempted]
    assert preempted, "the pool is too small for all of them: someone must be preempted"
    assert sched.num_preemptions == len(preempted)
    assert groups[0].request_id not in preempted  # the earliest arrival is never the victim
    assert sorted(g.request_id for g in finished) == sorted(g.request_id for g in groups)
    for g in groups:  # recompute gives exactly the tokens an undisturbed run gives
        assert g.seq.output_token_ids == expected_output(g.seq.prompt_token_ids, g.sampling_params.max_tokens)
    assert sched.kv.num_free_blocks == 6 and sched.kv.usage == 0.0
    assert not sched.has_unfinished()


def test_preempted_request_goes_to_the_front_and_keeps_outputs():
    sched = make(num_blocks=4, block_size=4)
    a, b = group(range(1, 7), max_tokens=9), group(range(20, 26), max_tokens=9)
    sched.add(a)
    sched.add(b)
    c = group(range(40, 43), max_tokens=1)
    sched.add(c)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == [a.request_id, b.request_id]  # c: no blocks left
    step(sched, out)
    for _ in range(3):
        out = sched.schedule()
        step(sched, out)
        if out.preempted:
            break
    assert out.preempted == [b.request_id]
    assert b.seq.status is SequenceStatus.WAITING and b.seq.num_computed_tokens == 0 and b.seq.block_ids == []
    assert b.seq.num_output_tokens >= 1
    assert list(sched.waiting)[:2] == [b.seq, c.seq]
    run(sched)
    assert b.seq.output_token_ids == expected_output(range(20, 26), 9)


def test_two_sequences_contending_for_a_pool_that_fits_one():
    sched = make(num_blocks=3, block_size=4)
    a, b = group(range(1, 5), max_tokens=8), group(range(10, 14), max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    step(sched, out)                       # 2 blocks each would be needed soon; pool has 3
    preempted = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert not {s.seq.request_id for s in out.scheduled} & set(out.preempted)
        preempted += out.preempted
        step(sched, out)
        sched.kv.check_invariants()
    assert preempted and set(preempted) == {b.request_id}  # b, the later arrival, asks last and preempts itself
    assert a.seq.output_token_ids == expected_output(range(1, 5), 8)
    assert b.seq.output_token_ids == expected_output(range(10, 14), 8)
    assert sched.kv.num_free_blocks == 3


# ---- stopping and abort ----------------------------------------------------------------------------------
def test_stop_conditions():
    sched = make(max_model_len=12)
    eos, eos_ignored, stop, length = (group(range(1, 4), max_tokens=5), group(range(1, 4), max_tokens=3, ignore_eos=True),
                                     group(range(1, 4), max_tokens=5, stop_token_ids=[777]),
                                     group(range(1, 10), max_tokens=50))
    for g in (eos, eos_ignored, stop, length):
        sched.add(g)
    override = {eos.request_id: EOS, eos_ignored.request_id: EOS, stop.request_id: 777}
    finished = []
    while sched.has_unfinished():
        finished += step(sched, sched.schedule(), override)
    assert eos.seq.output_token_ids == [EOS] and eos.seq.finish_reason == "stop"
    assert eos_ignored.seq.output_token_ids == [EOS] * 3 and eos_ignored.seq.finish_reason == "length"
    assert stop.seq.output_token_ids == [777] and stop.seq.status is SequenceStatus.FINISHED_STOPPED
    assert length.seq.num_tokens == 12 and length.seq.finish_reason == "length"  # max_model_len
    assert len(finished) == 4 and all(g.is_finished() for g in finished)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_abort_frees_at_once_wherever_the_request_is():
    sched = make(num_blocks=8, max_num_seqs=1)
    running, waiting = group(range(1, 10), max_tokens=5), group(range(20, 30), max_tokens=5)
    sched.add(running)
    sched.add(waiting)
    out = sched.schedule()
    assert sched.kv.num_free_blocks == 5
    assert sched.abort(running.request_id)
    assert sched.kv.num_free_blocks == 8 and sched.num_running == 0
    assert running.seq.finish_reason == "abort" and running.is_finished() and running.finished_time is not None
    assert sched.update(out, {running.seq.seq_id: 5}) == []  # a step already in flight for it is ignored
    assert running.seq.output_token_ids == []
    assert sched.abort(waiting.request_id) and sched.num_waiting == 0
    assert not sched.abort(waiting.request_id) and not sched.abort("nope")
    assert not sched.has_unfinished()
    sched.kv.check_invariants()


# ---- admission hooks (multi-LoRA) --------------------------------------------------------------------------
def test_max_loras_limits_distinct_adapters_running():
    sched = make(max_loras=1)
    lora_a, lora_b = object(), object()
    a1, b1, base, a2 = (group(range(1, 4), max_tokens=3, adapter=lora_a), group(range(1, 4), max_tokens=2, adapter=lora_b),
                        group(range(1, 4), max_tokens=2), group(range(5, 8), max_tokens=3, adapter=lora_a))
    for g in (a1, b1, base, a2):
        sched.add(g)
    out = sched.schedule()
    # b1 is skipped (a second adapter) but keeps its place; base costs no adapter slot
    assert [s.seq.request_id for s in out.scheduled] == [a1.request_id, base.request_id, a2.request_id]
    assert list(sched.waiting) == [b1.seq]
    seen = []
    while sched.has_unfinished():
        out = sched.schedule()
        adapters = {id(sched.get_group(s.seq.request_id).adapter) for s in out.scheduled
                    if sched.get_group(s.seq.request_id).adapter is not None}
        assert len(adapters) <= 1
        seen += [s.seq.request_id for s in out.scheduled]
        step(sched, out)
    assert b1.request_id in seen and b1.seq.output_token_ids == expected_output(range(1, 4), 2)


def test_can_admit_hook_skips_without_losing_place():
    ready: set[str] = set()
    sched = make(can_admit=lambda g: g.request_id in ready)
    a, b = group(range(1, 4), rid="a"), group(range(5, 8), rid="b")
    sched.add(a)
    sched.add(b)
    ready.add("b")
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["b"] and list(sched.waiting) == [a.seq]
    ready.add("a")
    step(sched, out)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["b", "a"]


def test_same_prompt_two_adapters_do_not_share_cache():
    sched = make(block_size=4)
    prompt = list(range(1, 14))
    sched.add(group(prompt, max_tokens=1, adapter="A", extra_key="A"))
    run(sched)
    other = group(prompt, max_tokens=1, adapter="B", extra_key="B")
    sched.add(other)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 13 and sched.kv.prefix_cache_hits == 0


def test_a_request_blocked_for_several_steps_is_counted_once_in_prefix_stats():
    sched = make(num_blocks=4, block_size=4)
    a, b = group(range(1, 14), max_tokens=3), group(range(1, 4), max_tokens=1)
    sched.add(a)
    sched.add(b)
    _, outputs = run(sched)
    assert [s.seq.request_id for s in outputs[0].scheduled] == [a.request_id]  # b waits: no block left
    assert len(outputs) >= 4
    assert sched.kv.prefix_cache_queries == 13 + 3 and sched.kv.prefix_cache_hits == 0
