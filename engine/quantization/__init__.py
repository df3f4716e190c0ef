"""Load-time weight transforms (quantisation) applied to a built model from outside the model code.

    n = apply_quantization(model, engine_config.quantization)   # right after load, before the KV pool is sized
"""
from __future__ import annotations

import gc

import torch
from torch import nn

from loraplex.engine.quantization.int8_experts import Int8FusedExperts, quantize_experts_int8
from loraplex.engine.quantization.mxfp4_experts import Mxfp4FusedExperts, quantize_experts_mxfp4

# "int8": INT8 weight-only experts (int8_experts.py); "mxfp4": MXFP4 weight-only experts (mxfp4_experts.py)
METHODS = {"int8": quantize_experts_int8, "mxfp4": quantize_experts_mxfp4}


def apply_quantization(model: nn.Module, method: str | None, lora_slots=None) -> int:
    """Quantise ``model`` in place with ``method`` (None: nothing); returns the number of layers converted.

    The float weights replaced are freed before this returns (and on CUDA handed back to the driver with
    ``torch.cuda.empty_cache()``), so memory-based KV pool sizing that follows sees them free. ``lora_slots``:
    see ``replace.replace_experts`` (only needed when multi-LoRA is already attached)."""
    if method is None:
        return 0
    if method not in METHODS:
        raise ValueError(f"quantization {method!r} is not supported; choose one of {', '.join(METHODS)} or None")
    count = METHODS[method](model, lora_slots=lora_slots)
    gc.collect()  # reference cycles of the replaced modules, if any
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return count


__all__ = ["METHODS", "Int8FusedExperts", "Mxfp4FusedExperts", "apply_quantization", "quantize_experts_int8",
           "quantize_experts_mxfp4"]
