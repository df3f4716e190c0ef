"""Prefix caching, preemption by recompute and seeded sampling, end to end through LLMEngine."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams

BLOCK = 4


def make_engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("block_size", BLOCK)
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", progress=False, **kw)


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(engine: LLMEngine, prompts, params) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params if not isinstance(params, list) else params[i])
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_prefix_cache_reuses_three_blocks_and_keeps_output(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    engine = make_engine(path, max_num_batched_tokens=64)
    vocab = engine.model_config.vocab_size
    shared = random_ids(vocab, 3 * BLOCK, seed=7)
    first = shared + random_ids(vocab, 5, seed=8)
    second = shared + random_ids(vocab, 6, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    run_all(engine, [first], params)
    kv = engine.kv_cache
    hits_before, queries_before = kv.prefix_cache_hits, kv.prefix_cache_queries
    engine.add_request("second", second, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
    assert kv.prefix_cache_queries > queries_before
    assert kv.prefix_cache_hits - hits_before == 3 * BLOCK, "the shared 3-block prefix was not reused"
    assert out.num_cached_tokens == 3 * BLOCK

    uncached = make_engine(path, max_num_batched_tokens=64, enable_prefix_caching=False)
    ref = run_all(uncached, [second], params)["r0"]
    assert out.output_token_ids == ref.output_token_ids
    assert uncached.kv_cache.prefix_cache_hits == 0
    kv.check_invariants()


def test_preemption_by_recompute_matches_unconstrained_run(tiny_checkpoint):
    path = tiny_checkpoint("gpt_oss")
    roomy = make_engine(path, max_num_batched_tokens=64)
    vocab = roomy.model_config.vocab_size
    prompts = [random_ids(vocab, n, seed=100 + n) for n in (6, 11, 15, 19, 22, 9)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = run_all(roomy, prompts, params)

    # The longest sequence needs ceil((22 + 24) / 4) = 12 blocks; 16 blocks cannot hold the running set.
    tight = make_engine(path, max_num_batched_tokens=64, num_kv_blocks=16)
    got = run_all(tight, prompts, params)
    assert sum(o.metrics.num_preemptions for o in got.values()) > 0, "the pool was not small enough to preempt"
    for rid, out in expected.items():
        assert got[rid].output_token_ids == out.output_token_ids, f"{rid} differs after preemption"
    assert tight.kv_cache.num_free_blocks == 16
    tight.kv_cache.check_invariants()


def test_seeded_sampling_is_reproducible_across_runs_and_batch_mixes(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    engine = make_engine(path)
    prompt = random_ids(engine.model_config.vocab_size, 10, seed=1)
    alone = run_all(engine, [prompt], seeded)["r0"].output_token_ids
    again = run_all(make_engine(path), [prompt], seeded)["r0"].output_token_ids
    assert alone == again

    others = [random_ids(engine.model_config.vocab_size, n, seed=n) for n in (4, 17, 25)]
    mix_params = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
                  SamplingParams(max_tokens=7, temperature=0.7, seed=99, ignore_eos=True), seeded,
                  SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    mixed = run_all(make_engine(path, max_num_batched_tokens=16), [others[0], others[1], prompt, others[2]],
                    mix_params)
    assert mixed["r2"].output_token_ids == alone
    # A different seed gives a different stream (the seed is really used).
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=4321, ignore_eos=True)
    assert run_all(make_engine(path), [prompt], other_seed)["r0"].output_token_ids != alone


@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids", "length"])
def test_stop_conditions(tiny_checkpoint, stop_kind):
    path = tiny_checkpoint("llama")
    engine = make_engine(path)
    prompt = random_ids(engine.model_config.vocab_size, 8, seed=3)
    free_run = run_all(make_engine(path), [prompt], SamplingParams(max_tokens=16, temperature=0.0,
                                                                   ignore_eos=True))["r0"].output_token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    if stop_kind == "stop_token_ids":
        out = run_all(engine, [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[stop_at]))["r0"]
        assert out.output_token_ids == free_run[: first + 1] and out.finish_reason == "stop"
    elif stop_kind == "eos":
        engine.scheduler.config.eos_token_ids = [stop_at]
        out = run_all(engine, [prompt], SamplingParams(max_tokens=16, temperature=0.0))["r0"]
        assert out.output_token_ids == free_run[: first + 1] and out.finish_reason == "stop"
    else:
        out = run_all(engine, [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))["r0"]
        assert out.output_token_ids == free_run[:4] and out.finish_reason == "length"
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks


def test_penalties_and_min_tokens_run_through_the_engine(tiny_checkpoint):
    """Rows with penalties / min_tokens need their token history in the sampler; EOS is held back until
    min_tokens outputs exist."""
    path = tiny_checkpoint("llama")
    engine = make_engine(path)
    prompt = random_ids(engine.model_config.vocab_size, 8, seed=11)
    free_run = run_all(make_engine(path), [prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                                   ignore_eos=True))["r0"].output_token_ids
    eos = free_run[1]
    engine.scheduler.config.eos_token_ids = [eos]
    engine.runner.sampler.eos_token_ids = [eos]
    out = run_all(engine, [prompt], [SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6)])["r0"]
    assert len(out.output_token_ids) >= 6 and eos not in out.output_token_ids[:6]
    penalised = run_all(make_engine(path), [prompt], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5,
        frequency_penalty=0.5))["r0"].output_token_ids
    assert len(penalised) == 12
