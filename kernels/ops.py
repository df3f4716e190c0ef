"""The ops the engine calls. Each forwards to ``dispatch.resolve``; signatures and layouts are documented in
``reference.py``, which is the specification every Triton launcher must match."""
from __future__ import annotations

import torch

from loraplex.kernels.dispatch import resolve
from loraplex.kernels.reference import attention_scale, moe_route  # noqa: F401  (host-side helpers)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    return resolve("rms_norm", x)(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return resolve("silu_and_mul", x)(x)


def swiglu_clamp_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return resolve("swiglu_clamp_and_mul", x)(x, alpha, limit)


def rotary_embedding(positions, q, k, cos_sin_cache):
    return resolve("rotary_embedding", q)(positions, q, k, cos_sin_cache)


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, activation="silu", b13=None, b2=None, alpha=1.702, limit=7.0):
    return resolve("fused_moe", x)(x, w13, w2, topk_weights, topk_ids, activation=activation, b13=b13, b2=b2,
                                   alpha=alpha, limit=limit)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    return resolve("reshape_and_cache", key)(key, value, k_cache, v_cache, slot_mapping)


def copy_blocks(k_caches, v_caches, block_mapping) -> None:
    return resolve("copy_blocks", block_mapping)(k_caches, v_caches, block_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *,
                    sliding_window=None, sinks=None):
    return resolve("paged_attention", q)(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         sliding_window=sliding_window, sinks=sinks)
