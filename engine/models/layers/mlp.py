"""Dense gated MLP: fused gate_up ([gate; up] rows) -> silu(gate) * up -> down. Shape: T tokens, H hidden, I inner."""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.models.layers.linear import Linear
from loraplex.kernels import ops


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias,
                                   output_sizes=[intermediate_size, intermediate_size],
                                   output_names=["gate_proj", "up_proj"])
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
