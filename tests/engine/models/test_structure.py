"""Module names and fused-layer metadata that transforms (LoRA, TP) rely on; registry errors."""
from __future__ import annotations

import pytest

from loraplex.engine.config import ConfigError, ModelConfig
from loraplex.engine.models import MODEL_REGISTRY, get_model_class
from loraplex.engine.models.layers.linear import Linear
from loraplex.engine.testing.tiny import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_stable_module_names(family, tiny_checkpoints):
    cfg = ModelConfig.from_pretrained(tiny_checkpoints[family])
    import torch

    with torch.device("meta"):
        model = get_model_class(family)(cfg)
    mods = dict(model.named_modules())
    qkv = mods["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, Linear) and isinstance(mods["model.layers.0.self_attn.o_proj"], Linear)
    assert qkv.output_sizes == [cfg.q_size, cfg.kv_size, cfg.kv_size]
    assert qkv.output_names == ["q_proj", "k_proj", "v_proj"]
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp"
        if cfg.is_moe and cfg.is_moe_layer(layer):
            experts = mods[f"{p}.experts"]
            E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
            assert experts.w13.shape == (E, 2 * I, H) and experts.w2.shape == (E, H, I)
            assert (experts.b13 is not None) == (family == "gpt_oss")
            router = "router" if family == "gpt_oss" else "gate"
            assert isinstance(mods[f"{p}.{router}"], Linear)
        else:
            gate_up = mods[f"{p}.gate_up_proj"]
            assert gate_up.output_names == ["gate_proj", "up_proj"]
            assert gate_up.output_sizes == [cfg.intermediate_size] * 2
            assert isinstance(mods[f"{p}.down_proj"], Linear)
    if family == "qwen3_moe":
        assert "model.layers.1.mlp.gate_up_proj" in mods  # mlp_only_layers=[1]


def test_registry():
    assert set(MODEL_REGISTRY) == set(FAMILIES)
    with pytest.raises(ConfigError, match="'gpt2' is not supported"):
        get_model_class("gpt2")
