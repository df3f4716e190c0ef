"""kernels/rms_norm_router.py under the interpreter against the reference (residual add, RMSNorm, then the router's
product) at awkward sizes: hidden sizes off the power of two, expert counts off the expert block, with and without
the router's bias, and the row count past MAX_TOKENS that falls back to the norm then the GEMM. In float32: the
interpreter's bfloat16 rounds by truncation, so the bf16 contract (the norm bit for bit, the logits within one unit
in the last place) is checked on the GPU by benchmarks/kernels/check_gpu.py."""
from __future__ import annotations

import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels import rms_norm_router as mod


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("hidden, experts", [(64, 8), (200, 13), (96, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(m, hidden, experts, bias):
    gen = torch.Generator().manual_seed(m * 1000 + hidden + experts)
    x, res = torch.randn(m, hidden, generator=gen), torch.randn(m, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    rw = torch.randn(experts, hidden, generator=gen) / hidden ** 0.5
    rb = torch.randn(experts, generator=gen) if bias else None
    out, res_out, logits = mod.rms_norm_router(x, w, 1e-6, res, rw, rb)
    want_out, want_res, want_logits = reference.rms_norm_router(x, w, 1e-6, res, rw, rb)
    torch.testing.assert_close(res_out, want_res)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert logits.shape == (m, experts)


def test_past_max_tokens_runs_the_norm_then_the_gemm(monkeypatch):
    monkeypatch.setattr(mod, "MAX_TOKENS", 4)
    calls = []
    kernel = mod._rms_norm_router_kernel
    monkeypatch.setattr(mod, "_rms_norm_router_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (calls.append(grid), kernel[grid])[1]})())
    gen = torch.Generator().manual_seed(3)
    for m in (4, 5):
        x, res = torch.randn(m, 64, generator=gen), torch.randn(m, 64, generator=gen)
        w, rw = torch.randn(64, generator=gen), torch.randn(8, 64, generator=gen)
        got = mod.rms_norm_router(x, w, 1e-6, res, rw, None)
        want = reference.rms_norm_router(x, w, 1e-6, res, rw, None)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert calls == [(4, 1)]  # 5 rows: no launch of the fused kernel


def test_rejects_bad_shapes():
    x, res, w = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="router_weight must be"):
        mod.rms_norm_router(x, w, 1e-6, res, torch.randn(4, 6), None)
    with pytest.raises(ValueError, match="router_bias must be"):
        mod.rms_norm_router(x, w, 1e-6, res, torch.randn(4, 8), torch.randn(3))
    with pytest.raises(ValueError, match="weight \\[H\\]"):
        mod.rms_norm_router(x, torch.randn(4), 1e-6, res, torch.randn(4, 8), None)
