"""INT8 weight-only experts as a transform of a built engine: greedy top-1 stays the float model's, the LoRA
path computes the float model on the dequantised weights, and the adapter's effect is kept."""
from __future__ import annotations

import json
import os

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.lora.fetch import file_uri
from loraplex.engine.lora.layers import LoRAFusedExperts
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization import Int8FusedExperts, quantize_experts_int8

ENGINE_KW = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=512, max_num_batched_tokens=64,
                 max_num_seqs=16, progress=False)


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _prompt_top1(engine: LLMEngine, prompts: list[list[int]]) -> list[int]:
    """Top-1 token the model predicts at every prompt position (teacher-forced, so no divergence cascades)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [e.top[0][0] for i in range(len(prompts)) for e in final[f"p{i}"].prompt_logprobs if e is not None]


def test_int8_experts_keep_the_float_top1(tiny_checkpoint):
    path = tiny_checkpoint("gpt_oss")
    ref = LLMEngine.from_pretrained(path, **ENGINE_KW)
    q = LLMEngine.from_pretrained(path, **ENGINE_KW)
    n = quantize_experts_int8(q.runner.model)
    moe = [m for m in q.runner.model.modules() if isinstance(m, FusedExperts)]
    assert n == len(moe) == 3 and all(isinstance(m, Int8FusedExperts) for m in moe)
    assert all(m.w13_q.dtype == torch.int8 and m.w2_q.dtype == torch.int8 for m in moe)
    assert moe[0].w13_scale.shape == (6, 80) and moe[0].w2_scale.shape == (6, 72)  # per (expert, out channel)
    prompts = _prompts(ref.model_config.vocab_size, 6, 33, seed=0)
    want, got = _prompt_top1(ref, prompts), _prompt_top1(q, prompts)
    assert len(want) == len(got) == 6 * 32
    agree = sum(a == b for a, b in zip(want, got)) / len(want)
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}"


def test_dequantised_weights_are_within_int8_rounding(tiny_checkpoint):
    path = tiny_checkpoint("gpt_oss")
    engine = LLMEngine.from_pretrained(path, **ENGINE_KW)
    experts = next(m for m in engine.runner.model.modules() if isinstance(m, FusedExperts))
    q = Int8FusedExperts.from_float(experts)
    err = (q.w13 - experts.w13).abs()
    step = q.w13_scale[..., None]  # one int8 step per output channel
    assert torch.all(err <= 0.5 * step + 1e-7)
    assert err.max() > 0  # it did round
    with pytest.raises(TypeError, match="int8 quantises the float weights once"):
        Int8FusedExperts.from_float(q)


def _adapter(tmp_path, path: str) -> AdapterRef:
    from loraplex.bench.workload import write_random_adapter

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    folder = write_random_adapter(str(tmp_path / "adapter"), cfg, rank=4, alpha=8, seed=5, dtype=torch.float32,
                                  std=0.3)
    return AdapterRef("t/int8/1", file_uri(folder))


def _last_logits(engine: LLMEngine, prompts, adapter) -> torch.Tensor:
    """[len(prompts), V] logits of the last prompt position, base or under ``adapter``."""
    rows = {}
    engine.runner.logits_hook = lambda seqs, lg: rows.update({s.request_id: lg[j].clone()
                                                              for j, s in enumerate(seqs)})
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(f"{'a' if adapter else 'b'}{i}", p, params, adapter=adapter)
    while engine.has_unfinished_requests():
        engine.step()
    return torch.stack([rows[f"{'a' if adapter else 'b'}{i}"] for i in range(len(prompts))])


def test_lora_delta_unchanged_under_int8(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("gpt_oss")
    adapter = _adapter(tmp_path, path)
    kw = dict(ENGINE_KW, enable_lora=True, max_loras=2, max_lora_rank=8)
    engines = {name: LLMEngine.from_pretrained(path, adapter_cache_dir=str(tmp_path / name), **kw)
               for name in ("float", "dequant", "int8")}
    q = engines["int8"]
    wrappers = [m for m in q.runner.model.modules() if isinstance(m, LoRAFusedExperts)]
    lora_before = [(w.w13_lora, w.w2_lora) for w in wrappers]
    assert quantize_experts_int8(q.runner.model, lora_slots=q.runner.lora) == len(wrappers) == 3
    assert all(isinstance(w.base, Int8FusedExperts) and "w13" not in w._parameters for w in wrappers)
    assert [(w.w13_lora, w.w2_lora) for w in wrappers] == lora_before  # the slot buffers are the same tensors
    assert all(isinstance(m, Int8FusedExperts) for _, _, m in q.runner.lora._originals
               if isinstance(m, FusedExperts))
    # the reference: the float model with the dequantised weights in place of the originals
    for w_f, w_q in zip([m for m in engines["dequant"].runner.model.modules() if isinstance(m, LoRAFusedExperts)],
                        wrappers):
        w_f.base.w13.copy_(w_q.base.w13)
        w_f.base.w2.copy_(w_q.base.w2)
    prompts = _prompts(q.model_config.vocab_size, 5, 17, seed=1)
    out = {name: (_last_logits(e, prompts, None), _last_logits(e, prompts, adapter)) for name, e in engines.items()}
    for i in range(2):  # base path (fused_moe_int8) and LoRA path (per-expert GEMMs on dequantised weights)
        torch.testing.assert_close(out["int8"][i], out["dequant"][i], rtol=1e-4, atol=1e-4)
    delta_f = out["float"][1] - out["float"][0]
    delta_q = out["int8"][1] - out["int8"][0]
    assert delta_f.norm() > 0.1 * out["float"][0].norm()  # the adapter matters
    rel = ((delta_q - delta_f).norm() / delta_f.norm()).item()
    base_rel = ((out["int8"][0] - out["float"][0]).norm() / out["float"][0].norm()).item()
    # Through the nonlinear layers the delta moves with the base weights' rounding, by the same order as the
    # base logits do, not more.
    assert 0 < base_rel < 0.15
    assert rel < 1.5 * base_rel, f"adapter delta changed by {rel:.3f} under int8 (base logits by {base_rel:.3f})"


def test_quantize_twice_is_refused(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint("gpt_oss"), **ENGINE_KW)
    quantize_experts_int8(engine.runner.model)
    with pytest.raises(ValueError, match="found no FusedExperts to quantise"):
        quantize_experts_int8(engine.runner.model)


def test_quantize_before_lora_attaches(tiny_checkpoint, tmp_path, monkeypatch):
    """Where the engine hook would run it: after load, before the KV pool is sized and LoRA wraps the experts."""
    import loraplex.engine.model_runner as model_runner

    path = tiny_checkpoint("gpt_oss")
    size_pool = model_runner.ModelRunner._size_kv_pool

    def quantize_then_size(self, *args):
        quantize_experts_int8(self.model)
        return size_pool(self, *args)

    monkeypatch.setattr(model_runner.ModelRunner, "_size_kv_pool", quantize_then_size)
    engine = LLMEngine.from_pretrained(path, enable_lora=True, max_loras=2, max_lora_rank=8,
                                       adapter_cache_dir=str(tmp_path / "cache"), **ENGINE_KW)
    wrappers = [m for m in engine.runner.model.modules() if isinstance(m, LoRAFusedExperts)]
    assert len(wrappers) == 3 and all(isinstance(w.base, Int8FusedExperts) for w in wrappers)
    adapter = _adapter(tmp_path, path)
    prompts = _prompts(engine.model_config.vocab_size, 3, 11, seed=2)
    base, lora = _last_logits(engine, prompts, None), _last_logits(engine, prompts, adapter)
    assert torch.isfinite(lora).all() and (lora - base).norm() > 0.1 * base.norm()
