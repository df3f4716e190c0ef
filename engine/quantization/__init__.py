"""Load-time weight transforms (quantisation) applied to a built model from outside the model code.

    n = apply_quantization(model, engine_config.quantization)   # right after load, before the KV pool is sized

``apply_quantization`` brings every expert module to one format: None (float), "int8" or "mxfp4". A float
model's experts are quantised; a model loaded from an MXFP4 checkpoint (its experts are ``Mxfp4FusedExperts``
from the start, ``loader.py``) is left as it is for "mxfp4", dequantised for None, and dequantised then
re-quantised for "int8" (a second rounding: INT8 of the MXFP4 values), one layer at a time.
"""
from __future__ import annotations

import gc

import torch
from torch import nn

from loraplex.engine.lora.layers import LoRAFusedExperts
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization.int8_experts import Int8FusedExperts, quantize_experts_int8
from loraplex.engine.quantization.mxfp4_experts import Mxfp4FusedExperts, quantize_experts_mxfp4
from loraplex.engine.quantization.quantized_experts import QuantizedFusedExperts
from loraplex.engine.quantization.replace import replace_experts

# "int8": INT8 weight-only experts (int8_experts.py); "mxfp4": MXFP4 weight-only experts (mxfp4_experts.py)
METHODS = {"int8": quantize_experts_int8, "mxfp4": quantize_experts_mxfp4}
FORMATS: dict[str, type[QuantizedFusedExperts]] = {"int8": Int8FusedExperts, "mxfp4": Mxfp4FusedExperts}


def experts_format(module: nn.Module) -> str | None:
    """"int8" / "mxfp4" for a quantised expert module, None for a float one."""
    return module.FORMAT if isinstance(module, QuantizedFusedExperts) else None


def apply_quantization(model: nn.Module, method: str | None, lora_slots=None) -> int:
    """Bring every expert module of ``model`` to ``method`` (None: float experts), in place; returns the number of
    layers converted (0: already there). Float experts are quantised; quantised ones of another format are
    dequantised (None) or dequantised and re-quantised, one layer at a time, so one layer's float weights at most
    exist beside the quantised model (for None the float model is the result).

    The weights replaced are freed before this returns (and on CUDA handed back to the driver with
    ``torch.cuda.empty_cache()``), so memory-based KV pool sizing that follows sees them free. ``lora_slots``:
    see ``replace.replace_experts`` (only needed when multi-LoRA is already attached). Raises ValueError for an
    unknown method, or for a quantisation method on a model without experts."""
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization {method!r} is not supported; choose one of {', '.join(METHODS)} or None")
    if not _experts(model):
        if method is None:
            return 0
        METHODS[method](model, lora_slots=lora_slots)  # raises: no FusedExperts to quantise
    count = 0
    if method is not None:
        count += METHODS[method](model, lora_slots=lora_slots) if _has(model, None) else 0
    count += replace_experts(model, _converter(method), lora_slots=lora_slots, what=None,
                             select=lambda m: experts_format(m) not in (None, method))
    gc.collect()  # reference cycles of the replaced modules, if any
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return count


def _experts(model: nn.Module) -> list[FusedExperts]:
    """The expert modules of ``model``, the bases of LoRA wrappers included."""
    mods = [getattr(m, "base", m) if isinstance(m, LoRAFusedExperts) else m for m in model.modules()]
    return [m for m in mods if isinstance(m, FusedExperts)]


def _has(model: nn.Module, fmt: str | None) -> bool:
    return any(experts_format(m) == fmt for m in _experts(model))


def _converter(method: str | None):
    """Quantised experts of another format -> ``method``: dequantised, then quantised again unless None."""
    def convert(m: QuantizedFusedExperts) -> FusedExperts:
        float_experts = m.to_float()
        return float_experts if method is None else FORMATS[method].from_float(float_experts)
    return convert


__all__ = ["FORMATS", "METHODS", "Int8FusedExperts", "Mxfp4FusedExperts", "apply_quantization", "experts_format",
           "quantize_experts_int8", "quantize_experts_mxfp4"]
