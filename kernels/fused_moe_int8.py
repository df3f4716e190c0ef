"""Fused MoE with INT8 weight-only experts (per-output-channel scales, dequantisation fused into the GEMMs).

Same kernels as ``fused_moe`` with W_INT8 set: int8 tiles are widened in registers and the scale multiplies
the fp32 accumulator, so decode reads half the weight bytes of bf16.
"""
from __future__ import annotations

import torch

from loraplex.kernels.fused_moe import run_moe


def fused_moe_int8(x, w13_q, w13_scale, w2_q, w2_scale, topk_weights, topk_ids, *, activation="silu", b13=None,
                   b2=None, alpha=1.702, limit=7.0, config: dict | None = None) -> torch.Tensor:
    """Same contract as ``reference_lora.fused_moe_int8``."""
    if w13_q.dtype != torch.int8 or w2_q.dtype != torch.int8:
        raise ValueError(f"fused_moe_int8 needs int8 weights, got {w13_q.dtype} and {w2_q.dtype}")
    if w13_scale.shape != w13_q.shape[:2] or w2_scale.shape != w2_q.shape[:2]:
        raise ValueError(f"scales must be per output channel: w13_scale {tuple(w13_q.shape[:2])}, w2_scale "
                         f"{tuple(w2_q.shape[:2])}; got {tuple(w13_scale.shape)} and {tuple(w2_scale.shape)}")
    return run_moe(x, w13_q, w2_q, topk_weights, topk_ids, activation=activation, b13=b13, b2=b2, alpha=alpha,
                   limit=limit, w13_scale=w13_scale.float().contiguous(), w2_scale=w2_scale.float().contiguous(),
                   config=config, op="fused_moe_int8")
