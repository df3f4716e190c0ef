"""Speculative sampling keeps the target's distribution (the tests can fail: negative controls below).

1. The acceptance rule alone (rejection.verify_sampled), exactly: a target Markov chain P and a very different
   draft chain Q over 5 tokens; 20,000 sequences decode speculatively (k = 3 drafts per step drawn from Q, or
   deterministic one-hot drafts) and the joint distribution of their first two output tokens and the marginal of
   the third are compared with the exact target probabilities by a chi-square goodness-of-fit test at
   significance 1e-3. Negative controls: the same test with a wrong rule (accept every draft; accept with
   probability q / p) must reject at 1e-3.
2. The engine: 240 seeded requests sampling 3 tokens (temperature 1, top-k 8) from a tiny model with and without
   speculation (a draft model: the target with noise on its weights), the empirical distribution at each position
   compared by a two-sample chi-square test at 1e-3. Negative control: accepting every draft of an unrelated draft
   model must be rejected.

Seeds are fixed, so each outcome is deterministic; 1e-3 is the significance a correct rule would fail at by chance.
"""
from __future__ import annotations

import pytest
import torch

from loraplex.engine import SamplingParams
from loraplex.engine.spec_decode import rejection
from tests.engine.spec_decode.conftest import make_engine

ALPHA = 1e-3


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against cell probabilities ``probs`` (cells expecting < 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)]) if small.any() else expected
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def two_sample(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that samples ``a`` and ``b`` come from one distribution (categories with
    fewer than 10 observations in both samples together pooled)."""
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    rare = (ca + cb) < 10
    if rare.any():
        ca = torch.cat([ca[~rare], ca[rare].sum().reshape(1)])
        cb = torch.cat([cb[~rare], cb[rare].sum().reshape(1)])
    table = torch.stack([ca, cb])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return chi2_sf(stat, table.shape[1] - 1)


# ---- 1. the rule ----------------------------------------------------------------------------------------------------
V, K, N = 5, 3, 20_000


def chains():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)  # unrelated to p
    return p.float(), q.float()


def speculative_samples(p: torch.Tensor, q: torch.Tensor, dense: bool, seed: int, num_tokens: int = 3) -> torch.Tensor:
    """[N, num_tokens] output tokens of N sequences starting at token 0, decoded speculatively."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.zeros(N, num_tokens + K + 1, dtype=torch.int64)
    lens = torch.zeros(N, dtype=torch.int64)
    last = torch.zeros(N, dtype=torch.int64)
    while int(lens.min()) < num_tokens:
        drafts, qrows, prev = [], [], last
        for _ in range(K):
            qj = q[prev]                                            # [N, V]
            d = torch.multinomial(qj, 1, generator=gen).squeeze(1) if dense else qj.argmax(-1)
            drafts.append(d)
            qrows.append(qj)
            prev = d
        d = torch.stack(drafts, 1)                                  # [N, K]
        rows = torch.stack([last] + drafts, 1)                      # the k + 1 prefixes' last tokens
        target = p[rows].reshape(N * (K + 1), V)
        qs = list(torch.stack(qrows, 1).unbind(0)) if dense else [None] * N  # [K, V] each
        acc, tok = rejection.verify_sampled(target, d.tolist(), qs, [None] * N, gen)
        new = torch.cat([d, torch.zeros(N, 1, dtype=torch.int64)], 1)
        new[torch.arange(N), acc] = tok                             # accepted drafts, then the target's token
        cols = lens.unsqueeze(1) + torch.arange(K + 1)
        take = (torch.arange(K + 1) <= acc.unsqueeze(1)) & (cols < outs.shape[1])
        outs[torch.arange(N).unsqueeze(1).expand_as(cols)[take], cols[take]] = new[take]
        lens = torch.clamp(lens + acc + 1, max=outs.shape[1])
        last = tok
    return outs[:, :num_tokens]


def fit(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """p-values: (first two tokens jointly, third token) against the exact target chain from token 0."""
    joint = (p[0].unsqueeze(1) * p).reshape(-1)                     # P(o1 = a, o2 = b)
    counts = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).double()
    third = p[0] @ p @ p                                            # P(o3 = c)
    return goodness_of_fit(counts, joint.double()), goodness_of_fit(
        torch.bincount(samples[:, 2], minlength=V).double(), third.double())


@pytest.mark.parametrize("dense", [True, False], ids=["draft-probs", "one-hot-drafts"])
def test_rule_preserves_the_target_distribution(dense):
    p, q = chains()
    samples = speculative_samples(p, q, dense, seed=1)
    pj, p3 = fit(samples, p)
    print(f"p-values: first two tokens {pj:.3g}, third {p3:.3g}")
    assert pj > ALPHA and p3 > ALPHA, (pj, p3)


@pytest.mark.parametrize("wrong", ["accept-always", "ratio-inverted"])
def test_rule_negative_controls_are_detected(wrong, monkeypatch):
    rules = {"accept-always": lambda pd, qd, u: torch.ones_like(pd, dtype=torch.bool),
             "ratio-inverted": lambda pd, qd, u: u * pd < qd}
    monkeypatch.setattr(rejection, "accept_mask", rules[wrong])
    p, q = chains()
    pj, p3 = fit(speculative_samples(p, q, True, seed=1), p)
    print(f"p-values ({wrong}): first two tokens {pj:.3g}, third {p3:.3g}")
    assert min(pj, p3) < ALPHA, (pj, p3)


def test_greedy_rule_is_the_longest_matching_prefix():
    argmax = torch.tensor([4, 5, 6, 7, 1, 2, 3, 8, 9])             # rows: seq 0 (k=3), seq 1 (k=2), seq 2 (k=2)
    acc, tok = rejection.verify_greedy(argmax, [[4, 5, 0], [2, 3], [9, 9]])
    assert acc.tolist() == [2, 0, 0] and tok.tolist() == [6, 1, 8]
    acc, tok = rejection.verify_greedy(torch.tensor([1, 2, 3]), [[1, 2]])
    assert acc.tolist() == [2] and tok.tolist() == [3]              # all accepted: the bonus token


def test_greedy_rule_uniform_k_grid_matches_the_prefix_rule():
    gen = torch.Generator().manual_seed(5)
    for k in (1, 2, 3, 5):
        argmax = torch.randint(0, 3, (7 * (k + 1),), generator=gen)   # few ids: long prefixes happen
        drafts = torch.randint(0, 3, (7, k), generator=gen).tolist()
        want_acc, want_tok = [], []
        for s, d in enumerate(drafts):
            row = argmax[s * (k + 1):(s + 1) * (k + 1)].tolist()
            a = next((j for j in range(k) if d[j] != row[j]), k)
            want_acc.append(a)
            want_tok.append(row[a])
        acc, tok = rejection.verify_greedy(argmax, drafts)
        assert acc.tolist() == want_acc and tok.tolist() == want_tok, k
        assert 0 < sum(want_acc) < 7 * k or k == 1                   # the draws cover rejections and acceptances


# ---- 2. the engine -----------------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is several times faster on a busy host (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def engine_samples(path: str, spec: dict | None, seeds: range) -> list[list[int]]:
    engine = make_engine(path, spec, max_num_seqs=80, max_num_batched_tokens=512)
    prompt = [5, 77, 123, 9, 41, 200]
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=8, seed=s, ignore_eos=True) for s in seeds]
    outs = [o.output_token_ids for o in engine.generate([prompt] * len(params), params)]
    if spec is not None:
        stats = engine.spec.snapshot()
        assert stats["verified"] > 0
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outs


def test_engine_sampling_matches_non_speculative(one_thread, tiny_checkpoint, perturbed_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    n = 240
    plain = engine_samples(path, None, range(n))
    draft = dict(method="draft", draft_model=perturbed_checkpoint(path, 0.3), num_speculative_tokens=2)
    spec = engine_samples(path, draft, range(10_000, 10_000 + n))   # independent seeds
    pvals = [two_sample([o[i] for o in plain], [o[i] for o in spec]) for i in range(3)]
    print("p-values per position, speculative vs not:", [f"{v:.3g}" for v in pvals])
    assert min(pvals) > ALPHA, pvals
    # negative control: accept every draft of an unrelated model -> the draft's distribution, detected
    monkeypatch.setattr(rejection, "accept_mask", lambda pd, qd, u: torch.ones_like(pd, dtype=torch.bool))
    wrong = engine_samples(path, dict(method="draft", draft_model=tiny_checkpoint("llama", seed=7),
                                      num_speculative_tokens=2), range(20_000, 20_000 + n))
    pvals = [two_sample([o[i] for o in plain], [o[i] for o in wrong]) for i in (1, 2)]
    print("p-values, accept-always negative control:", [f"{v:.3g}" for v in pvals])
    assert min(pvals) < ALPHA, pvals
