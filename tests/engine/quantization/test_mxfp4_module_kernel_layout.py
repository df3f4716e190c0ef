"""Mxfp4FusedExperts in the CUDA GEMMs' layout (``use_kernel_layout``): the same function, inspection and
to_float read through it, and the plain layout stays the only one that is sharded. The repack itself runs on
CUDA only; here it is applied by hand, which is what ``use_kernel_layout`` does on a CUDA module."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization import Mxfp4FusedExperts
from loraplex.engine.quantization.mxfp4_experts import use_mxfp4_kernel_layout
from loraplex.kernels.mxfp4 import prepare_for_kernel


def _experts(e=4, h=96, i=64, seed=0) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(e, h, i, bias=True, activation="swiglu_clamp")
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return ex


def _repack(m: Mxfp4FusedExperts) -> None:
    m.w13_blocks, m.w13_scales = prepare_for_kernel(m.w13_blocks, m.w13_scales)
    m.w2_blocks, m.w2_scales = prepare_for_kernel(m.w2_blocks, m.w2_scales)


def test_kernel_layout_computes_the_same_function_and_dequantises_the_same():
    plain = Mxfp4FusedExperts.from_float(_experts())
    packed = Mxfp4FusedExperts.from_float(_experts())
    w13, w2 = plain.w13.clone(), plain.w2.clone()
    _repack(packed)
    assert packed.in_kernel_layout and not plain.in_kernel_layout
    assert packed.w13_blocks.dtype == torch.int32
    torch.testing.assert_close(packed.w13, w13, rtol=0, atol=0)
    torch.testing.assert_close(packed.w2, w2, rtol=0, atol=0)
    x = torch.randn(7, 96)
    ids = torch.randint(0, 4, (7, 2))
    weights = torch.rand(7, 2)
    torch.testing.assert_close(packed(x, weights, ids), plain(x, weights, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.to_float().w13, w13, rtol=0, atol=0)


def test_kernel_layout_is_not_sharded_and_is_cuda_only():
    m = Mxfp4FusedExperts.from_float(_experts())
    assert use_mxfp4_kernel_layout(torch.nn.Sequential(m)) == 0  # CPU: the plain layout stays
    assert not m.in_kernel_layout
    _repack(m)
    with pytest.raises(ValueError, match="before use_kernel_layout"):
        m.shard_intermediate(torch.arange(64), torch.arange(0, 32))
