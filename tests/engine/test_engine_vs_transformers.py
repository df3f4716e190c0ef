"""The engine against transformers: every family, six prompts at once, chunked prefill mixed with decodes,
token-identical greedy output for 32 new tokens and logits within 1e-4 (relative to max|ref|) at every step."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams

FAMILIES = ["gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3"]
PROMPT_LENS = [3, 9, 14, 21, 30, 37]
NEW_TOKENS = 32
REL_TOL = 1e-4


def random_prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def record_steps(engine: LLMEngine):
    """Spy on the scheduler's outputs and the runner's logits (per request, per sampled step)."""
    outputs = []
    logits = defaultdict(list)
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        outputs.append([(s.seq.request_id, s.num_new_tokens, s.seq.num_computed_tokens, s.seq.num_output_tokens)
                        for s in out.scheduled])
        return out

    engine.scheduler.schedule = spy
    engine.runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[i].clone())
                                                  for i, s in enumerate(seqs)]
    return outputs, logits


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_concurrent_chunked_matches_transformers(family, tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint(family)
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4,
                                       max_num_batched_tokens=24, max_num_seqs=8, progress=False)
    if family == "gpt_oss":
        window = engine.model_config.sliding_window
        assert window is not None and max(PROMPT_LENS) > window, "GPT-OSS prompts must exceed the sliding window"
    steps, logits = record_steps(engine)
    prompts = random_prompts(engine.model_config.vocab_size, PROMPT_LENS, seed=FAMILIES.index(family))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out

    # The schedule really chunked prompts and mixed prefill chunks with decodes in one step.
    assert all(sum(n for _, n, _, _ in step) <= 24 for step in steps)
    chunked = {rid for step in steps for rid, n, done, _ in step if done > 0 and n > 1}
    assert chunked, "no prompt was split across steps"
    assert any(any(n == 1 and o > 0 for _, n, _, o in step) and any(n > 1 for _, n, _, _ in step) for step in steps)

    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        ref_tokens, ref_logits = hf_greedy(path, prompt, NEW_TOKENS)
        assert final[rid].output_token_ids == ref_tokens, f"{family} prompt {i}: tokens differ"
        assert len(logits[rid]) == NEW_TOKENS
        for step, (got, ref) in enumerate(zip(logits[rid], ref_logits)):
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            assert err <= REL_TOL, f"{family} prompt {i} step {step}: relative logits error {err:.2e}"
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks
