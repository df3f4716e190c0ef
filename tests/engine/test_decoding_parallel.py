"""Parallel sampling (n > 1) through LLMEngine: forked sequences share the prompt's blocks (reference counts),
only the shared partly filled last block is copied (copy-on-write, one batched call per step), and the memory
saved against independent requests is at least the shared prompt blocks. Seeded n > 1 is reproducible."""
from __future__ import annotations

import torch

from loraplex.engine import LLMEngine, SamplingParams

BS = 4
PROMPT_LEN = 22  # 5 full blocks + a partial one holding 2 tokens
MAX_TOKENS = 10


def make_engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=BS, progress=False, **kw)


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def spy_copies(engine: LLMEngine) -> list[list[tuple[int, int]]]:
    copies: list[list[tuple[int, int]]] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        copies.append(list(out.blocks_to_copy))
        return out

    engine.scheduler.schedule = spy
    return copies


def run(engine: LLMEngine, on_step=None) -> dict:
    final, peak = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        peak = max(peak, engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks)
        engine.kv_cache.check_invariants()
        if on_step is not None:
            on_step()
    return final, peak


def test_n4_shares_prompt_blocks_and_copies_only_the_last_partial_block(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    engine = make_engine(path)
    prompt = prompt_ids(engine.model_config.vocab_size, PROMPT_LEN, seed=5)
    params = SamplingParams(n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True)
    copies = spy_copies(engine)
    engine.add_request("par", prompt, params)
    group = engine.scheduler.get_group("par")
    full_blocks = PROMPT_LEN // BS

    engine.step()  # prefill + the fork: four sequences on one block table
    assert len(group.seqs) == 4
    tables = [list(s.block_ids) for s in group.seqs]
    assert all(t == tables[0] for t in tables)
    prompt_blocks = tables[0][:full_blocks]
    assert [engine.kv_cache.pool.ref_cnt(b) for b in prompt_blocks] == [4] * full_blocks

    engine.step()  # every sequence writes its first token's K/V into the shared partial block
    assert copies[1] and len(copies[1]) == 3, copies  # three copies; the last holder writes in place
    src = {s for s, _ in copies[1]}
    assert src == {tables[0][full_blocks]}  # only ever the partial last block
    for s in group.seqs:  # while running, the prompt's full blocks are still shared four ways
        assert s.block_ids[:full_blocks] == prompt_blocks
    assert [engine.kv_cache.pool.ref_cnt(b) for b in prompt_blocks] == [4] * full_blocks
    assert len({s.block_ids[full_blocks] for s in group.seqs}) == 4

    final, peak_n4 = run(engine)
    assert sum(len(c) for c in copies) == 3 == engine.kv_cache.num_cow_copies
    out = final["par"]
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.output_token_ids) == MAX_TOKENS for c in out.outputs)
    assert out.output_token_ids == out.outputs[0].output_token_ids
    assert len({tuple(c.output_token_ids) for c in out.outputs}) > 1, "four samples should not all agree"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks

    # the same work as four independent requests (admitted together: no prefix hits between them)
    solo = make_engine(path)
    for i in range(4):
        solo.add_request(f"solo{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + i,
                                                            ignore_eos=True))
    _, peak_solo = run(solo)
    print(f"\nKV blocks at peak: n=4 request {peak_n4}, four independent requests {peak_solo}, "
          f"shared prompt blocks {full_blocks}")
    assert peak_solo - peak_n4 >= full_blocks
    assert peak_solo - peak_n4 == 3 * full_blocks  # each of the three forks saves the whole full prompt


def test_seeded_n4_is_reproducible_and_streams_four_completions(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    params = SamplingParams(n=4, max_tokens=8, temperature=0.8, top_p=0.95, seed=2024, ignore_eos=True)
    prompt = prompt_ids(320, 9, seed=1)
    first = make_engine(path).generate([prompt], params)[0]
    # again, in an engine busy with other requests and a tight token budget (other batch mixes)
    busy = make_engine(path, max_num_batched_tokens=8)
    busy.add_request("other", prompt_ids(320, 13, seed=2), SamplingParams(max_tokens=12, temperature=1.0))
    streamed: dict[int, list[int]] = {i: [] for i in range(4)}
    busy.add_request("again", prompt, params)
    final = None
    while busy.has_unfinished_requests():
        for o in busy.step():
            if o.request_id == "again":
                for c in o.outputs:
                    streamed[c.index] += c.new_token_ids
                final = o if o.finished else final
    assert [c.output_token_ids for c in final.outputs] == [c.output_token_ids for c in first.outputs]
    assert [streamed[i] for i in range(4)] == [c.output_token_ids for c in first.outputs]
    other_seed = make_engine(path).generate([prompt], SamplingParams(n=4, max_tokens=8, temperature=0.8, top_p=0.95,
                                                                     seed=7, ignore_eos=True))[0]
    assert [c.output_token_ids for c in other_seed.outputs] != [c.output_token_ids for c in first.outputs]


def test_best_of_returns_the_n_most_likely_of_its_candidates(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"))
    params = SamplingParams(n=2, best_of=5, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    out = engine.generate([prompt_ids(320, 7, seed=4)], params)[0]
    assert len(out.outputs) == 2
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True) and all(s < 0 for s in scores)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
