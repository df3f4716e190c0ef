"""Sparse mixture of experts: router -> top-k routing -> stacked experts through one ``fused_moe`` call.

Shape legend: T tokens, H hidden, E experts, A activated experts per token, I intermediate per expert.

    x [T, H] --router--> logits [T, E] --moe_route--> weights [T, A], ids [T, A]
      --experts(x, weights, ids)--> [T, H]          (the one place a LoRA transform hooks expert compute)
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.models.layers.linear import Linear
from loraplex.kernels import ops


class FusedExperts(nn.Module):
    """E experts stacked: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], optional b13 [E, 2I], b2 [E, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.alpha, self.limit = activation, alpha, limit
        E, H, I = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        self.b13 = nn.Parameter(torch.empty(E, 2 * I), requires_grad=False) if bias else None
        self.b2 = nn.Parameter(torch.empty(E, H), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, activation=self.activation,
                             b13=self.b13, b2=self.b2, alpha=self.alpha, limit=self.limit)

    def extra_repr(self) -> str:
        return f"E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, act={self.activation}"


class SparseMoE(nn.Module):
    """Router (attribute ``router_name``: ``gate`` or ``router``, as in the HF checkpoint) + ``experts``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 router_name: str = "gate", router_bias: bool = False, scoring: str = "softmax",
                 renormalize: bool = True, expert_bias: bool = False, activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize
        self.router_name = router_name
        self.add_module(router_name, Linear(hidden_size, num_experts, bias=router_bias))
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, bias=expert_bias,
                                    activation=activation, alpha=alpha, limit=limit)

    @property
    def router_layer(self) -> nn.Module:
        """The router, whatever its checkpoint name (``router_name``)."""
        return self._modules[self.router_name]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        """``router_logits`` [T, E]: the router's output already computed (with the norm before it,
        ``ops.rms_norm_router``); else the router runs here."""
        if router_logits is None:
            router_logits = self.router_layer(x)  # [T, E]
        topk_weights, topk_ids = ops.moe_route(router_logits, self.top_k, scoring=self.scoring,
                                               renormalize=self.renormalize)
        return self.experts(x, topk_weights, topk_ids)
