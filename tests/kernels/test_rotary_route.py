"""Triton rotary embedding and MoE routing against their torch references, run through the interpreter on CPU."""
import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.moe_route import moe_route
from loraplex.kernels.rotary import rotary_embedding
from loraplex.kernels.tuning_cases import distinct_logits, rel_error

from .conftest import randn

MAX_POS = 300


def _fused_qkv_views(num_tokens, num_q, num_kv, head_dim, dtype):
    """q [T, Q, D] and k [T, KV, D] as the attention layer makes them: strided views of one [T, (Q+2KV)D] tensor."""
    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    return qkv, q.reshape(num_tokens, num_q, head_dim), k.reshape(num_tokens, num_kv, head_dim)


def _cos_sin_cache(head_dim):
    """Random-frequency table [MAX_POS, D] = cat(cos, sin) scaled like YaRN (not just unit circles)."""
    inv_freq = torch.rand(head_dim // 2) + 0.01
    freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * 1.1


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("num_q,num_kv", [(4, 4), (6, 2), (12, 1)])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_fp32_matches_reference_on_strided_views(num_tokens, num_q, num_kv, head_dim):
    qkv, q, k = _fused_qkv_views(num_tokens, num_q, num_kv, head_dim, torch.float32)
    assert num_tokens == 1 or not (q.is_contiguous() or k.is_contiguous())  # one row: any stride counts
    before = qkv.clone()
    positions = torch.randperm(MAX_POS)[:num_tokens]  # unsorted, beyond T
    cache = _cos_sin_cache(head_dim)
    got_q, got_k = rotary_embedding(positions, q, k, cache)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv, before)  # inputs untouched, as in the reference


@pytest.mark.parametrize("num_tokens", [1, 33])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_rotary_bf16_within_bf16_rounding(num_tokens, head_dim):
    """bf16 in, fp32 math, one rounding: within one bf16 ulp (2^-7 relative) of the exact (fp32) result (the GPU
    rounds to nearest, the interpreter truncates), and within 1e-2 of the bf16 reference (which also rounds
    cos / sin and every product to bf16)."""
    _, q, k = _fused_qkv_views(num_tokens, 8, 2, head_dim, torch.bfloat16)
    positions = torch.randint(0, MAX_POS, (num_tokens,), dtype=torch.int32)
    cache = _cos_sin_cache(head_dim)
    got = rotary_embedding(positions, q, k, cache)
    exact = reference.rotary_embedding(positions.long(), q.float(), k.float(), cache)
    bf16_ref = reference.rotary_embedding(positions.long(), q, k, cache)
    for g, e, r in zip(got, exact, bf16_ref):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e, rtol=2 ** -7, atol=1e-6)
        assert rel_error(g, r) <= 1e-2


def test_rotary_normed_contiguous_inputs():
    """After q_norm / k_norm (Qwen3) q and k are contiguous; positions int64 with repeats."""
    q, k = randn(5, 4, 64), randn(5, 2, 64)
    positions = torch.tensor([9, 0, 9, 299, 3])
    cache = _cos_sin_cache(64)
    for g, w in zip(rotary_embedding(positions, q, k, cache), reference.rotary_embedding(positions, q, k, cache)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_rotary_rejects_mismatched_shapes():
    cache = _cos_sin_cache(64)
    with pytest.raises(ValueError, match="q \\[T, Q, D\\]"):
        rotary_embedding(torch.arange(3), randn(3, 4, 64), randn(3, 2, 32), cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(torch.arange(3), randn(3, 4, 32), randn(3, 2, 32), cache)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (32, 4), (60, 8), (60, 2)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", False)])
def test_moe_route_fp32_matches_reference(num_tokens, num_experts, top_k, scoring, renormalize):
    logits = randn(num_tokens, num_experts, scale=2.0)
    got_w, got_ids = moe_route(logits, top_k, scoring=scoring, renormalize=renormalize)
    want_w, want_ids = reference.moe_route(logits, top_k, scoring=scoring, renormalize=renormalize)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (32, 4), (60, 8)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", False)])
def test_moe_route_bf16_logits_and_strided_rows(num_experts, top_k, scoring, renormalize):
    """bf16 logits (the router's output dtype), read through a row stride wider than E."""
    wide = distinct_logits(7, num_experts + 5, torch.bfloat16, "cpu")
    logits = wide[:, :num_experts]
    got_w, got_ids = moe_route(logits, top_k, scoring=scoring, renormalize=renormalize)
    want_w, want_ids = reference.moe_route(logits, top_k, scoring=scoring, renormalize=renormalize)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


def test_moe_route_ties_pick_the_lowest_expert():
    logits = torch.tensor([[1.0, 3.0, 0.5, 3.0, 3.0, -1.0]])
    for scoring in ("softmax", "topk_softmax"):
        _, ids = moe_route(logits, 4, scoring=scoring, renormalize=True)
        assert ids.tolist() == [[1, 3, 4, 0]]


def test_moe_route_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown MoE scoring"):
        moe_route(randn(2, 8), 2, scoring="sigmoid", renormalize=True)
    with pytest.raises(ValueError, match="top_k <= E"):
        moe_route(randn(2, 8), 9, scoring="softmax", renormalize=True)
    with pytest.raises(ValueError, match="E <= 256"):
        moe_route(randn(2, 257), 2, scoring="softmax", renormalize=True)
