"""MXFP4 weight-only expert quantisation (GPT-OSS's native expert format), as a transform of a built model.

    model = load_model(...)                       # or engine.runner.model, with or without LoRA attached
    n = quantize_experts_mxfp4(model)             # every float FusedExperts -> Mxfp4FusedExperts, in place

Format (``kernels/mxfp4.py``): per expert, output channel and block of 32 input features, one E8M0 power-of-two
scale and 32 E2M1 codes (4.25 bits per weight, half of INT8). Shapes (E experts, H hidden, I intermediate):
w13 [E, 2I, H] -> w13_blocks uint8 [E, 2I, H/2] + w13_scales uint8 [E, 2I, H/32]; w2 [E, H, I] -> w2_blocks
[E, H, I/2] + w2_scales [E, H, I/32]. H and I (per tensor-parallel rank) must be multiples of 32. Biases stay in
the model dtype.

The base path runs ``ops.fused_moe_mxfp4`` (Triton: codes and scales decoded to a weight tile inside the GEMM's
K loop; elsewhere the torch reference). ``LoRAFusedExperts`` passes the blocks and scales to
``ops.moe_experts_lora`` (uint8 weights with ``w*_scale``: MXFP4), whose GEMMs decode the same way, so the LoRA
path computes the float model with the dequantised weights. ``w13`` / ``w2`` (dequantised on each access) are
for inspection and tests only.
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization.quantized_experts import QuantizedFusedExperts
from loraplex.engine.quantization.replace import replace_experts
from loraplex.kernels import ops
from loraplex.kernels.mxfp4 import check_mxfp4_k, dequantize_mxfp4, quantize_mxfp4


class Mxfp4FusedExperts(QuantizedFusedExperts):
    """FusedExperts with MXFP4 weight-only w13/w2 (uint8 blocks + E8M0 scales). Built by ``from_float``."""

    BUFFERS = ("blocks", "scales")
    FORMAT = "mxfp4"

    @classmethod
    def check_float(cls, experts: FusedExperts) -> None:
        check_mxfp4_k(experts.hidden_size, "hidden_size (K of w13)")
        check_mxfp4_k(experts.w2.shape[-1], "the expert intermediate size per rank (K of w2)")

    @staticmethod
    def quantize_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_mxfp4(w)  # [N, K/2] uint8 codes, [N, K/32] uint8 scales

    def dequantize_expert(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_mxfp4(blocks, scales, self.dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        return ops.fused_moe_mxfp4(x, self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales,
                                   topk_weights, topk_ids, activation=self.activation, b13=self.b13, b2=self.b2,
                                   alpha=self.alpha, limit=self.limit)


@torch.no_grad()
def quantize_experts_mxfp4(model: nn.Module, lora_slots=None) -> int:
    """Replace every float FusedExperts of ``model`` by an Mxfp4FusedExperts, in place; returns how many.
    Before or after multi-LoRA is attached; ``lora_slots``: see ``replace.replace_experts``."""
    return replace_experts(model, Mxfp4FusedExperts.from_float, lora_slots=lora_slots, what="mxfp4")


__all__ = ["Mxfp4FusedExperts", "quantize_experts_mxfp4"]
