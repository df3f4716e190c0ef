"""The start-up eager warm-up (engine/eager_warmup.py) on CPU: its plan covers every token count class and slot
count, it runs each dummy step through the real model (LoRA in always-on mode), stops at its budget, leaves the
LoRA state as it found it, and an engine warmed up serves the same greedy tokens as one that was not (GPT-OSS and
a dense family, two adapters on attention and experts mixed with base requests). Compiles are counted on the GPU
only (nothing compiles under the torch references)."""
from __future__ import annotations

import pytest

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine import eager_warmup
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.lora.ref import AdapterRef
from tests.utils.adapters import peft_adapter_of

BASE = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=40, progress=False,
            enable_lora=True, max_lora_rank=8, max_loras=4)


def test_token_counts_cover_each_power_of_two_its_odd_successor_and_the_step_limit():
    assert eager_warmup.token_counts(40) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 40]
    assert eager_warmup.token_counts(4096)[-2:] == [2049, 4096]
    assert eager_warmup.token_counts(1) == [1]
    assert eager_warmup.token_counts(40, {24, 100}) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33, 40]


def test_tuned_token_counts_of_the_device(tmp_path):
    from loraplex.kernels import tuning

    tuning.write_configs("lora_shrink", {"K=8,N=4": {24: {"BLOCK_M": 16}, 512: {"BLOCK_M": 64}}},
                         device_name="Test GPU", root=tmp_path)
    tuning.write_configs("fused_moe", {"E=2": {1: {"BLOCK_M": 16}}}, device_name="Test GPU", root=tmp_path)
    assert tuning.tuned_ms("Test GPU", tmp_path) == {1, 24, 512}
    assert tuning.tuned_ms("Other GPU", tmp_path) == set()


def test_plan_runs_base_shapes_first_then_each_slot_count():
    shapes = eager_warmup.plan(8, 4, [16, 32])
    counts = [1, 2, 3, 4, 5, 8]
    base = [(s.tokens, s.decode) for s in shapes if s.slots is None]
    assert base == [(t, d) for t in counts for d in (False, True) if not d or t <= 4]
    assert [(s.tokens, s.slots) for s in shapes if s.slots] == [(t, L) for L in (16, 32) for t in counts]
    assert all(not s.decode for s in shapes if s.slots)
    assert shapes.index(next(s for s in shapes if s.slots)) == len(base)   # LoRA shapes after every base one


def test_eager_slot_counts_are_the_powers_of_two_an_eager_step_uses(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint("qwen3"), **{**BASE, "max_num_seqs": 40})
    assert eager_warmup.eager_slot_counts(engine.runner) == [8, 16, 32, 40]
    plain = LLMEngine.from_pretrained(tiny_checkpoint("qwen3"), **{**BASE, "enable_lora": False})
    assert eager_warmup.eager_slot_counts(plain.runner) == []


@pytest.mark.parametrize("family", ["gpt_oss", "llama"])
def test_warmed_up_engine_serves_the_same_tokens(family, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(family)
    refs = [AdapterRef(f"t/{n}/1", "file://" + peft_adapter_of(path, str(tmp_path / n), r=r, seed=seed))
            for n, r, seed in (("a", 4, 1), ("b", 8, 2))]
    prompts = [[5, 9, 2, 7, 11, 3, 8], [4, 4, 1], [13, 2, 9, 9, 6, 1, 1, 2, 3, 10, 12], [7]]
    adapters = [refs[0], None, refs[1], refs[0]]

    def generate(engine):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, (p, a) in enumerate(zip(prompts, adapters)):
            engine.add_request(str(i), p, params, adapter=a)
        finals = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    finals[o.request_id] = o.output_token_ids
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
        return finals

    cold = generate(LLMEngine.from_pretrained(path, **BASE))
    engine = LLMEngine.from_pretrained(path, **BASE)
    assert engine.warmup is None                          # on CPU the engine does not warm up by itself
    lora = engine.runner.lora
    report = eager_warmup.run(engine.runner, budget_s=600.0)
    assert report.shapes == report.planned > 0 and not report.skipped
    assert report.planned == len(eager_warmup.plan(40, 8, eager_warmup.eager_slot_counts(engine.runner)))
    assert lora.state.token_lora_idx is None and not lora.state.always_on and lora.state.num_slots == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert generate(engine) == cold
    assert len(cold) == len(prompts) and all(len(t) == 6 for t in cold.values())


def test_budget_spent_leaves_the_rest_for_first_use(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint("qwen3"), **BASE)
    report = eager_warmup.run(engine.runner, budget_s=0.0)
    assert report.shapes == 0 and len(report.skipped) == report.planned > 0
    assert "budget spent" in report.summary()


def test_a_failing_dummy_step_stops_the_warm_up_without_failing_the_engine(tiny_checkpoint, monkeypatch):
    engine = LLMEngine.from_pretrained(tiny_checkpoint("qwen3"), **BASE)
    runner, model = engine.runner, engine.runner.model
    seen = []

    def forward(input_ids, positions, attn, kv_caches):
        seen.append(input_ids.shape[0])
        if runner.lora.state.always_on and input_ids.shape[0] == 8:
            raise RuntimeError("out of memory (test)")
        return model(input_ids, positions, attn, kv_caches)

    monkeypatch.setattr(runner, "model", forward)
    report = eager_warmup.run(runner, budget_s=600.0)
    assert eager_warmup.eager_slot_counts(runner) == [8]            # max_num_seqs 8 caps the slot count
    assert report.failed == "prefill T=8 L=8: RuntimeError: out of memory (test)"
    assert report.skipped[0] == eager_warmup.Shape(8, False, 8) and report.shapes + len(report.skipped) == \
        report.planned
    assert "stopped by an error at prefill T=8 L=8" in report.summary()
    lora = runner.lora
    assert lora.state.token_lora_idx is None and not lora.state.always_on
    assert seen[-1] == 8 and len(seen) == report.shapes + 1


def test_budget_setting_is_validated():
    with pytest.raises(ValueError, match="eager_warmup_budget_s must be >= 0"):
        EngineConfig(model="/m", eager_warmup_budget_s=-1.0)
    assert EngineConfig(model="/m").eager_warmup_budget_s == 90.0
