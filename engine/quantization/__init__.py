"""Load-time weight transforms (quantisation) applied to a built model from outside the model code."""
from loraplex.engine.quantization.int8_experts import Int8FusedExperts, quantize_experts_int8

__all__ = ["Int8FusedExperts", "quantize_experts_int8"]
