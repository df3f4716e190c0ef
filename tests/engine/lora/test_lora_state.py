"""LoRAState's per-step switches that the CUDA-graph runner sets: ``segments`` (the step's token grouping,
handed to every dense LoRA call) and ``always_on`` (LoRA kernels run whatever the slots hold); and the step's LoRA
table, rewritten only when the step's adapters change."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.loader import load_model
from loraplex.engine.lora.slots import LoRASlots
from loraplex.engine.testing.adapters import random_adapter
from loraplex.kernels import ops


@pytest.fixture
def attached(tiny_checkpoint):
    model, cfg = load_model(tiny_checkpoint("qwen3_moe"), progress=False)
    slots = LoRASlots(model, cfg, max_rank=8, max_step_slots=4, device="cpu", dtype=torch.float32)
    return model, cfg, slots


def test_segments_reach_shrink_and_expand(attached, monkeypatch):
    model, cfg, slots = attached
    slots.load(3, random_adapter(slots, "a", rank=4, seed=1))
    layer = model.model.layers[0].self_attn.qkv_proj
    seen = []
    shrink, expand = ops.lora_shrink, ops.lora_expand
    monkeypatch.setattr(ops, "lora_shrink", lambda *a, segments=None: seen.append(segments) or shrink(*a))
    monkeypatch.setattr(ops, "lora_expand", lambda *a, segments=None: seen.append(segments) or expand(*a))
    x = torch.randn(3, cfg.hidden_size)
    slots.set_token_slots(torch.tensor([3, -1, 3], dtype=torch.int32))
    state = slots.state
    state.segments = marker = ("segments of this step",)
    y = layer(x)
    assert seen == [marker, marker]
    assert not torch.equal(y[0], layer.base(x)[0]) and torch.equal(y[1], layer.base(x)[1])


def test_always_on_runs_lora_with_empty_slots_and_changes_nothing(attached, monkeypatch):
    model, cfg, slots = attached
    linear = model.model.layers[0].self_attn.qkv_proj
    experts = model.model.layers[0].mlp.experts
    calls = []
    moe_lora = ops.moe_experts_lora
    monkeypatch.setattr(ops, "moe_experts_lora", lambda *a, **k: calls.append(1) or moe_lora(*a, **k))
    x = torch.randn(3, cfg.hidden_size)
    weights, ids = torch.topk(torch.rand(3, cfg.num_experts).softmax(-1), cfg.num_experts_per_tok, dim=-1)
    state = slots.state
    state.token_lora_idx, state.num_slots = torch.tensor([0, -1, 1], dtype=torch.int32), 2
    state.active_slots = frozenset({0, 1})
    assert not linear.lora_active() and not experts.lora_active()  # nothing loaded: skipped
    state.always_on = True
    assert linear.lora_active() and experts.lora_active()
    torch.testing.assert_close(linear(x), linear.base(x))  # step slots without weights: no delta
    torch.testing.assert_close(experts(x, weights, ids), experts.base(x, weights, ids), rtol=1e-6, atol=1e-6)
    assert calls == [1]
    state.token_lora_idx = None  # no adapter map: no LoRA work even when always on
    assert not linear.lora_active() and not experts.lora_active()


def test_step_table_is_written_only_when_the_step_adapters_change(attached):
    """Steady decoding (the same adapters step after step) copies no table rows; a new adapter set, or a slot
    reloaded with another adapter, does. The rows hold each adapter's addresses and ranks."""
    model, cfg, slots = attached
    a, b = random_adapter(slots, "a", rank=4, seed=1), random_adapter(slots, "b", rank=8, seed=2)
    slots.load(0, a)
    slots.load(5, b)
    table = slots.step_table
    slots.set_token_slots(torch.tensor([5, 0, 5]))
    writes = table.num_writes
    slots.set_token_slots(torch.tensor([0, 5]))     # same adapters, other tokens: no copy
    assert table.num_writes == writes and table.slots == [0, 5]
    ranks = table.entries[:2, :, 2]
    assert set(ranks[0].tolist()) == {4} and set(ranks[1].tolist()) == {8}  # every entry targeted, own rank
    res = slots._resident[5]
    a_q, b_q = res.factors[0]                                                 # entry 0: layer 0's q_proj
    assert table.entries[1, 0, :2].tolist() == [a_q.data_ptr(), b_q.data_ptr()]
    assert a_q.data_ptr() - res.blob.data_ptr() in range(res.blob.nbytes)    # views into the adapter's one blob
    slots.set_token_slots(torch.tensor([0, -1]))
    assert table.num_writes == writes + 1 and table.slots == [0]
    slots.load(0, b)                                                          # same slot, other adapter
    slots.set_token_slots(torch.tensor([0, -1]))
    assert table.num_writes == writes + 2 and set(table.entries[0, :, 2].tolist()) == {8}
