from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.sampler import Sampler, make_generator
from loraplex.engine.sampling_params import SamplingParams as P

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)


def test_greedy_is_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [P(temperature=0), P(temperature=1.0, seed=3), P(temperature=0), P(top_k=5), P(temperature=0),
              P(temperature=0, top_k=3)]
    gens = [None, make_generator(3), None, None, None, None]
    tokens = Sampler().sample(logits, params, gens)
    ref = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 4, 5)] == [ref[i] for i in (0, 2, 4, 5)]
    assert all(isinstance(t, int) for t in tokens)


@pytest.mark.parametrize("params, expected", [
    (P(top_p=0.6), [5 / 7, 2 / 7, 0, 0, 0]),                       # 0.5 < 0.6 -> the 2nd token is needed too
    (P(top_p=0.5), [1, 0, 0, 0, 0]),                               # the best token alone reaches 0.5
    (P(top_p=0.01), [1, 0, 0, 0, 0]),                              # the best token always stays
    (P(top_k=3), [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]),
    (P(top_k=3, top_p=0.8), [5 / 7, 2 / 7, 0, 0, 0]),              # after top-k: .588, .235, .176
    (P(top_k=-1, top_p=1.0), PROBS),
    (P(temperature=2.0), [math.sqrt(p) / sum(math.sqrt(q) for q in PROBS) for p in PROBS]),
])
def test_filters_match_hand_computation(params, expected):
    probs = Sampler.probs(logits_of(PROBS), [params])
    torch.testing.assert_close(probs[0], torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-5)


def test_filters_apply_per_row():
    logits = torch.cat([logits_of(PROBS), logits_of(PROBS[::-1])])
    probs = Sampler.probs(logits, [P(top_k=1), P(top_p=0.6)])
    torch.testing.assert_close(probs[0], torch.tensor([1.0, 0, 0, 0, 0]))
    torch.testing.assert_close(probs[1], torch.tensor([0, 0, 0, 2 / 7, 5 / 7]))


def test_sampled_tokens_stay_inside_the_filter():
    logits = logits_of(PROBS).repeat(500, 1)
    tokens = Sampler(seed=0).sample(logits, [P(top_k=2)] * 500, [None] * 500)
    assert set(tokens) == {0, 1}


def test_seeded_row_is_the_same_whatever_the_batch():
    torch.manual_seed(0)
    steps = [torch.randn(64) for _ in range(6)]  # the seeded request's logits at each step
    mine = P(temperature=0.9, top_p=0.95, seed=1234)

    # the generator is carried across steps; the batch around the row and its position change
    def runner(mix):
        g = make_generator(1234)
        out = []
        for t, row in enumerate(steps):
            others = torch.randn(mix(t), 64) * 3
            pos = t % (others.shape[0] + 1)
            logits = torch.cat([others[:pos], row.unsqueeze(0), others[pos:]])
            params = [P(temperature=1.3, top_k=7)] * logits.shape[0]
            params[pos] = mine
            gens = [make_generator(99) if i % 2 else None for i in range(logits.shape[0])]
            gens[pos] = g
            out.append(Sampler().sample(logits, params, gens)[pos])
        return out

    alone = runner(lambda t: 0)
    assert runner(lambda t: 3) == alone
    assert runner(lambda t: t + 1) == alone
    assert runner(lambda t: 9 - t) == alone
    assert len(set(alone)) > 1  # really sampling, not argmax


def test_unseeded_rows_follow_the_samplers_seed():
    logits = torch.randn(8, 100)
    a = Sampler(seed=5).sample(logits, [P()] * 8, [None] * 8)
    b = Sampler(seed=5).sample(logits, [P()] * 8, [None] * 8)
    assert a == b


def test_distribution_matches_probabilities():
    n = 20000
    logits = logits_of(PROBS).repeat(n, 1)
    tokens = torch.tensor(Sampler(seed=0).sample(logits, [P()] * n, [None] * n))
    counts = torch.bincount(tokens, minlength=5).double()
    expected = torch.tensor(PROBS, dtype=torch.float64) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, f"chi-square {chi2:.2f} over the 0.1% critical value for 4 degrees of freedom"
    # and one seeded generator over many steps draws the same distribution
    g = make_generator(7)
    seq = [Sampler().sample(logits_of(PROBS), [P(seed=7)], [g])[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(seq), minlength=5).double()
    expected = torch.tensor(PROBS, dtype=torch.float64) * 4000
    assert float(((counts - expected) ** 2 / expected).sum()) < 18.47


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"logits must be \[N, V\], got shape \(5,\)"):
        Sampler().sample(torch.zeros(5), [P()], [None])
    with pytest.raises(ValueError, match="2 logit rows but 1 params and 2 generators"):
        Sampler().sample(torch.zeros(2, 5), [P()], [None, None])
    assert Sampler().sample(torch.zeros(0, 5), [], []) == []


# ---- sampling controls against transformers' logits processors --------------------------------------------
def _hf():
    from transformers.generation import logits_process as lp
    return lp


class Hist:
    """A row's token history (what Sequence offers the sampler)."""

    def __init__(self, prompt, output):
        self.prompt_token_ids, self.output_token_ids = list(prompt), list(output)


def _histories(n, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Hist(torch.randint(0, v, (5 + i,), generator=g).tolist(),
                 torch.randint(0, v, (i * 3,), generator=g).tolist()) for i in range(n)]


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(1)
    n, v = 4, 40
    logits = torch.randn(n, v) * 3
    hist = _histories(n, v)
    mine = Sampler().apply_penalties(logits, [P(repetition_penalty=1.7)] * n, hist)
    proc = _hf().RepetitionPenaltyLogitsProcessor(1.7)
    for i, h in enumerate(hist):  # transformers sees prompt + output as input_ids
        ref = proc(torch.tensor([h.prompt_token_ids + h.output_token_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(mine[i], ref[0])
    assert not torch.equal(mine, logits)
    # mixed batch: rows without the penalty are untouched
    mixed = Sampler().apply_penalties(logits, [P(), P(repetition_penalty=0.5), P(), P()], hist)
    torch.testing.assert_close(mixed[[0, 2, 3]], logits[[0, 2, 3]])
    assert not torch.equal(mixed[1], logits[1])


def test_presence_and_frequency_penalties_follow_openai():
    v = 6
    logits = torch.zeros(2, v)
    hist = [Hist([0, 0, 0, 5], [1, 1, 2]), Hist([1], [4, 4, 4, 4])]
    out = Sampler().apply_penalties(logits, [P(presence_penalty=0.5, frequency_penalty=0.25),
                                             P(frequency_penalty=-1.0)], hist)
    # written reference: logit - frequency * count - presence * [count > 0], counts over output tokens only
    torch.testing.assert_close(out[0], torch.tensor([0, -0.5 - 0.5, -0.25 - 0.5, 0, 0, 0]))
    torch.testing.assert_close(out[1], torch.tensor([0, 0, 0, 0, 4.0, 0]))


def test_min_tokens_masks_eos_and_stop_ids_like_min_new_tokens_processor():
    torch.manual_seed(2)
    v, eos = 30, 2
    logits = torch.randn(3, v)
    hist = [Hist([7, 8], [1]), Hist([7, 8], [1, 3, 4]), Hist([7, 8], [])]
    params = [P(min_tokens=3, stop_token_ids=[9]), P(min_tokens=3, stop_token_ids=[9]),
              P(min_tokens=1, ignore_eos=True, stop_token_ids=[11])]
    out = Sampler(eos_token_ids=[eos]).apply_penalties(logits, params, hist)
    proc = _hf().MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=[eos, 9])
    for i in (0, 1):
        ref = proc(torch.tensor([hist[i].prompt_token_ids + hist[i].output_token_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(out[i], ref[0])
    assert out[0, eos] == float("-inf") and out[0, 9] == float("-inf")
    torch.testing.assert_close(out[1], logits[1])  # 3 outputs: no longer masked
    assert out[2, 11] == float("-inf") and out[2, eos] == logits[2, eos]  # ignore_eos: EOS is not a stop
    # greedy argmax never picks the masked EOS
    peaked = torch.zeros(1, v)
    peaked[0, eos] = 10.0
    greedy = Sampler(eos_token_ids=[eos]).sample(peaked, [P(temperature=0, min_tokens=2)], [None], [Hist([1], [])])
    assert greedy != [eos]


def test_penalties_need_histories():
    with pytest.raises(ValueError, match="penalties and min_tokens need each row's tokens: pass seqs"):
        Sampler().sample(torch.zeros(1, 5), [P(repetition_penalty=1.1)], [None])


@pytest.mark.parametrize("params, warpers", [
    (P(min_p=0.15), lambda lp: [lp.MinPLogitsWarper(0.15)]),
    (P(temperature=0.7, min_p=0.3), lambda lp: [lp.TemperatureLogitsWarper(0.7), lp.MinPLogitsWarper(0.3)]),
    (P(top_k=7), lambda lp: [lp.TopKLogitsWarper(7)]),
    (P(top_p=0.8), lambda lp: [lp.TopPLogitsWarper(0.8)]),
    (P(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05),
     lambda lp: [lp.TemperatureLogitsWarper(1.3), lp.TopKLogitsWarper(12), lp.TopPLogitsWarper(0.9),
                 lp.MinPLogitsWarper(0.05)]),
])
def test_filters_match_transformers_warpers(params, warpers):
    torch.manual_seed(3)
    logits = torch.randn(5, 64) * 2
    ref = logits.clone()
    for w in warpers(_hf()):
        ref = w(None, ref)
    torch.testing.assert_close(Sampler.probs(logits, [params] * 5), torch.softmax(ref, dim=-1))


def test_logprobs_are_raw_model_logprobs_of_the_sampled_token():
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    params = [P(temperature=0, logprobs=3), P(seed=1, top_k=5, logprobs=0), P(temperature=0)]
    gens = [None, make_generator(1), None]
    out = Sampler().forward(logits, params, gens)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i in (0, 1):
        e = out.logprobs[i]
        assert e.token_id == out.token_ids[i]
        assert e.logprob == pytest.approx(ref[i, e.token_id].item(), abs=1e-6)
        assert e.rank == int((ref[i] > ref[i, e.token_id]).sum()) + 1
    assert out.logprobs[0].rank == 1 and len(out.logprobs[0].top) == 3 and out.logprobs[1].top == []
    top = ref[0].topk(3)
    assert [t for t, _ in out.logprobs[0].top] == top.indices.tolist()


def test_beam_logprobs_process_log_probs_as_transformers_beam_search():
    torch.manual_seed(5)
    logits = torch.randn(2, 30)
    hist = _histories(2, 30)
    out = Sampler().beam_logprobs(logits, [P(repetition_penalty=1.4)] * 2, hist)
    proc = _hf().RepetitionPenaltyLogitsProcessor(1.4)
    for i, h in enumerate(hist):
        ref = proc(torch.tensor([h.prompt_token_ids + h.output_token_ids]), torch.log_softmax(logits[i:i + 1], -1))
        torch.testing.assert_close(out[i], ref[0])


def test_n_rows_sharing_one_generator_are_reproducible():
    logits = torch.randn(1, 80).repeat(4, 1)  # one request, n = 4 forked rows with the same logits
    p = P(seed=11, n=4)

    def draw():
        g = make_generator(11)
        return Sampler().sample(logits, [p] * 4, [g] * 4)
    assert draw() == draw()
    assert len(set(draw())) > 1  # the rows draw different tokens from one stream


def test_best_of_rows_get_the_sampled_tokens_logprob_for_ranking():
    torch.manual_seed(6)
    logits = torch.randn(2, 20)
    out = Sampler(seed=0).forward(logits, [P(best_of=3), P()], [None, None])
    e = out.logprobs[0]
    assert e is not None and e.top == [] and out.logprobs[1] is None
    assert e.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[out.token_ids[0]].item(), abs=1e-6)


def test_all_drawing_rows_take_the_same_draws_as_a_mixed_batch():
    """A batch where every row draws (no gather/scatter) picks what the general mixed path picks for those rows:
    the same noise from the same shared and per-row generators."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 97, generator=g) * 3
    drawing = [P(temperature=0.7, top_p=0.9, top_k=20), P(temperature=1.3), P(temperature=0.5, min_p=0.1),
               P(temperature=1.0, top_k=5), P(temperature=0.9)]
    greedy_row = torch.randn(1, 97, generator=g)
    for seeded in (False, True):
        gens = [[torch.Generator().manual_seed(100 + i) if seeded and i % 2 else None for i in range(5)]
                for _ in range(2)]
        fast = Sampler(seed=3).forward(logits, drawing, gens[0]).token_ids
        mixed = Sampler(seed=3).forward(torch.cat([logits, greedy_row]), drawing + [P(temperature=0.0)],
                                        gens[1] + [None]).token_ids
        assert fast == mixed[:5] and mixed[5] == int(greedy_row.argmax())
