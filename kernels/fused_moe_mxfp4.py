"""Fused MoE with MXFP4 weight-only experts (GPT-OSS's format, ``mxfp4.py``), dequantisation inside the GEMMs.

Same kernels as ``fused_moe`` with W_MXFP4 set: each K step loads a [BLOCK_K/2, BLOCK_N] byte tile and its
[BLOCK_K/32, BLOCK_N] E8M0 scales and decodes them to the weight tile (``mxfp4_dequant.mxfp4_tile``) before the
dot. The scale is per 32 K elements, so it multiplies the tile, not the accumulator. Decode reads 4.25 bits per
weight: about half of INT8's bytes, a quarter of bf16's. BLOCK_K must be a power of two >= 32 (whole scale
blocks per step); K need not be a multiple of BLOCK_K, only of 32. Configs: tuned files of op "fused_moe_mxfp4"
(``loraplex tune``), else ``fused_moe.DEFAULT_CONFIG`` (BLOCK_K 64: 32 code bytes a column per step, and no K
mask at GPT-OSS's K = 2880 = 45 x 64).
"""
from __future__ import annotations

import torch

from loraplex.kernels.fused_moe import run_moe
from loraplex.kernels.reference_lora import check_mxfp4_weights


def fused_moe_mxfp4(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids, *, activation="silu",
                    b13=None, b2=None, alpha=1.702, limit=7.0, config: dict | None = None) -> torch.Tensor:
    """Same contract as ``reference_lora.fused_moe_mxfp4``; ``config`` overrides the tuned config (the tuner)."""
    check_mxfp4_weights(w13_blocks, w13_scales, w2_blocks, w2_scales)
    return run_moe(x, w13_blocks, w2_blocks, topk_weights, topk_ids, activation=activation, b13=b13, b2=b2,
                   alpha=alpha, limit=limit, w13_scale=w13_scales.contiguous(), w2_scale=w2_scales.contiguous(),
                   config=config, op="fused_moe_mxfp4")
