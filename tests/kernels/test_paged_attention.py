import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.paged_attention import paged_attention


def _case(ctx_lens, q_lens, *, num_q=4, num_kv=2, d=32, bs=4, dtype=torch.float32):
    """Caches filled with noise, each sequence's blocks scattered (holes, any order) across the pool."""
    max_blocks = max((c + bs - 1) // bs for c in ctx_lens) + 1
    nb = sum((c + bs - 1) // bs for c in ctx_lens) * 2 + 3
    perm = torch.randperm(nb)
    tables = torch.full((len(ctx_lens), max_blocks), nb + 5, dtype=torch.int32)  # garbage past the end
    used = 0
    for b, c in enumerate(ctx_lens):
        n = (c + bs - 1) // bs
        tables[b, :n] = perm[used:used + 2 * n:2].to(torch.int32)  # every other free block: holes
        used += 2 * n
    k_cache = torch.randn(nb, bs, num_kv, d).to(dtype)
    v_cache = torch.randn(nb, bs, num_kv, d).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(qsl[-1]), num_q, d).to(dtype)
    return q, k_cache, v_cache, tables.clamp(max=nb - 1), torch.tensor(ctx_lens, dtype=torch.int32), qsl


CASES = {
    "decode": ([1, 9, 33], [1, 1, 1]),
    "prefill": ([7], [7]),
    "mixed_chunks": ([33, 5, 20], [13, 5, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_matches_reference(case, window, with_sinks):
    ctx_lens, q_lens = CASES[case]
    q, kc, vc, tables, seq_lens, qsl = _case(ctx_lens, q_lens)
    sinks = torch.randn(q.shape[1]) if with_sinks else None
    kw = dict(sliding_window=window, sinks=sinks)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2, block_q=2, block_n=8, **kw)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_paged_attention_odd_head_dim_and_default_tiles():
    q, kc, vc, tables, seq_lens, qsl = _case([10, 3], [4, 1], num_q=6, num_kv=2, d=20, bs=8)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.3)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_paged_attention_rejects_bad_gqa():
    q, kc, vc, tables, seq_lens, qsl = _case([4], [1], num_q=3, num_kv=2)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2)


def test_paged_attention_many_sequences_span_search_chunks():
    """More sequences than one search chunk (128): decode rows must still find their own sequence."""
    ctx = [1 + (i % 5) for i in range(150)]
    q, kc, vc, tables, seq_lens, qsl = _case(ctx, [1] * 150, num_q=2, num_kv=1, d=16, bs=4)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.25)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
