"""Chooses, per call, the Triton launcher (CUDA tensors) or the torch reference (everything else).

    LORAPLEX_KERNELS=auto       (default) Triton on CUDA when the op has a Triton launcher, else reference
    LORAPLEX_KERNELS=reference  always the torch reference (debugging, bit-exact comparisons)

Triton launchers are registered by name in ``TRITON_LAUNCHERS`` as "module:function" under ``loraplex.kernels``
and imported lazily, so CPU-only machines never import triton.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Callable

import torch

from loraplex.kernels import reference

logger = logging.getLogger(__name__)

# op name -> "module:function" of its Triton launcher (same signature as reference.<op>).
TRITON_LAUNCHERS: dict[str, str] = {
    "rms_norm": "rms_norm:rms_norm",
    "rms_norm_router": "rms_norm_router:rms_norm_router",
    "silu_and_mul": "activation:silu_and_mul",
    "swiglu_clamp_and_mul": "activation:swiglu_clamp_and_mul",
    "rotary_embedding": "rotary:rotary_embedding",
    "rotary_embedding_and_cache": "rotary:rotary_embedding_and_cache",
    "moe_route": "moe_route:moe_route",
    "reshape_and_cache": "reshape_and_cache:reshape_and_cache",
    "copy_blocks": "copy_blocks:copy_blocks",
    "paged_attention": "paged_attention:paged_attention",
    "fused_moe": "fused_moe:fused_moe",
    "fused_moe_int8": "fused_moe_int8:fused_moe_int8",
    "fused_moe_mxfp4": "fused_moe_mxfp4:fused_moe_mxfp4",
    "lora_shrink": "lora_shrink:lora_shrink",
    "lora_expand": "lora_expand:lora_expand",
    "lora_shrink_expand": "lora_shrink_expand:lora_shrink_expand",
    "moe_align": "moe_align:moe_align",
    "moe_align_lora": "moe_align:moe_align_lora",
    "fused_moe_lora": "fused_moe_lora:fused_moe_lora",
    "moe_experts_lora": "moe_experts_lora:moe_experts_lora",
}


def kernel_mode() -> str:
    mode = os.environ.get("LORAPLEX_KERNELS", "auto")
    if mode not in ("auto", "reference"):
        raise ValueError(f"LORAPLEX_KERNELS={mode!r}: expected 'auto' or 'reference'")
    return mode


@functools.cache
def _load_launcher(name: str) -> Callable | None:
    target = TRITON_LAUNCHERS.get(name)
    if target is None:
        return None
    module, func = target.split(":")
    try:
        return getattr(importlib.import_module(f"loraplex.kernels.{module}"), func)
    except ImportError as e:  # triton missing or broken: the reference still works
        logger.warning("Triton launcher for %s unavailable (%s); using the torch reference", name, e)
        return None


def resolve(name: str, tensor: torch.Tensor) -> Callable:
    """The implementation of op ``name`` for inputs living where ``tensor`` lives."""
    if tensor.is_cuda and kernel_mode() == "auto":
        launcher = _load_launcher(name)
        if launcher is not None:
            return launcher
    return getattr(reference, name)
