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
