"""Every Triton op at the tiny checkpoints' shapes (``engine/testing/tiny.py``) in float32, as the engine calls
it: hidden 72, 6 query / 2 KV heads of 12, expert intermediate 40, 6 experts top-2, block size 4, sliding
window 8, default configs. Errors must stay at float32 rounding (max |got - ref| / max |ref| <= 1e-5), far
under what tf32 products give (~1e-3, emulated by the conftest), so these also guard the IEEE dots."""
from __future__ import annotations

import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.fused_moe import fused_moe
from loraplex.kernels.fused_moe_lora import fused_moe_lora
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_shrink import lora_shrink
from loraplex.kernels.paged_attention import paged_attention
from loraplex.kernels.rms_norm import rms_norm
from tests.kernels.lora_inputs import dense_lora, token_adapters
from tests.kernels.test_paged_attention import _case

H, Q, KV, D, I, E, A, BS, WINDOW = 72, 6, 2, 12, 40, 6, 2, 4, 8
TOL = 1e-5


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_fused_moe_tiny_shapes(num_tokens, family):
    """Mixtral: softmax routing renormalised, SiLU; GPT-OSS: top-k softmax, clamped SwiGLU, expert biases.
    Weights at the tiny models' init scale (0.2) so activations are large, as in the engine."""
    x = torch.randn(num_tokens, H) * 2
    w13, w2 = torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2
    logits = torch.randn(num_tokens, E) * 2
    gpt = family == "gpt_oss"
    weights, ids = reference.moe_route(logits, A, scoring="topk_softmax" if gpt else "softmax", renormalize=not gpt)
    kw = dict(activation="swiglu_clamp" if gpt else "silu", b13=torch.randn(E, 2 * I) * 0.2 if gpt else None,
              b2=torch.randn(E, H) * 0.2 if gpt else None)
    got = fused_moe(x, w13, w2, weights, ids, **kw)
    assert rel_max(got, reference.fused_moe(x, w13, w2, weights, ids, **kw)) <= TOL


@pytest.mark.parametrize("window,with_sinks", [(None, False), (WINDOW, True)])
def test_paged_attention_tiny_shapes(window, with_sinks):
    """A step of the engine test: prefill chunks (one longer than the window) mixed with decodes."""
    q, kc, vc, tables, seq_lens, qsl = _case([37, 14, 3, 30], [13, 1, 3, 1], num_q=Q, num_kv=KV, d=D, bs=BS)
    kw = dict(sliding_window=window, sinks=torch.randn(Q) if with_sinks else None)
    got = paged_attention(q * 3, kc, vc, tables, seq_lens, qsl, D ** -0.5, **kw)
    want = reference.paged_attention(q * 3, kc, vc, tables, seq_lens, qsl, D ** -0.5, **kw)
    assert rel_max(got, want) <= TOL


def test_rms_norm_tiny_shapes():
    """Hidden rows (72, with residual) and q/k-norm rows (head dim 12)."""
    x, res, w = torch.randn(9, H), torch.randn(9, H), torch.randn(H)
    for got, want in zip(rms_norm(x, w, 1e-5, res), reference.rms_norm(x, w, 1e-5, res)):
        assert rel_max(got, want) <= TOL
    heads, wd = torch.randn(9 * Q, D), torch.randn(D)
    assert rel_max(rms_norm(heads, wd, 1e-6), reference.rms_norm(heads, wd, 1e-6)) <= TOL


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_dense_lora_tiny_shapes(num_tokens):
    """qkv LoRA: K = 72, slices (72, 24, 24), 4 slots of mixed ranks padded to 16."""
    slices = (Q * D, KV * D, KV * D)
    lora_a, lora_b, scaling = dense_lora(3, 4, 16, H, sum(slices))
    x, idx = torch.randn(num_tokens, H), token_adapters(num_tokens, 4)
    idx[-1] = 2  # at least one token with an adapter (M = 1 too)
    buf = lora_shrink(x, lora_a, idx, scaling)
    want_buf = ref.lora_shrink(x, lora_a, idx, scaling)
    assert rel_max(buf, want_buf) <= TOL
    y = torch.randn(num_tokens, sum(slices))
    want = y.clone()
    lora_expand(y, buf, lora_b, idx, slices)
    ref.lora_expand(want, want_buf, lora_b, idx, slices)
    assert rel_max(y, want) <= TOL


@pytest.mark.parametrize("target", ["gate_up", "down"])
def test_fused_moe_lora_tiny_shapes(target):
    num_tokens, loras, rank = 33, 3, 16
    k, n = (H, 2 * I) if target == "gate_up" else (I, H)
    x = torch.randn(num_tokens if target == "gate_up" else num_tokens * A, k)
    lora_a, lora_b = torch.randn(loras, E, rank, k) / k ** 0.5, torch.randn(loras, E, n, rank)
    weights, ids = reference.moe_route(torch.randn(num_tokens, E), A, scoring="softmax", renormalize=True)
    tw = weights if target == "down" else None
    idx, scaling = token_adapters(num_tokens, loras), torch.rand(loras) + 0.5
    y = torch.randn(num_tokens * A, n)
    want = y.clone()
    fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, tw)
    ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, tw)
    assert rel_max(y, want) <= TOL
