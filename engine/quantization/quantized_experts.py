"""What the INT8 and MXFP4 expert formats share: a FusedExperts without float weights, built from a float one
expert by expert (``from_float``) or from tensors already in the format (``from_codes``: a quantised
checkpoint), whose ``w13`` / ``w2`` dequantise on access (inspection and tests only).

A format subclass names its two buffers per weight (``BUFFERS``, e.g. ``("q", "scale")`` -> ``w13_q``,
``w13_scale``) and gives ``quantize_expert(w [N, K]) -> (codes, scales)``, ``dequantize_expert(codes, scales)
-> [N, K]`` and ``check_codes`` (the shapes and dtypes it accepts); ``check_float`` may refuse a float module it
cannot convert. ``from_float`` ends in ``from_codes``, so every module of a format is constructed in one place.
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

    @classmethod
    def check_codes(cls, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Raise ValueError when the (codes, scales) of w13 and w2 do not form one module of this format; returns
        nothing. Sets no requirement by default."""

    @classmethod
    def shapes(cls, codes: tuple[torch.Tensor, torch.Tensor], name: str) -> tuple[int, int, int]:
        """(E, N, K) of the weight ``name`` ("w13" or "w2") that ``codes`` (codes, scales) encode."""
        raise NotImplementedError

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_codes(cls, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor], *,
                   b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, activation: str = "silu",
                   alpha: float = 1.702, limit: float = 7.0, dtype: torch.dtype = torch.bfloat16):
        """The module holding ``w13`` / ``w2`` = (codes, scales) in this format (adopted, not copied) and the float
        biases ``b13`` [E, 2I] / ``b2`` [E, H] (``dtype``: the float model's dtype)."""
        cls.check_codes(w13, w2)
        e, two_i, h = cls.shapes(w13, "w13")
        q = cls(e, h, two_i // 2, activation=activation, alpha=alpha, limit=limit, dtype=dtype)
        codes_name, scales_name = cls.BUFFERS
        for name, (codes, scales) in (("w13", w13), ("w2", w2)):
            q.register_buffer(f"{name}_{codes_name}", codes)
            q.register_buffer(f"{name}_{scales_name}", scales)
        q.b13 = _bias(b13, (e, two_i), "b13")
        q.b2 = _bias(b2, (e, h), "b2")
        return q

    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: FusedExperts):
        """Quantise ``experts`` (its float weights are not modified; drop them to free memory)."""
        if type(experts) is not FusedExperts:
            raise TypeError(f"expected float FusedExperts, got {type(experts).__name__} ({cls.FORMAT} quantises the "
                            f"float weights once)")
        cls.check_float(experts)
        parts = {}
        for name in ("w13", "w2"):
            w = getattr(experts, name)
            # one expert at a time: the float32 temporaries of the quantiser stay one expert large
            per_expert = [cls.quantize_expert(w[e]) for e in range(w.shape[0])]
            parts[name] = (torch.stack([p[0] for p in per_expert]), torch.stack([p[1] for p in per_expert]))
        return cls.from_codes(parts["w13"], parts["w2"], b13=experts.b13, b2=experts.b2,
                              activation=experts.activation, alpha=experts.alpha, limit=experts.limit,
                              dtype=experts.w13.dtype)

    @torch.no_grad()
    def to_float(self) -> FusedExperts:
        """A float FusedExperts (``self.dtype``, on this module's device) with the dequantised weights and the same
        bias parameters: the dequantise-at-load path. Decoded one expert at a time into the new weights."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        codes = getattr(self, f"w13_{self.BUFFERS[0]}")
        with torch.device("meta"):
            out = FusedExperts(e, h, i, bias=False, activation=self.activation, alpha=self.alpha, limit=self.limit)
        for name in ("w13", "w2"):
            meta = getattr(out, name)
            w = torch.empty(meta.shape, dtype=self.dtype, device=codes.device)
            c, s = self.stored_codes(name)
            for k in range(e):
                w[k] = self.dequantize_expert(c[k], s[k])
            setattr(out, name, nn.Parameter(w, requires_grad=False))
        out.b13, out.b2 = self.b13, self.b2
        return out

    # ---- inspection and tests: dequantised on access, never stored (no engine path reads them) ---------------
    @property
    def w13(self) -> torch.Tensor:
        return self._dequant("w13")

    @property
    def w2(self) -> torch.Tensor:
        return self._dequant("w2")

    def stored_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of ``name`` ("w13" / "w2") in the format's plain layout, as ``dequantize_expert`` reads
        them (a format whose kernels read another layout converts back here)."""
        codes_name, scales_name = self.BUFFERS
        return getattr(self, f"{name}_{codes_name}"), getattr(self, f"{name}_{scales_name}")

    def _dequant(self, name: str) -> torch.Tensor:
        codes, scales = self.stored_codes(name)
        return torch.stack([self.dequantize_expert(codes[e], scales[e]) for e in range(codes.shape[0])])

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.FORMAT} weight-only"


def _bias(b: torch.Tensor | None, shape: tuple[int, int], name: str) -> nn.Parameter | None:
    if b is None:
        return None
    if tuple(b.shape) != shape or not b.is_floating_point():
        raise ValueError(f"expert bias {name} must be a float tensor of shape {shape}, got {b.dtype} "
                         f"{tuple(b.shape)}")
    return b if isinstance(b, nn.Parameter) else nn.Parameter(b, requires_grad=False)
