"""Scheduler rules for groups of sequences: admission bounds, settings, ending one sequence of a group, and
forked / beam groups under preemption (recompute, swap, auto) finishing exactly like an unconstrained run."""
from __future__ import annotations

import pytest

from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import SequenceGroup, SequenceStatus


def make(num_blocks=16, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, 4, num_cpu_blocks=8))


def group(rid, prompt_len=6, **params) -> SequenceGroup:
    return SequenceGroup.from_prompt(rid, list(range(1, prompt_len + 1)), SamplingParams(**params))


def test_add_counts_every_sequence_of_a_group_against_the_pool_and_max_num_seqs():
    sched = make(num_blocks=8, max_num_seqs=4)
    with pytest.raises(ValueError) as e:
        sched.add(group("wide", n=3, max_tokens=6, temperature=1.0))  # 3 x ceil(12 / 4) = 9 blocks > 8
    assert "needs up to 9 KV blocks (12 tokens for 3 sequences) but the cache has only 8" in str(e.value)
    with pytest.raises(ValueError, match=r"^best_of=5 asks for 5 sequences \(n / best_of / beam_width\) but this engine runs at most max_num_seqs=4 at once; lower best_of$"):
        sched.add(group("many", n=1, best_of=5, max_tokens=1, temperature=1.0))
    sched.add(group("ok", n=2, max_tokens=6, temperature=1.0))  # 6 blocks: fits
    assert sched.num_waiting == 1


def test_preemption_mode_is_validated():
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap, auto, got 'fast'"):
        SchedulerConfig(preemption_mode="fast")
    with pytest.raises(ValueError, match="preemption_mode 'fast' is not supported"):
        EngineConfig(model="x", preemption_mode="fast")
    with pytest.raises(ValueError, match="num_cpu_blocks must be None or an integer >= 0, got -1"):
        EngineConfig(model="x", num_cpu_blocks=-1)


def test_fork_step_then_finish_one_sequence_by_stop_string():
    sched = make()
    g = group("par", n=3, max_tokens=5, temperature=1.0)
    sched.add(g)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.sample and s.num_samples == 3 and not s.beam
    sched.update(out, {s.seq.seq_id: [10, 11, 12]})
    assert [q.output_token_ids for q in g.seqs] == [[10], [11], [12]]
    assert sched.num_running == 3 and all(q.block_ids == g.seqs[0].block_ids for q in g.seqs)
    out = sched.schedule()
    assert [x.num_samples for x in out.scheduled] == [1, 1, 1]
    assert len(out.blocks_to_copy) == 2  # the shared partial prompt block, copied for all but the last writer
    assert sched.finish_seq(g.seqs[1], SequenceStatus.FINISHED_STOPPED) is None  # others still run
    assert g.seqs[1].block_ids == [] and sched.num_running == 2
    with pytest.raises(ValueError, match="finish_seq needs a finished status, got RUNNING"):
        sched.finish_seq(g.seqs[0], SequenceStatus.RUNNING)
    sched.update(out, {g.seqs[0].seq_id: 20, g.seqs[2].seq_id: 22})  # the stopped one's token is ignored
    assert g.seqs[1].output_token_ids == [11]
    assert sched.finish_seq(g.seqs[0], SequenceStatus.FINISHED_STOPPED) is None
    assert sched.finish_seq(g.seqs[2], SequenceStatus.FINISHED_STOPPED) is g
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_invariants()


# ---- groups under pressure, driven by a fake model --------------------------------------------------------
VOCAB = 500


def fake_token(token_ids: list[int], j: int = 0) -> int:
    """The 'model': a function of the whole stream (plus the draw index at a fork), never EOS (0)."""
    return 1 + (sum((i + 1) * t for i, t in enumerate(token_ids)) * 7919 + 31 * j) % (VOCAB - 1)


def fake_logprobs(token_ids: list[int]):
    """A beam's next-token log-probs [V], a function of its stream only."""
    import torch

    g = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(token_ids)) % 2**31)
    return torch.log_softmax(torch.randn(VOCAB, generator=g) * 3, -1)


def drive(sched: Scheduler) -> dict[str, list[list[int]]]:
    """Run to completion, checking every step like the runner would; returns each request's outputs."""
    done = {}
    for _ in range(5000):
        if not sched.has_unfinished():
            return {rid: [h.output_token_ids for h in g.beam_search.best(g.sampling_params.n)] if g.beam_search
                    else [s.output_token_ids for s in g.seqs] for rid, g in done.items()}
        out = sched.schedule()
        assert out.scheduled or out.blocks_to_swap_out, "scheduler stalled"
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in)
        sampled, rows = {}, {}
        for s in out.scheduled:
            assert s.num_new_tokens >= 1 and len(s.block_ids) * 4 >= s.seq.num_computed_tokens + s.num_new_tokens
            if s.sample and s.beam:
                rows[s.seq.seq_id] = fake_logprobs(s.seq.all_token_ids)
            elif s.sample:
                h = s.seq.all_token_ids
                sampled[s.seq.seq_id] = [fake_token(h, j) for j in range(s.num_samples)]
        for g in sched.update(out, sampled, beam_logprobs=rows):
            done[g.request_id] = g
        sched.kv.check_invariants()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_forked_groups_under_pressure_finish_like_an_unconstrained_run(mode, seed):
    import random

    rng = random.Random(seed)
    # (request id, prompt length, n, max_tokens, beam search)
    specs = [(f"r{i}", rng.randint(3, 14), rng.choice([1, 1, 2, 3]), rng.randint(2, 9), rng.random() < 0.3)
             for i in range(8)]

    def run(num_blocks, num_cpu_blocks):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, preemption_mode=mode, eos_token_ids=[0]),
                          KVCacheManager(num_blocks, 4, num_cpu_blocks=num_cpu_blocks))
        for k, (rid, plen, n, mt, beam) in enumerate(specs):
            prompt = [1 + (97 * k + 13 * i) % (VOCAB - 1) for i in range(plen)]
            params = (SamplingParams(n=n, max_tokens=mt, use_beam_search=True, beam_width=n + 1) if beam
                      else SamplingParams(n=n, max_tokens=mt, temperature=1.0))
            sched.add(SequenceGroup.from_prompt(rid, prompt, params, arrival_time=float(k)))
        result = drive(sched)
        assert sched.kv.num_free_blocks == num_blocks and sched.kv.num_free_cpu_blocks == num_cpu_blocks
        return sched, result

    _, expected = run(256, 0)
    sched, got = run(18, 40)
    assert sched.num_preemptions > 0
    if mode == "recompute":
        assert sched.num_swap_outs == 0
    if mode == "swap":
        assert sched.num_swap_outs > 0
    assert got == expected
    assert all(len(got[rid]) == n for rid, _, n, _, _ in specs)
    assert any(beam for *_, beam in specs) and any(n > 1 and not beam for _, _, n, _, beam in specs)
