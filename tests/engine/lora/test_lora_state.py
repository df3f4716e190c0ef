"""LoRAState's per-step switches that the CUDA-graph runner sets: ``segments`` (the step's token grouping,
handed to every dense LoRA call) and ``always_on`` (LoRA kernels run whatever the slots hold)."""
from __future__ import annotations

import torch

from loraplex.engine.lora.layers import LoRAFusedExperts, LoRALinear, LoRAState
from loraplex.engine.models.layers.linear import Linear
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.kernels import ops

L, R = 2, 4


def _linear(state: LoRAState) -> LoRALinear:
    base = Linear(8, 12, output_sizes=[6, 6], output_names=["gate_proj", "up_proj"])
    with torch.no_grad():
        base.weight.copy_(torch.randn(12, 8))
    return LoRALinear(base, state, ["mlp.gate_proj", "mlp.up_proj"], torch.zeros(2, L, R, 8), torch.zeros(L, 12, R))


def test_segments_reach_shrink_and_expand(monkeypatch):
    state = LoRAState(L, torch.device("cpu"))
    layer = _linear(state)
    layer.loaded[1] = True
    with torch.no_grad():
        layer.lora_a.normal_()
        layer.lora_b.normal_()
    seen = []
    shrink, expand = ops.lora_shrink, ops.lora_expand
    monkeypatch.setattr(ops, "lora_shrink", lambda *a, segments=None: seen.append(segments) or shrink(*a))
    monkeypatch.setattr(ops, "lora_expand", lambda *a, segments=None: seen.append(segments) or expand(*a))
    x = torch.randn(3, 8)
    state.token_lora_idx, state.active_slots = torch.tensor([1, -1, 1], dtype=torch.int32), frozenset({1})
    state.segments = marker = ("segments of this step",)
    y = layer(x)
    assert seen == [marker, marker]
    assert not torch.equal(y[0], layer.base(x)[0]) and torch.equal(y[1], layer.base(x)[1])


def test_always_on_runs_lora_with_empty_slots_and_changes_nothing(monkeypatch):
    state = LoRAState(L, torch.device("cpu"))
    linear = _linear(state)
    experts = FusedExperts(4, 8, 6)
    with torch.no_grad():
        experts.w13.normal_()
        experts.w2.normal_()
    wrapped = LoRAFusedExperts(experts, state, L, (torch.zeros(L, 4, R, 8), torch.zeros(L, 4, 12, R)),
                               (torch.zeros(L, 4, R, 6), torch.zeros(L, 4, 8, R)))
    calls = []
    moe_lora = ops.moe_experts_lora
    monkeypatch.setattr(ops, "moe_experts_lora", lambda *a, **k: calls.append(1) or moe_lora(*a, **k))
    x = torch.randn(3, 8)
    weights, ids = torch.topk(torch.rand(3, 4).softmax(-1), 2, dim=-1)
    state.token_lora_idx, state.active_slots = torch.tensor([0, -1, 1], dtype=torch.int32), frozenset({0, 1})
    assert not linear.lora_active() and not wrapped.lora_active()  # nothing loaded: skipped
    state.always_on = True
    assert linear.lora_active() and wrapped.lora_active()
    torch.testing.assert_close(linear(x), linear.base(x))  # empty slots hold zeros: no delta
    torch.testing.assert_close(wrapped(x, weights, ids), experts(x, weights, ids), rtol=1e-6, atol=1e-6)
    assert calls == [1]
    state.token_lora_idx = None  # no adapter map: no LoRA work even when always on
    assert not linear.lora_active() and not wrapped.lora_active()
