"""INT8 weight-only expert quantisation, as a transform of a built model (no change to the model code).

    model = load_model(...)                       # or engine.runner.model, with or without LoRA attached
    n = quantize_experts_int8(model)              # every FusedExperts -> Int8FusedExperts, in place

Per expert and output channel: w ≈ q * scale, q int8 in [-127, 127], scale float32 (symmetric, absmax / 127).
Shapes (E experts, H hidden, I intermediate): w13 [E, 2I, H] -> w13_q int8 [E, 2I, H] + w13_scale [E, 2I];
w2 [E, H, I] -> w2_q int8 [E, H, I] + w2_scale [E, H]. Biases stay in the model dtype.

The base path runs ``ops.fused_moe_int8`` (Triton: int8 tiles widened in registers, the scale on the fp32
accumulator; elsewhere the torch reference). ``LoRAFusedExperts`` passes ``w13_q`` / ``w13_scale`` / ``w2_q`` /
``w2_scale`` to ``ops.moe_experts_lora``, whose GEMMs dequantise the same way (fused on CUDA; per expert, to the
model dtype, in the reference), so the LoRA path computes the float model with ``q * scale`` weights. The
``w13`` / ``w2`` properties (dequantised on each access) remain for inspection and tests only.
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.quantization.quantized_experts import QuantizedFusedExperts
from loraplex.engine.quantization.replace import replace_experts
from loraplex.kernels import ops
from loraplex.kernels.reference_lora import quantize_int8_per_channel


class Int8FusedExperts(QuantizedFusedExperts):
    """FusedExperts with INT8 weight-only w13/w2 (per output channel scales). Built by ``from_float``."""

    BUFFERS = ("q", "scale")
    FORMAT = "int8"

    @staticmethod
    def quantize_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_per_channel(w)  # [N, K] int8, [N] float32

    def dequantize_expert(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (q.float() * scale[:, None]).to(self.dtype)

    @classmethod
    def shapes(cls, codes: tuple[torch.Tensor, torch.Tensor], name: str) -> tuple[int, int, int]:
        e, n, k = codes[0].shape  # q int8 [E, N, K], scale [E, N]
        return e, n, k

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        return ops.fused_moe_int8(x, self.w13_q, self.w13_scale, self.w2_q, self.w2_scale, topk_weights,
                                  topk_ids, activation=self.activation, b13=self.b13, b2=self.b2,
                                  alpha=self.alpha, limit=self.limit)


@torch.no_grad()
def quantize_experts_int8(model: nn.Module, lora_slots=None) -> int:
    """Replace every float FusedExperts of ``model`` by an Int8FusedExperts, in place; returns how many.
    Before or after multi-LoRA is attached; ``lora_slots``: see ``replace.replace_experts``."""
    return replace_experts(model, Int8FusedExperts.from_float, lora_slots=lora_slots, what="int8")


__all__ = ["Int8FusedExperts", "quantize_experts_int8"]
