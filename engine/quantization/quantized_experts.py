"""What the INT8 and MXFP4 expert formats share: a FusedExperts without float weights, built from a float one
expert by expert, whose ``w13`` / ``w2`` dequantise on access (inspection and tests only).

A format subclass names its two buffers per weight (``BUFFERS``, e.g. ``("q", "scale")`` -> ``w13_q``,
``w13_scale``) and gives ``quantize_expert(w [N, K]) -> (codes, scales)`` and ``dequantize_expert(codes, scales,
dtype) -> [N, K]``; ``check_float`` may refuse a float module it cannot convert.
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.models.layers.moe import FusedExperts


class QuantizedFusedExperts(FusedExperts):
    BUFFERS: tuple[str, str] = ("", "")
    FORMAT = ""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str,
                 alpha: float, limit: float, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # FusedExperts.__init__ would allocate float w13 / w2
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.dtype = dtype  # the float model's dtype: dequantised weights and outputs use it
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None

    # ---- the format -----------------------------------------------------------------------------------------
    @staticmethod
    def quantize_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dequantize_expert(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def check_float(cls, experts: FusedExperts) -> None:
        """Raise when ``experts`` cannot be converted (the shared checks are done already)."""

    # ---- conversion -----------------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: FusedExperts):
        """Quantise ``experts`` (its float weights are not modified; drop them to free memory)."""
        if type(experts) is not FusedExperts:
            raise TypeError(f"expected float FusedExperts, got {type(experts).__name__} ({cls.FORMAT} quantises the "
                            f"float weights once)")
        cls.check_float(experts)
        q = cls(experts.num_experts, experts.hidden_size, experts.intermediate_size, activation=experts.activation,
                alpha=experts.alpha, limit=experts.limit, dtype=experts.w13.dtype)
        codes_name, scales_name = cls.BUFFERS
        for name in ("w13", "w2"):
            w = getattr(experts, name)
            # one expert at a time: the float32 temporaries of the quantiser stay one expert large
            parts = [cls.quantize_expert(w[e]) for e in range(w.shape[0])]
            q.register_buffer(f"{name}_{codes_name}", torch.stack([p[0] for p in parts]))
            q.register_buffer(f"{name}_{scales_name}", torch.stack([p[1] for p in parts]))
        q.b13, q.b2 = experts.b13, experts.b2
        return q

    # ---- inspection and tests: dequantised on access, never stored (no engine path reads them) ---------------
    @property
    def w13(self) -> torch.Tensor:
        return self._dequant("w13")

    @property
    def w2(self) -> torch.Tensor:
        return self._dequant("w2")

    def _dequant(self, name: str) -> torch.Tensor:
        codes_name, scales_name = self.BUFFERS
        codes, scales = getattr(self, f"{name}_{codes_name}"), getattr(self, f"{name}_{scales_name}")
        return torch.stack([self.dequantize_expert(codes[e], scales[e]) for e in range(codes.shape[0])])

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.FORMAT} weight-only"
