"""LoRASlots and the LoRA wrappers at module level: no-adapter tokens and steps, clearing, adapters stored at their
own rank, layer skipping, refusals. The end-to-end check against PEFT is test_peft_equivalence.py."""
from __future__ import annotations

import os

import pytest
import torch

from loraplex.engine.loader import load_model
from loraplex.engine.lora import layers as lora_layers
from loraplex.engine.lora.format import AdapterFormatError
from loraplex.engine.lora.layers import LoRAFusedExperts, LoRALinear
from loraplex.engine.lora.slots import LoRASlots
from loraplex.engine.lora.weights import load_adapter_weights
from loraplex.kernels import ops

FAMILY = "qwen3_moe"  # MoE layers 0 and 2, a dense MLP in layer 1


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, peft_adapter):
    path = tiny_checkpoint(FAMILY)
    full = peft_adapter(path, r=4, alpha=8, seed=10)
    attn = peft_adapter(path, r=8, alpha=8, attention_only=True, seed=11)
    return path, full, attn


def build(path, **kw):
    model, cfg = load_model(path, progress=False)
    names = sorted(n for n, _ in model.named_parameters())
    slots = LoRASlots(model, cfg, max_rank=16, max_step_slots=4, device="cpu", dtype=torch.float32, **kw)
    return model, cfg, slots, names


def weights(folder, cfg, max_rank=16):
    return load_adapter_weights(folder, cfg, max_rank=max_rank, dtype=torch.float32)


def routed(cfg, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    logits = torch.randn(T, cfg.num_experts, generator=g)
    w, ids = ops.moe_route(logits, cfg.num_experts_per_tok, scoring="softmax", renormalize=False)
    return x, w, ids


def test_attach_keeps_parameter_names_and_detach_restores(setup):
    model, _, slots, names = build(setup[0])
    assert sorted(n for n, _ in model.named_parameters()) == names
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, LoRALinear) and isinstance(model.model.layers[0].mlp.experts, LoRAFusedExperts)
    assert attn.qkv_proj.targets == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, LoRALinear)  # the dense layer
    assert not isinstance(model.model.layers[0].mlp.gate, LoRALinear)      # the router is no LoRA target
    slots.detach()
    assert not isinstance(attn.qkv_proj, LoRALinear)
    assert sorted(n for n, _ in model.named_parameters()) == names


def test_linear_rows_without_adapter_are_untouched_and_clear_removes_the_delta(setup):
    path, full, _ = setup
    model, cfg, slots, _ = build(path)
    slots.load(1, weights(full, cfg))
    qkv = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(6, cfg.hidden_size)
    base = qkv.base(x)
    idx = torch.tensor([-1, 1, 1, -1, 1, -1], dtype=torch.int32)
    slots.set_token_slots(idx)
    y = qkv(x)
    assert torch.equal(y[idx != 1], base[idx != 1])
    assert (y[idx == 1] - base[idx == 1]).abs().max() > 1e-2
    assert slots.nbytes == slots.footprint(weights(full, cfg)) > 0
    slots.clear(1)
    assert slots.adapter_in(1) is None and slots.nbytes == 0
    with pytest.raises(ValueError, match="slot 1 holds no adapter"):
        slots.set_token_slots(idx)  # a step never routes tokens to an empty slot
    slots.set_token_slots(None)
    assert torch.equal(qkv(x), base)


def test_lora_linear_matches_the_low_rank_formula_at_its_own_rank(setup):
    path, full, _ = setup
    model, cfg, slots, _ = build(path)
    w = weights(full, cfg)
    slots.load(2, w)
    o_proj = model.model.layers[2].self_attn.o_proj
    t = w.modules[(2, "self_attn.o_proj")]
    x = torch.randn(3, cfg.q_size)
    slots.set_token_slots(torch.full((3,), 2, dtype=torch.int32))
    a, b = o_proj.table.at(1).lookup(0, 0)  # step slot 0 is resident slot 2: its factors, at rank 4, not 16
    assert t.rank == 4 and a.shape == (4, cfg.q_size) and b.shape == (cfg.hidden_size, 4)
    assert torch.equal(a, t.lora_a) and torch.equal(b, t.lora_b)
    expected = o_proj.base(x) + x @ t.lora_a.T @ t.lora_b.T
    torch.testing.assert_close(o_proj(x), expected, rtol=1e-5, atol=1e-5)


def test_experts_apply_lora_to_routed_experts_only(setup):
    path, full, _ = setup
    model, cfg, slots, _ = build(path)
    w = weights(full, cfg)
    slots.load(0, w)
    experts = model.model.layers[0].mlp.experts
    x, tw, ids = routed(cfg, 5)
    idx = torch.tensor([0, -1, 0, -1, 0], dtype=torch.int32)
    slots.set_token_slots(idx)
    y = experts(x, tw, ids)
    base = experts.base(x, tw, ids)
    torch.testing.assert_close(y[idx < 0], base[idx < 0], rtol=1e-6, atol=1e-6)
    # per token: sum over its routed experts of weight * down_e(act(gate_up_e(x) + dW13_e x)) + dW2_e ...
    gu, dn = w.modules[(0, "mlp.experts.gate_up_proj")], w.modules[(0, "mlp.experts.down_proj")]
    b = experts.base
    for t in torch.where(idx == 0)[0].tolist():
        ref = torch.zeros(cfg.hidden_size)
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            h = b.w13[e] @ x[t] + gu.lora_b[e] @ (gu.lora_a[e] @ x[t])
            h = ops.silu_and_mul(h[None])[0]
            ref += tw[t, a] * (b.w2[e] @ h + dn.lora_b[e] @ (dn.lora_a[e] @ h))
        torch.testing.assert_close(y[t], ref, rtol=1e-5, atol=1e-5)


def test_layers_without_an_active_adapter_do_no_lora_work(setup, monkeypatch):
    path, full, attn = setup
    model, cfg, slots, _ = build(path)
    slots.load(0, weights(attn, cfg))   # attention only
    slots.load(1, weights(full, cfg))
    calls = {"moe_lora": 0, "shrink": 0}
    real_moe, real_shrink = ops.moe_experts_lora, ops.lora_shrink

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(lora_layers.ops, "moe_experts_lora", count("moe_lora", real_moe))
    monkeypatch.setattr(lora_layers.ops, "lora_shrink", count("shrink", real_shrink))
    experts = model.model.layers[0].mlp.experts
    dense_mlp = model.model.layers[1].mlp.gate_up_proj
    x, tw, ids = routed(cfg, 4)
    slots.set_token_slots(torch.tensor([0, 0, -1, 0], dtype=torch.int32))
    assert torch.equal(experts(x, tw, ids), experts.base(x, tw, ids))  # fused base path, no expert LoRA
    dense_mlp(torch.randn(4, cfg.hidden_size))
    assert calls == {"moe_lora": 0, "shrink": 0}
    model.model.layers[0].self_attn.qkv_proj(x)
    assert calls["shrink"] == 1
    slots.set_token_slots(torch.tensor([1, 0, -1, 0], dtype=torch.int32))
    experts(x, tw, ids)
    assert calls["moe_lora"] == 1  # one expert layer call (gate_up and down LoRA inside)
    slots.set_token_slots(torch.full((4,), -1, dtype=torch.int32))  # all base: same as None
    assert slots.state.token_lora_idx is None
    slots.set_token_slots(None)
    model.model.layers[0].self_attn.qkv_proj(x)
    assert calls["shrink"] == 1


def test_refusals(setup, tmp_path):
    path, full, _ = setup
    _, cfg, slots, _ = build(path, targets=("self_attn.q_proj", "self_attn.v_proj"))
    with pytest.raises(ValueError, match=r"adapts mlp.experts.down_proj of layer 0, which these slots do not serve"):
        slots.load(0, weights(full, cfg))
    with pytest.raises(ValueError, match=r"slot must be an integer >= 0, got -1"):
        slots.clear(-1)
    with pytest.raises(ValueError, match=r"slot 5 holds no adapter"):
        slots.set_token_slots(torch.tensor([-1, 5]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        slots.set_token_slots(torch.zeros(2, 2))
    with pytest.raises(AdapterFormatError, match="retrain with r <= 2"):
        weights(full, cfg, max_rank=2)
    with pytest.raises(AdapterFormatError, match="has no adapter_config.json; a PEFT LoRA folder holds"):
        weights(str(tmp_path), cfg)


def test_nan_weights_are_refused(setup, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    path, full, _ = setup
    bad = tmp_path / "bad"
    shutil.copytree(full, bad)
    st = os.path.join(bad, "adapter_model.safetensors")
    tensors = load_file(st)
    name = sorted(tensors)[3]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, st)
    _, cfg, _, _ = build(path)
    with pytest.raises(AdapterFormatError, match="holds NaN or Inf values") as e:
        weights(str(bad), cfg)
    assert e.value.code == "non_finite" and name in str(e.value)


def test_runner_refuses_adapter_slots_without_lora(tiny_checkpoint):
    from loraplex.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(tiny_checkpoint(FAMILY), device="cpu", dtype="float32", progress=False)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    seq_id = out.scheduled[0].seq.seq_id
    with pytest.raises(ValueError, match="LoRA is not attached; call init_lora"):
        engine.runner.execute(out, {seq_id: (SamplingParams(max_tokens=1), None)}, lora_slots={seq_id: 0})
