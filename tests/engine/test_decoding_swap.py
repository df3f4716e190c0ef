"""Preemption with a KV pool too small for the running set: swap mode moves whole sequence groups to the CPU
pool and back, recompute mode drops and recomputes them; both finish every request with the output of an
unconstrained run and leave both pools empty."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.sequence import SequenceStatus

BS = 4
LENS = (6, 11, 15, 19, 9, 13)


def make_engine(path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=BS, progress=False,
                                     max_num_batched_tokens=64, **kw)


def workload(vocab: int):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENS]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    parallel = SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)  # forked groups
    return prompts, [parallel if i % 2 else greedy for i in range(len(prompts))]


def run(engine: LLMEngine, prompts, params, spy=None) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = [c.output_token_ids for c in o.outputs]
        engine.kv_cache.check_invariants()
    return final


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    engine = make_engine(path, num_kv_blocks=256)
    prompts, params = workload(engine.model_config.vocab_size)
    return path, prompts, params, run(engine, prompts, params)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tight_pool_matches_unconstrained_run(reference, mode):
    path, prompts, params, expected = reference
    engine = make_engine(path, num_kv_blocks=20, num_cpu_blocks=64, preemption_mode=mode)
    swapped_groups: list[tuple[str, int]] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        for g in engine.scheduler.swapped:
            if g.request_id in out.preempted:  # swapped out in this step: every live sequence of the group
                live = g.unfinished_seqs()
                assert all(s.status is SequenceStatus.SWAPPED and not s.block_ids for s in live)
                swapped_groups.append((g.request_id, len(live)))
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in)  # never both in one step
        return out

    engine.scheduler.schedule = spy
    got = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the pool was not small enough to preempt"
    if mode == "swap":
        assert engine.scheduler.num_swap_outs == engine.scheduler.num_preemptions > 0
        assert any(n > 1 for _, n in swapped_groups), "no forked group was swapped as a whole"
    else:
        assert engine.scheduler.num_swap_outs == 0 and not swapped_groups
    assert got == expected
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.kv_cache.num_free_cpu_blocks == 64
