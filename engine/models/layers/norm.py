"""RMSNorm over the last dim; with ``residual`` it adds first and also returns the sum (fused residual add)."""
from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [N, dim] -> [N, dim]; with residual [N, dim] -> (normed, x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
