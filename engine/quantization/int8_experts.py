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

from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization.replace import replace_experts
from loraplex.kernels import ops
from loraplex.kernels.reference_lora import quantize_int8_per_channel


class Int8FusedExperts(FusedExperts):
    """FusedExperts with INT8 weight-only w13/w2 (per output channel scales). Built by ``from_float``."""

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
    def from_float(cls, experts: FusedExperts) -> "Int8FusedExperts":
        """Quantise ``experts`` (its float weights are not modified; drop them to free memory)."""
        if isinstance(experts, Int8FusedExperts):
            raise TypeError("experts are already INT8; quantize_experts_int8 applies once")
        if not isinstance(experts, FusedExperts):
            raise TypeError(f"expected FusedExperts, got {type(experts).__name__}")
        q = cls(experts.num_experts, experts.hidden_size, experts.intermediate_size, activation=experts.activation,
                alpha=experts.alpha, limit=experts.limit, dtype=experts.w13.dtype)
        for name in ("w13", "w2"):
            w = getattr(experts, name)
            # one expert at a time: the float32 temporaries of quantize_int8_per_channel stay one expert large
            parts = [quantize_int8_per_channel(w[e]) for e in range(w.shape[0])]
            q.register_buffer(f"{name}_q", torch.stack([p[0] for p in parts]))          # [E, N, K] int8
            q.register_buffer(f"{name}_scale", torch.stack([p[1] for p in parts]))      # [E, N] float32
        q.b13, q.b2 = experts.b13, experts.b2
        return q

    # Inspection and tests: dequantised on access, never stored (no engine path reads them).
    @property
    def w13(self) -> torch.Tensor:
        return self._dequant(self.w13_q, self.w13_scale)

    @property
    def w2(self) -> torch.Tensor:
        return self._dequant(self.w2_q, self.w2_scale)

    def _dequant(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=self.dtype, device=q.device)
        for e in range(q.shape[0]):  # float32 temporaries one expert large
            out[e] = (q[e].float() * scale[e, :, None]).to(self.dtype)
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        return ops.fused_moe_int8(x, self.w13_q, self.w13_scale, self.w2_q, self.w2_scale, topk_weights,
                                  topk_ids, activation=self.activation, b13=self.b13, b2=self.b2,
                                  alpha=self.alpha, limit=self.limit)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8 weight-only"


@torch.no_grad()
def quantize_experts_int8(model: nn.Module, lora_slots=None) -> int:
    """Replace every float FusedExperts of ``model`` by an Int8FusedExperts, in place; returns how many.
    Before or after multi-LoRA is attached; ``lora_slots``: see ``replace.replace_experts``."""
    return replace_experts(model, Int8FusedExperts.from_float, lora_slots=lora_slots, what="int8")


__all__ = ["Int8FusedExperts", "quantize_experts_int8"]
