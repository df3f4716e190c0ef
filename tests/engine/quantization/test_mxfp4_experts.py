"""MXFP4 weight-only experts through ``EngineConfig.quantization="mxfp4"``: the engine is the float engine whose
expert weights were replaced by their dequantised MXFP4 values (the quantisation is the only difference), on the
base path and with a PEFT adapter on the experts; K not a multiple of 32 is refused clearly."""
from __future__ import annotations

import json
import os

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.lora.fetch import file_uri
from loraplex.engine.lora.layers import LoRAFusedExperts, LoRAState
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization import Int8FusedExperts, Mxfp4FusedExperts, apply_quantization
from loraplex.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

ENGINE_KW = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=512, max_num_batched_tokens=64,
                 max_num_seqs=16, progress=False, enable_lora=True, max_loras=2, max_lora_rank=8)
DIMS = dict(hidden_size=64, intermediate_size=32)  # multiples of 32 (the tiny default, 72 / 40, is not)


def _experts(engine: LLMEngine) -> list[FusedExperts]:
    """The model's expert modules (the LoRA wrappers' bases)."""
    return [m.base for m in engine.runner.model.modules() if isinstance(m, LoRAFusedExperts)]


def _generate(engine: LLMEngine, prompts: list[list[int]], adapter: AdapterRef | None, max_tokens: int = 8):
    """Greedy tokens and the logits of every step, per prompt."""
    logits: dict[str, list[torch.Tensor]] = {}
    engine.runner.logits_hook = lambda seqs, lg: [logits.setdefault(s.request_id, []).append(lg[j].clone())
                                                  for j, s in enumerate(seqs)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tag = "a" if adapter else "b"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params, adapter=adapter)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.output_token_ids)
    names = [f"{tag}{i}" for i in range(len(prompts))]
    return [tokens[n] for n in names], [torch.stack(logits[n]) for n in names]


def _adapter(tmp_path, path: str) -> AdapterRef:
    from loraplex.bench.workload import write_random_adapter

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    folder = write_random_adapter(str(tmp_path / "adapter"), cfg, rank=4, alpha=8, seed=5, dtype=torch.float32,
                                  std=0.3)
    return AdapterRef("t/mxfp4/1", file_uri(folder))


def test_mxfp4_engine_is_the_float_engine_on_dequantised_experts(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("gpt_oss", **DIMS)
    q = LLMEngine.from_pretrained(path, quantization="mxfp4", adapter_cache_dir=str(tmp_path / "q"), **ENGINE_KW)
    ref = LLMEngine.from_pretrained(path, adapter_cache_dir=str(tmp_path / "f"), **ENGINE_KW)
    experts = _experts(q)
    assert len(experts) == 3 and all(isinstance(m, Mxfp4FusedExperts) for m in experts)
    e0 = experts[0]
    assert e0.w13_blocks.shape == (6, 64, 32) and e0.w13_scales.shape == (6, 64, 2)  # [E, 2I, H/2], [E, 2I, H/32]
    assert e0.w2_blocks.shape == (6, 64, 16) and e0.w2_scales.shape == (6, 64, 1)
    assert all(b.dtype == torch.uint8 for b in (e0.w13_blocks, e0.w13_scales, e0.w2_blocks, e0.w2_scales))
    with torch.no_grad():  # the float engine with the dequantised weights; the same checkpoint otherwise
        for f, m in zip(_experts(ref), experts):
            assert not torch.equal(f.w13, m.w13)  # the quantisation did round
            f.w13.copy_(m.w13)
            f.w2.copy_(m.w2)
    prompts = torch.randint(3, q.model_config.vocab_size, (4, 13), generator=torch.Generator().manual_seed(0))
    prompts = prompts.tolist()
    adapter = _adapter(tmp_path, path)
    for a in (None, adapter):  # base path (fused_moe_mxfp4) and expert LoRA (moe_experts_lora on MXFP4 weights)
        got_tokens, got_logits = _generate(q, prompts, a)
        want_tokens, want_logits = _generate(ref, prompts, a)
        assert got_tokens == want_tokens
        for g, w in zip(got_logits, want_logits):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    base_tokens, base_logits = _generate(q, prompts, None)
    lora_tokens, lora_logits = _generate(q, prompts, adapter)
    assert (lora_logits[0] - base_logits[0]).norm() > 0.1 * base_logits[0].norm()  # the adapter matters


def test_lora_path_reads_blocks_not_dequantised_weights(monkeypatch):
    """The expert LoRA wrapper hands blocks and scales to ``ops.moe_experts_lora`` (no dequantised copy)."""
    E, H, I, L, R = 4, 64, 32, 2, 4
    float_base = FusedExperts(E, H, I, bias=True, activation="swiglu_clamp")
    with torch.no_grad():
        for p in float_base.parameters():
            p.copy_(torch.randn(p.shape) / 3)
    q = Mxfp4FusedExperts.from_float(float_base)
    state = LoRAState(L, torch.device("cpu"))
    lora = ((torch.randn(L, E, R, H) / 8, torch.randn(L, E, 2 * I, R)), (torch.randn(L, E, R, I) / 6,
                                                                           torch.randn(L, E, H, R)))
    wrapper = LoRAFusedExperts(q, state, *lora)  # stacked pairs: every step slot at rank R
    wrapper.loaded = set(range(L))
    x = torch.randn(5, H)
    weights, ids = torch.topk(torch.rand(5, E).softmax(-1), 2, dim=-1)
    state.token_lora_idx = torch.tensor([0, -1, 1, 1, 0], dtype=torch.int32)
    state.active_slots, state.num_slots = frozenset({0, 1}), L
    want = wrapper(x, weights, ids)

    def no_dequant(self):
        raise AssertionError("the LoRA path must not dequantise the experts on access")

    monkeypatch.setattr(Mxfp4FusedExperts, "w13", property(no_dequant))
    monkeypatch.setattr(Mxfp4FusedExperts, "w2", property(no_dequant))
    torch.testing.assert_close(wrapper(x, weights, ids), want, rtol=0, atol=0)
    assert torch.isfinite(want).all()


def test_from_float_stores_the_format_and_refuses_bad_input():
    E, H, I = 3, 64, 96
    base = FusedExperts(E, H, I)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape))
    q = Mxfp4FusedExperts.from_float(base)
    blocks, scales = quantize_mxfp4(base.w2[1])
    assert torch.equal(q.w2_blocks[1], blocks) and torch.equal(q.w2_scales[1], scales)
    assert torch.equal(q.w2[1], dequantize_mxfp4(blocks, scales))
    with pytest.raises(TypeError, match="expected float FusedExperts"):
        Mxfp4FusedExperts.from_float(q)
    with pytest.raises(TypeError, match="expected float FusedExperts"):
        Mxfp4FusedExperts.from_float(Int8FusedExperts.from_float(base))
    with pytest.raises(ValueError, match="hidden_size \\(K of w13\\) to be a multiple of 32 .*; got 72"):
        Mxfp4FusedExperts.from_float(FusedExperts(E, 72, I))
    with pytest.raises(ValueError, match="intermediate size per rank \\(K of w2\\) to be a multiple of 32"):
        Mxfp4FusedExperts.from_float(FusedExperts(E, H, 40))


def test_engine_on_a_model_with_k_not_a_multiple_of_32_fails_clearly(tiny_checkpoint):
    path = tiny_checkpoint("gpt_oss")  # hidden 72, intermediate 40
    with pytest.raises(ValueError, match="MXFP4 needs hidden_size \\(K of w13\\) to be a multiple of 32"):
        LLMEngine.from_pretrained(path, quantization="mxfp4", **{**ENGINE_KW, "enable_lora": False})


def test_apply_quantization_mxfp4_and_engine_config():
    from loraplex.engine.engine_config import EngineConfig

    model = torch.nn.ModuleDict({"experts": FusedExperts(2, 32, 32)})
    with torch.no_grad():
        model["experts"].w13.normal_()
        model["experts"].w2.normal_()
    assert apply_quantization(model, "mxfp4") == 1 and isinstance(model["experts"], Mxfp4FusedExperts)
    assert apply_quantization(model, "mxfp4") == 0  # already in the format: untouched
    with pytest.raises(ValueError, match="found no FusedExperts to quantise"):
        apply_quantization(torch.nn.ModuleDict({"dense": torch.nn.Linear(2, 2)}), "mxfp4")
    assert EngineConfig(model="m", quantization="mxfp4").quantization == "mxfp4"
    with pytest.raises(ValueError, match="'int8' or 'mxfp4'"):
        EngineConfig(model="m", quantization="fp4")
