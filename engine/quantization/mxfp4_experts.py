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
from loraplex.engine.quantization.replace import replace_experts
from loraplex.kernels import ops
from loraplex.kernels.mxfp4 import check_mxfp4_k, dequantize_mxfp4, quantize_mxfp4


class Mxfp4FusedExperts(FusedExperts):
    """FusedExperts with MXFP4 weight-only w13/w2 (uint8 blocks + E8M0 scales). Built by ``from_float``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str,
                 alpha: float, limit: float, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # FusedExperts.__init__ would allocate float w13 / w2
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.dtype = dtype  # the float model's dtype: dequantised weights and outputs use it
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None

    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: FusedExperts) -> "Mxfp4FusedExperts":
        """Quantise ``experts`` (its float weights are not modified; drop them to free memory)."""
        if type(experts) is not FusedExperts:
            raise TypeError(f"expected float FusedExperts, got {type(experts).__name__} (MXFP4 quantises the float "
                            f"weights once)")
        check_mxfp4_k(experts.hidden_size, "hidden_size (K of w13)")
        check_mxfp4_k(experts.w2.shape[-1], "the expert intermediate size per rank (K of w2)")
        q = cls(experts.num_experts, experts.hidden_size, experts.intermediate_size, activation=experts.activation,
                alpha=experts.alpha, limit=experts.limit, dtype=experts.w13.dtype)
        for name in ("w13", "w2"):
            w = getattr(experts, name)
            # one expert at a time: the float32 temporaries of quantize_mxfp4 stay one expert large
            parts = [quantize_mxfp4(w[e]) for e in range(w.shape[0])]
            q.register_buffer(f"{name}_blocks", torch.stack([p[0] for p in parts]))  # [E, N, K/2] uint8
            q.register_buffer(f"{name}_scales", torch.stack([p[1] for p in parts]))  # [E, N, K/32] uint8
        q.b13, q.b2 = experts.b13, experts.b2
        return q

    # Inspection and tests: dequantised on access, never stored (no engine path reads them).
    @property
    def w13(self) -> torch.Tensor:
        return self._dequant(self.w13_blocks, self.w13_scales)

    @property
    def w2(self) -> torch.Tensor:
        return self._dequant(self.w2_blocks, self.w2_scales)

    def _dequant(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.stack([dequantize_mxfp4(blocks[e], scales[e], self.dtype) for e in range(blocks.shape[0])])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        return ops.fused_moe_mxfp4(x, self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales,
                                   topk_weights, topk_ids, activation=self.activation, b13=self.b13, b2=self.b2,
                                   alpha=self.alpha, limit=self.limit)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", mxfp4 weight-only"


@torch.no_grad()
def quantize_experts_mxfp4(model: nn.Module, lora_slots=None) -> int:
    """Replace every float FusedExperts of ``model`` by an Mxfp4FusedExperts, in place; returns how many.
    Before or after multi-LoRA is attached; ``lora_slots``: see ``replace.replace_experts``."""
    return replace_experts(model, Mxfp4FusedExperts.from_float, lora_slots=lora_slots, what="mxfp4")


__all__ = ["Mxfp4FusedExperts", "quantize_experts_mxfp4"]
