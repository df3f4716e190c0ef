"""logit_bias (OpenAI semantics: added to the raw logits before every other control), per row in mixed batches:
+100 makes a token the greedy choice, -100 bans it, unbiased rows keep their tokens, ids are checked against the
vocabulary; in the sampler it comes before the grammar mask, which it cannot override."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.sampler import Sampler
from loraplex.engine.structured.bitmask import bitmask_width

PROMPTS = [[1, 40, 41, 42], [1, 7, 8, 9, 10], [1, 200, 3]]
N = 10


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, **kw)


def test_sampler_bias_per_row_then_mask():
    logits = torch.zeros(3, 70)
    logits[:, 5] = 3.0
    params = [greedy(logit_bias={9: 100}), greedy(), greedy(logit_bias={9: 100, 5: -100})]
    sampler = Sampler()
    assert sampler.sample(logits, params, [None] * 3) == [9, 5, 9]
    biased = sampler.apply_logit_bias(logits, params)
    assert biased[1].equal(logits[1]) and biased[2, 5].item() == -97.0 and logits[0, 9].item() == 0.0
    mask = torch.full((3, bitmask_width(70)), -1, dtype=torch.int32)
    mask[0, 0] = ~(1 << 9)  # row 0: token 9 forbidden by its grammar, whatever its bias
    assert sampler.sample(logits, params, [None] * 3, token_bitmask=mask) == [5, 5, 9]
    sampled = [greedy(logit_bias={9: 100}) for _ in range(2)]
    for p in sampled:
        p.temperature = 0.7
    assert sampler.sample(logits[:2], sampled, [None] * 2) == [9, 9]  # before temperature: still dominant
    beams = sampler.beam_logprobs(logits[:1], [greedy(logit_bias={9: 100})])
    assert beams.argmax().item() == 9


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    e = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=8, progress=False)
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(engine):
    return [o.output_token_ids for o in engine.generate(PROMPTS, greedy())]


def test_plus_100_forces_and_minus_100_bans_in_a_mixed_batch(engine, reference):
    forced = 123
    banned = reference[1][0]
    params = [greedy(logit_bias={forced: 100}), greedy(logit_bias={banned: -100}), greedy()]
    outs = engine.generate(PROMPTS, params)
    assert outs[0].output_token_ids == [forced] * N
    assert banned not in outs[1].output_token_ids and outs[1].output_token_ids != reference[1]
    assert outs[2].output_token_ids == reference[2]  # the unbiased row of the batch is untouched
    small = engine.generate(PROMPTS[:1], greedy(logit_bias={reference[0][0]: 0.0}))[0]
    assert small.output_token_ids == reference[0]


def test_overlapped_steps_apply_the_bias(tiny_checkpoint, reference):
    path = tiny_checkpoint("qwen3")
    e = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=8, progress=False,
                                  async_scheduling=True)
    outs = e.generate(PROMPTS, [greedy(logit_bias={77: 100}), greedy(), greedy(logit_bias={reference[2][0]: -100})])
    assert e.num_overlapped_steps > 0
    assert outs[0].output_token_ids == [77] * N and outs[1].output_token_ids == reference[1]
    assert reference[2][0] not in outs[2].output_token_ids
    e.close()


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [1, 2], greedy(logit_bias={vocab: 5}))
    assert not engine.has_unfinished_requests()
