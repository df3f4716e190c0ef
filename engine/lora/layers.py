"""LoRA-aware stand-ins for the model's Linear and FusedExperts modules (installed by ``LoRASlots``).

Shape legend: T tokens of the step, L slots (max_loras), R max rank, S output slices, K in, N out,
E experts, A activated experts per token, H hidden, I intermediate per expert.

    LoRALinear:        y = base(x);  y[:, slice s] += B[l, slice s] @ (A[s, l] @ x)      l = token_lora_idx[t]
    LoRAFusedExperts:  per routed pair (t, a) of expert e, with l = token_lora_idx[t]:
                       g = w13[e] x + b13[e] + B13[l, e] A13[l, e] x           (delta before the activation)
                       d = w2[e] act(g) + b2[e] + B2[l, e] A2[l, e] act(g)
                       out[t] = sum_a topk_weights[t, a] * d                   (delta weighted by routing)

Each wrapper takes the base module's parameters under the same names, so ``named_parameters`` / state dicts
of the model do not change, and keeps the base module (outside the module tree) for the path without LoRA.
A wrapper does no LoRA work when the step has no adapter (``state.token_lora_idx is None``) or when none of
the step's slots holds weights for its targets; the expert wrapper then calls the fused base kernel.
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels import ops


class LoRAState:
    """Per-step data every wrapper of one model reads: set once per step by ``LoRASlots.set_token_slots``."""

    def __init__(self, max_loras: int, device: torch.device) -> None:
        self.token_lora_idx: torch.Tensor | None = None         # [T] int32 on the model's device, -1 = none
        self.active_slots: frozenset[int] = frozenset()         # slots used by the step's tokens
        self.scaling = torch.ones(max_loras, dtype=torch.float32, device=device)  # [L] (folded into B at load)


class _LoRAWrapper(nn.Module):
    def __init__(self, base: nn.Module, state: LoRAState, max_loras: int) -> None:
        super().__init__()
        self._base = (base,)  # a tuple keeps it out of the module tree (and out of named_parameters)
        for name, p in base.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.state = state
        self.loaded = [False] * max_loras  # host-side: slot l holds weights for at least one of my targets

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    def lora_active(self) -> bool:
        s = self.state
        return s.token_lora_idx is not None and any(self.loaded[l] for l in s.active_slots)


class LoRALinear(_LoRAWrapper):
    """A Linear with multi-LoRA: one A per output slice (q/k/v or gate/up share the input), B stacked along N.

    lora_a [S, L, R, K]; lora_b [L, N, R]; ``targets[s]`` is the PEFT target of slice s."""

    def __init__(self, base: nn.Module, state: LoRAState, targets: list[str], lora_a: torch.Tensor,
                 lora_b: torch.Tensor) -> None:
        super().__init__(base, state, lora_a.shape[1])
        self.in_features, self.out_features = base.in_features, base.out_features
        self.output_sizes = list(base.output_sizes)
        self.output_names = list(getattr(base, "output_names", []))
        self.targets = list(targets)
        self.lora_a, self.lora_b = lora_a, lora_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        y = self.base(x)
        if not self.lora_active():
            return y
        idx = self.state.token_lora_idx
        buf = ops.lora_shrink(x, self.lora_a, idx, self.state.scaling)  # [S, T, R] fp32
        ops.lora_expand(y, buf, self.lora_b, idx, tuple(self.output_sizes))
        return y

    def extra_repr(self) -> str:
        return f"targets={self.targets}, slots={self.lora_a.shape[1]}, rank={self.lora_a.shape[2]}"


class LoRAFusedExperts(_LoRAWrapper):
    """FusedExperts with expert LoRA applied to each token's routed experts only.

    w13 target: lora_a [L, E, R, H], lora_b [L, E, 2I, R]; w2 target: lora_a [L, E, R, I], lora_b [L, E, H, R].
    Either may be None (the model's slots were built without it)."""

    def __init__(self, base: nn.Module, state: LoRAState, max_loras: int,
                 w13: tuple[torch.Tensor, torch.Tensor] | None, w2: tuple[torch.Tensor, torch.Tensor] | None
                 ) -> None:
        super().__init__(base, state, max_loras)
        self.num_experts, self.hidden_size = base.num_experts, base.hidden_size
        self.intermediate_size = base.intermediate_size
        self.activation, self.alpha, self.limit = base.activation, base.alpha, base.limit
        self.w13_lora, self.w2_lora = w13, w2
        self.targets = [t for t, w in (("mlp.experts.gate_up_proj", w13), ("mlp.experts.down_proj", w2)) if w]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        if not self.lora_active():
            return self.base(x, topk_weights, topk_ids)
        base, idx, scaling = self.base, self.state.token_lora_idx, self.state.scaling
        num_tokens, top_k = topk_ids.shape
        order, counts = _group_pairs_by_expert(topk_ids, self.num_experts)
        rows = order // top_k  # token of each sorted pair
        inter = _grouped_linear(x, rows, order, counts, base.w13, base.b13)  # [T*A, 2I] in pair order
        if self.w13_lora is not None:
            ops.fused_moe_lora(inter, x, self.w13_lora[0], self.w13_lora[1], topk_ids, idx, scaling)
        act = _act_and_mul(inter, self.activation, self.alpha, self.limit)  # [T*A, I]
        out = _grouped_linear(act, order, order, counts, base.w2, base.b2)  # [T*A, H]
        if self.w2_lora is not None:
            ops.fused_moe_lora(out, act, self.w2_lora[0], self.w2_lora[1], topk_ids, idx, scaling)
        out = out.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1).to(out.dtype)
        return out.sum(dim=1)

    def extra_repr(self) -> str:
        return f"targets={self.targets}, E={self.num_experts}"


def _act_and_mul(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        return ops.silu_and_mul(h)
    return ops.swiglu_clamp_and_mul(h, alpha, limit)


def _group_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Pairs p = t*A + a sorted by expert (stable) and the pair count of each expert (one host sync)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def _grouped_linear(x: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor, counts: list[int],
                    w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """out[pairs[j]] = w[e] @ x[rows[j]] + b[e] for the j-th sorted pair of expert e.

    x [M, K]; rows, pairs [P] (sorted by expert); w [E, N, K]; b [E, N] -> out [P, N] indexed by pair."""
    out = torch.empty(pairs.numel(), w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = slice(start, start + n)
        out[pairs[sel]] = torch.nn.functional.linear(x[rows[sel]], w[e], None if b is None else b[e])
        start += n
    return out
