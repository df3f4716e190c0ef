"""LoRA-aware stand-ins for the model's Linear and FusedExperts modules (installed by ``LoRASlots``).

Shape legend: T tokens of the step, L step slots (the step's distinct adapters), r an adapter's rank, S output
slices, K in, N out, E experts, A activated experts per token, H hidden, I intermediate per expert.

    LoRALinear:        y = base(x);  y[:, slice s] += B[l, s] @ (A[l, s] @ x)        l = token_lora_idx[t]
    LoRAFusedExperts:  per routed pair (t, a) of expert e, with l = token_lora_idx[t]:
                       g = w13[e] x + b13[e] + B13[l][e] A13[l][e] x           (delta before the activation)
                       d = w2[e] act(g) + b2[e] + B2[l][e] A2[l][e] act(g)
                       out[t] = sum_a topk_weights[t, a] * d                   (delta weighted by routing)

On CUDA, LoRALinear runs its shrink on a side stream (``LoRAState.shrink_stream``) while the base projection runs
on the step's stream; the expand joins both (in a captured graph: two branches and a join), so the shrink's
launch and ramp hide behind the base GEMM (``kernels/side_stream.py``):

    step stream:  ──fork──> base GEMM x W ──────────────join──> expand (y += B @ buf)
    side stream:     └────> shrink buf = A @ x ───────────┘

``LORAPLEX_LORA_SHRINK_STREAM=0`` keeps everything on one stream (A/B timing).

The factors of the step's adapters are read through the step's LoRA table (``step_table.py``), each at its own
rank. Each wrapper takes the base module's parameters under the same names, so ``named_parameters`` / state dicts
of the model do not change, and keeps the base module (outside the module tree) for the path without LoRA.
A wrapper does no LoRA work when the step has no adapter (``state.token_lora_idx is None``) or when none of
the step's adapters has weights for its targets (unless ``state.always_on``: CUDA-graph capture); the expert
wrapper then calls the fused base kernel. With LoRA, the expert wrapper runs ``ops.moe_experts_lora`` (on CUDA a
graph-capturable composition of Triton kernels, no host sync), on the int8 weights directly when its base is
``Int8FusedExperts`` and on the MXFP4 blocks and scales when it is ``Mxfp4FusedExperts``.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from loraplex.engine.lora.step_table import TargetTable
from loraplex.kernels import ops
from loraplex.kernels.side_stream import fork, join


class LoRAState:
    """Per-step data every wrapper of one model reads: set once per step by ``LoRASlots.set_token_slots`` (or
    ``bind_static_token_slots`` for a CUDA graph)."""

    def __init__(self, max_step_slots: int, device: torch.device) -> None:
        self.token_lora_idx: torch.Tensor | None = None         # [T] int32 step slots on the device, -1 = none
        self.num_slots: int = 0                                 # L of the step
        self.active_slots: frozenset[int] = frozenset()         # resident slots of the step's adapters
        # [max_step_slots] (alpha / r is folded into B at load)
        self.scaling = torch.ones(max(1, max_step_slots), dtype=torch.float32, device=device)
        # ops.lora_segments(token_lora_idx, L) of the step (None: each dense LoRA call groups tokens itself)
        self.segments = None
        # True: every wrapper runs its LoRA kernels whenever token_lora_idx is set, whatever the slots hold (a
        # captured CUDA graph must contain them; base tokens (-1) cost nothing there, an adapter without weights
        # for a module has rank 0 in its table)
        self.always_on: bool = False
        # the side stream LoRALinear's shrinks run on beside the base projection (None: one stream; CPU)
        self.shrink_stream = _side_stream(torch.device(device))


def _side_stream(device: torch.device):
    if device.type != "cuda" or os.environ.get(SHRINK_STREAM_ENV, "1") == "0":
        return None
    return torch.cuda.Stream(device)


SHRINK_STREAM_ENV = "LORAPLEX_LORA_SHRINK_STREAM"


class _LoRAWrapper(nn.Module):
    def __init__(self, base: nn.Module, state: LoRAState) -> None:
        super().__init__()
        self._base = (base,)  # a tuple keeps it out of the module tree (and out of named_parameters)
        for name, p in base.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.state = state
        self.loaded: set[int] = set()  # host-side: resident slots holding weights for at least one of my targets

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    def lora_active(self) -> bool:
        s = self.state
        return s.token_lora_idx is not None and (s.always_on or not self.loaded.isdisjoint(s.active_slots))


class LoRALinear(_LoRAWrapper):
    """A Linear with multi-LoRA: one (A, B) per output slice (q/k/v or gate/up share the input); ``targets[s]``
    is the PEFT target of slice s, ``table`` the module's columns of the step's LoRA table."""

    def __init__(self, base: nn.Module, state: LoRAState, targets: list[str], table: TargetTable) -> None:
        super().__init__(base, state)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.output_sizes = list(base.output_sizes)
        self.output_names = list(getattr(base, "output_names", []))
        self.targets = list(targets)
        self.table = table
        self._slices = tuple(self.output_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if not self.lora_active():
            return self.base(x)
        s = self.state
        idx, table = s.token_lora_idx, self.table.at(s.num_slots)
        side = s.shrink_stream
        if side is None:
            y = self.base(x)
            buf = ops.lora_shrink(x, table, idx, s.scaling, segments=s.segments)  # [S, T, R] fp32
        else:  # the shrink beside the base GEMM
            buf = fork(side, lambda: ops.lora_shrink(x, table, idx, s.scaling, segments=s.segments))
            y = self.base(x)
            join(side)
        ops.lora_expand(y, buf, table, idx, self._slices, segments=s.segments)
        return y

    def extra_repr(self) -> str:
        return f"targets={self.targets}, max_rank={self.table.max_rank}"


class LoRAFusedExperts(_LoRAWrapper):
    """FusedExperts with expert LoRA applied to each token's routed experts only.

    ``w13`` / ``w2``: the gate_up / down target's columns of the step's LoRA table (A [E, r, H] / B [E, 2I, r],
    A [E, r, I] / B [E, H, r] per adapter), or a stacked pair (lora_a [L, E, R, K], lora_b [L, E, N, R]: every
    step slot at rank R, as the ops accept it; tests); either may be None (no LoRA on that target)."""

    def __init__(self, base: nn.Module, state: LoRAState, w13, w2) -> None:
        super().__init__(base, state)
        self.num_experts, self.hidden_size = base.num_experts, base.hidden_size
        self.intermediate_size = base.intermediate_size
        self.activation, self.alpha, self.limit = base.activation, base.alpha, base.limit
        self.w13_lora, self.w2_lora = w13, w2
        self.targets = [t for t, w in (("mlp.experts.gate_up_proj", w13), ("mlp.experts.down_proj", w2)) if w]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        if not self.lora_active():
            return self.base(x, topk_weights, topk_ids)
        base = self.base
        w13_scale = getattr(base, "w13_scale", None)  # Int8FusedExperts: int8 weights + per-channel scales
        if w13_scale is not None:
            w13, w2, w2_scale = base.w13_q, base.w2_q, base.w2_scale
        elif hasattr(base, "w13_blocks"):  # Mxfp4FusedExperts: uint8 blocks + E8M0 scales
            w13, w13_scale, w2, w2_scale = base.w13_blocks, base.w13_scales, base.w2_blocks, base.w2_scales
        else:
            w13, w2, w2_scale = base.w13, base.w2, None
        s = self.state
        return ops.moe_experts_lora(x, w13, w2, topk_weights, topk_ids, s.token_lora_idx, s.scaling,
                                    w13_lora=_at(self.w13_lora, s.num_slots), w2_lora=_at(self.w2_lora, s.num_slots),
                                    activation=self.activation,
                                    b13=base.b13, b2=base.b2, alpha=self.alpha, limit=self.limit,
                                    w13_scale=w13_scale, w2_scale=w2_scale)

    def extra_repr(self) -> str:
        return f"targets={self.targets}, E={self.num_experts}"


def _at(lora, num_slots: int):
    """The LoRA operand for a step of ``num_slots`` step slots: a TargetTable's table, else as it is."""
    return lora.at(num_slots) if isinstance(lora, TargetTable) else lora
