"""Load-time weight transforms (quantisation) applied to a built model from outside the model code.

    n = apply_quantization(model, engine_config.quantization)   # right after load, before the KV pool is sized
"""
from __future__ import annotations

import gc

import torch
from torch import nn

from loraplex.engine.quantization.int8_experts import Int8FusedExperts, quantize_experts_int8

METHODS = ("int8",)  # "int8": INT8 weight-only experts (int8_experts.py)


def apply_quantization(model: nn.Module, method: str | None, lora_slots=None) -> int:
    """Quantise ``model`` in place with ``method`` (None: nothing); returns the number of layers converted.

    The float weights replaced are freed before this returns (and on CUDA handed back to the driver with
    ``torch.cuda.empty_cache()``), so memory-based KV pool sizing that follows sees them free. ``lora_slots``:
    see ``quantize_experts_int8`` (only needed when multi-LoRA is already attached)."""
    if method is None:
        return 0
    if method not in METHODS:
        raise ValueError(f"quantization {method!r} is not supported; choose one of {', '.join(METHODS)} or None")
    count = quantize_experts_int8(model, lora_slots=lora_slots)
    gc.collect()  # reference cycles of the replaced modules, if any
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return count


__all__ = ["METHODS", "Int8FusedExperts", "apply_quantization", "quantize_experts_int8"]
