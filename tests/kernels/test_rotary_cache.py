"""rotary_embedding_and_cache (rope on q and k, k and v into the paged caches, one launch) against its reference,
which is rotary_embedding followed by reshape_and_cache: on the strided q / k / v views of a fused qkv row, at
awkward head counts and dims, with padding rows (slot -1) that must leave the caches alone."""
import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.rotary import rotary_embedding, rotary_embedding_and_cache

from .conftest import randn


def _case(num_tokens, num_q, num_kv, head_dim, dtype, nb=9, bs=4):
    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim).to(dtype)
    q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 50, (num_tokens,), dtype=torch.int64)
    table = randn(64, head_dim)
    slots = torch.randperm(nb * bs)[:num_tokens].to(torch.int32)
    slots[1::3] = -1  # padding rows
    caches = [randn(nb, bs, num_kv, head_dim).to(dtype) for _ in range(2)]
    return q, k, v, positions, table, slots, caches


@pytest.mark.parametrize("num_tokens,num_q,num_kv,head_dim", [(1, 4, 2, 16), (7, 5, 3, 12), (33, 8, 1, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_rotary_then_cache(num_tokens, num_q, num_kv, head_dim, dtype):
    q, k, v, positions, table, slots, caches = _case(num_tokens, num_q, num_kv, head_dim, dtype)
    want_caches = [c.clone() for c in caches]
    got_q = rotary_embedding_and_cache(positions, q, k, v, table, caches[0], caches[1], slots)
    # the two launches it replaces, on the same inputs: bit for bit (k rounded once to the cache dtype either way)
    want_q, want_k = rotary_embedding(positions, q, k, table)
    reference.reshape_and_cache(want_k, v, want_caches[0], want_caches[1], slots)
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    # and the reference op (rounding per op in q's dtype: exact in float32 up to an ulp)
    ref_caches = [c.clone() for c in caches]
    ref_q = reference.rotary_embedding_and_cache(positions, q, k, v, table, *ref_caches, slots)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_q, ref_q, **tol)
    torch.testing.assert_close(caches[0], ref_caches[0], **tol)
    assert torch.equal(caches[1], ref_caches[1])


def test_padding_rows_leave_the_caches_alone():
    q, k, v, positions, table, slots, caches = _case(6, 4, 2, 16, torch.float32)
    slots[:] = -1
    before = [c.clone() for c in caches]
    got_q = rotary_embedding_and_cache(positions, q, k, v, table, caches[0], caches[1], slots)
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    assert torch.equal(got_q, rotary_embedding(positions, q, k, table)[0])  # q is still rotated


def test_refuses_what_it_cannot_write():
    q, k, v, positions, table, slots, caches = _case(3, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="caches of torch.bfloat16"):
        rotary_embedding_and_cache(positions, q, k, v, table, caches[0].bfloat16(), caches[1].bfloat16(), slots)
    with pytest.raises(ValueError, match="v must be"):
        rotary_embedding_and_cache(positions, q, k, v.transpose(1, 2).contiguous().transpose(1, 2), table,
                                   *caches, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rotary_embedding_and_cache(positions, q, k, v, table, *caches, slots[:2])
