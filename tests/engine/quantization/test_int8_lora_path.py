"""INT8 experts under expert LoRA (the wrapper hands int8 weights and scales to ``ops.moe_experts_lora``, no
dequantised copy on access), and ``apply_quantization`` / ``EngineConfig.quantization``."""
from __future__ import annotations

import weakref

import pytest
import torch

from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.lora.layers import LoRAFusedExperts, LoRAState
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization import Int8FusedExperts, apply_quantization

E, H, I, L, R, A = 5, 24, 20, 3, 4, 2


def _experts(activation: str, bias: bool) -> FusedExperts:
    m = FusedExperts(E, H, I, bias=bias, activation=activation, alpha=1.702, limit=7.0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) / 3)
    return m


def _wrap(base: FusedExperts, state: LoRAState, lora) -> LoRAFusedExperts:
    w = LoRAFusedExperts(base, state, *lora)  # stacked pairs: every step slot at rank R
    w.loaded = set(range(L))
    return w


def _lora():
    w13 = (torch.randn(L, E, R, H) / H ** 0.5, torch.randn(L, E, 2 * I, R))
    w2 = (torch.randn(L, E, R, I) / I ** 0.5, torch.randn(L, E, H, R))
    return w13, w2


@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_clamp", True)])
def test_int8_lora_path_is_the_float_path_on_dequantised_weights(activation, bias, monkeypatch):
    torch.manual_seed(0)
    float_base = _experts(activation, bias)
    q = Int8FusedExperts.from_float(float_base)
    dequant = _experts(activation, bias)
    with torch.no_grad():  # the float model with q * scale weights (same rounding as the op's dequantisation)
        dequant.w13.copy_(q.w13)
        dequant.w2.copy_(q.w2)
        if bias:
            dequant.b13.copy_(q.b13)
            dequant.b2.copy_(q.b2)
    state = LoRAState(L, torch.device("cpu"))
    state.scaling = torch.rand(L) + 0.5
    lora = _lora()
    w_q, w_f = _wrap(q, state, lora), _wrap(dequant, state, lora)
    x = torch.randn(9, H)
    weights, ids = torch.topk(torch.rand(9, E).softmax(-1), A, dim=-1)
    state.token_lora_idx = torch.tensor([0, -1, 2, 1, 1, -1, 0, 2, 2], dtype=torch.int32)
    state.active_slots, state.num_slots = frozenset({0, 1, 2}), L

    def no_dequant(self):
        raise AssertionError("the LoRA path must not dequantise the experts on access")

    monkeypatch.setattr(Int8FusedExperts, "w13", property(no_dequant))
    monkeypatch.setattr(Int8FusedExperts, "w2", property(no_dequant))
    got, want = w_q(x, weights, ids), w_f(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    state.token_lora_idx = None  # base path: fused_moe_int8 vs fused_moe on the dequantised weights
    base = w_q(x, weights, ids)
    torch.testing.assert_close(base, w_f(x, weights, ids), rtol=1e-5, atol=1e-5)
    assert (got - base).abs().max() > 0.1  # the adapters change the result


def test_apply_quantization_converts_and_frees_the_float_weights():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.ModuleDict({"experts": _experts("silu", True)}),
                                 "b": torch.nn.ModuleDict({"experts": _experts("silu", True)})})
    refs = [weakref.ref(m["experts"].w13) for m in model.values()]
    assert apply_quantization(model, None) == 0 and all(r() is not None for r in refs)
    assert apply_quantization(model, "int8") == 2
    assert all(isinstance(m["experts"], Int8FusedExperts) for m in model.values())
    assert all(r() is None for r in refs), "float expert weights are still referenced"
    with pytest.raises(ValueError, match="quantization 'fp8' is not supported"):
        apply_quantization(model, "fp8")


def test_engine_config_quantization_is_validated():
    assert EngineConfig(model="m").quantization == "auto"  # the experts as the checkpoint stores them
    assert EngineConfig(model="m", quantization=None).quantization is None
    assert EngineConfig(model="m", quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="quantization 'int4' is not supported; choose 'auto', None .*'int8'"):
        EngineConfig(model="m", quantization="int4")
