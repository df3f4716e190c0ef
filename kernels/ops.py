"""The ops the engine calls. Each forwards to ``dispatch.resolve``; signatures and layouts are documented in
``reference.py``, which is the specification every Triton launcher must match."""
from __future__ import annotations

import torch

from loraplex.kernels import reference_lora
from loraplex.kernels.dispatch import resolve
from loraplex.kernels.reference import attention_scale  # noqa: F401  (host-side helper)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    return resolve("rms_norm", x)(x, weight, eps, residual)


def rms_norm_router(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                    router_weight: torch.Tensor, router_bias: torch.Tensor | None):
    return resolve("rms_norm_router", x)(x, weight, eps, residual, router_weight, router_bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return resolve("silu_and_mul", x)(x)


def swiglu_clamp_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return resolve("swiglu_clamp_and_mul", x)(x, alpha, limit)


def rotary_embedding(positions, q, k, cos_sin_cache):
    return resolve("rotary_embedding", q)(positions, q, k, cos_sin_cache)


def rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping):
    return resolve("rotary_embedding_and_cache", q)(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                                    slot_mapping)


def moe_route(router_logits, top_k, *, scoring, renormalize):
    return resolve("moe_route", router_logits)(router_logits, top_k, scoring=scoring, renormalize=renormalize)


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


# ---- multi-LoRA, MoE alignment and INT8 / MXFP4 MoE (references and layouts in ``reference_lora.py``)


def _resolve_ext(name: str, tensor: torch.Tensor):
    try:
        return resolve(name, tensor)
    except AttributeError:  # no core reference: this op's reference lives in reference_lora
        return getattr(reference_lora, name)


def fused_moe_int8(x, w13_q, w13_scale, w2_q, w2_scale, topk_weights, topk_ids, *, activation="silu", b13=None,
                   b2=None, alpha=1.702, limit=7.0):
    return _resolve_ext("fused_moe_int8", x)(x, w13_q, w13_scale, w2_q, w2_scale, topk_weights, topk_ids,
                                             activation=activation, b13=b13, b2=b2, alpha=alpha, limit=limit)


def fused_moe_mxfp4(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids, *, activation="silu",
                    b13=None, b2=None, alpha=1.702, limit=7.0):
    return _resolve_ext("fused_moe_mxfp4", x)(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights,
                                              topk_ids, activation=activation, b13=b13, b2=b2, alpha=alpha,
                                              limit=limit)


def lora_segments(token_lora_idx: torch.Tensor, max_loras: int):
    """The step's token grouping by adapter slot, to compute once per step and pass as ``segments=`` to every
    layer's ``lora_shrink`` / ``lora_expand`` (one launch saved per call). None where the references run
    (they group by themselves)."""
    if _resolve_ext("lora_shrink", token_lora_idx) is reference_lora.lora_shrink:
        return None
    from loraplex.kernels.lora_shrink import lora_segments as triton_segments

    return triton_segments(token_lora_idx, max_loras)


def _with_segments(fn, segments) -> dict:
    return {} if segments is None or fn.__module__ == reference_lora.__name__ else {"segments": segments}


def lora_shrink(x, lora_a, token_lora_idx, scaling, *, segments=None) -> torch.Tensor:
    fn = _resolve_ext("lora_shrink", x)
    return fn(x, lora_a, token_lora_idx, scaling, **_with_segments(fn, segments))


def lora_expand(y, buf, lora_b, token_lora_idx, output_slices, *, segments=None) -> None:
    fn = _resolve_ext("lora_expand", y)
    return fn(y, buf, lora_b, token_lora_idx, output_slices, **_with_segments(fn, segments))


def lora_shrink_expand(y, x, lora_a, lora_b, token_lora_idx, scaling, output_slices, *, segments=None) -> None:
    fn = _resolve_ext("lora_shrink_expand", y)
    return fn(y, x, lora_a, lora_b, token_lora_idx, scaling, output_slices, **_with_segments(fn, segments))


def moe_align(topk_ids, num_experts, block_size):
    return _resolve_ext("moe_align", topk_ids)(topk_ids, num_experts, block_size)


def moe_align_lora(topk_ids, token_lora_idx, num_experts, max_loras, block_size):
    return _resolve_ext("moe_align_lora", topk_ids)(topk_ids, token_lora_idx, num_experts, max_loras, block_size)


def fused_moe_lora(y, x, lora_a, lora_b, topk_ids, token_lora_idx, scaling, topk_weights=None) -> None:
    return _resolve_ext("fused_moe_lora", y)(y, x, lora_a, lora_b, topk_ids, token_lora_idx, scaling, topk_weights)


def moe_experts_lora(x, w13, w2, topk_weights, topk_ids, token_lora_idx, scaling, *, w13_lora=None, w2_lora=None,
                     activation="silu", b13=None, b2=None, alpha=1.702, limit=7.0, w13_scale=None, w2_scale=None):
    """fused_moe with expert LoRA (either target may be None) and optionally quantised weights (``w*_scale``
    given: w13 / w2 int8 with per-channel scales, or uint8 MXFP4 blocks with E8M0 scales). On CUDA one
    graph-capturable composition of Triton kernels (``moe_experts_lora.py``)."""
    return _resolve_ext("moe_experts_lora", x)(
        x, w13, w2, topk_weights, topk_ids, token_lora_idx, scaling, w13_lora=w13_lora, w2_lora=w2_lora,
        activation=activation, b13=b13, b2=b2, alpha=alpha, limit=limit, w13_scale=w13_scale, w2_scale=w2_scale)
