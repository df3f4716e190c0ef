"""engine_stats on a real tiny engine with LoRA (float32 CPU): load, KV blocks, prefix cache, adapter tiers."""
from __future__ import annotations

import json
import os

import pytest

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.lora.fetch import file_uri
from loraplex.engine.lora.manager import sha256_file
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.stats import engine_stats
from tests.utils.adapters import make_peft_adapter
from tests.utils.tiny_models import make_tiny_base

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    base = make_tiny_base("llama", str(tmp_path_factory.mktemp("stats-base")))
    eng = LLMEngine.from_pretrained(base, device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                                    max_cpu_loras=2, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=128,
                                    block_size=4, num_kv_blocks=64, progress=False,
                                    adapter_cache_dir=str(tmp_path_factory.mktemp("stats-cache")))
    refs = []
    for i in range(2):
        folder = make_peft_adapter("llama", str(tmp_path_factory.mktemp(f"stats-lora{i}")), r=4, seed=i)
        refs.append(AdapterRef(f"t/a{i}/1", file_uri(folder),
                               sha256_file(os.path.join(folder, "adapter_model.safetensors"))))
    yield eng, refs
    eng.close()


def test_idle_engine_before_any_request(engine):
    eng, _ = engine
    s = engine_stats(eng)
    assert s["requests_running"] == s["requests_waiting"] == s["queue_length"] == 0
    assert s["kv_blocks_total"] == 64 and s["kv_blocks_free"] == 64 and s["kv_blocks_used"] == 0
    assert s["prefix_cache_hit_rate"] is None and s["gpu_slot_hit_rate"] is None
    assert s["lora_enabled"] is True and s["adapter_tiers"] == {"gpu": 0, "cpu": 0, "disk": 0}
    json.dumps(s)  # JSON-ready for the engine server's stats route


def test_stats_follow_a_workload(engine):
    eng, (a0, a1) = engine
    prompt = list(range(1, 14))                        # 13 tokens: 3 full blocks of 4 can be shared
    eng.add_request("q0", prompt, PARAMS, a0)
    eng.add_request("q1", prompt, PARAMS, None)
    s = engine_stats(eng)
    assert s["requests_waiting"] == 2 and s["queue_length"] == 2 and s["requests_running"] == 0
    while eng.has_unfinished_requests():
        eng.step()
    eng.generate([prompt, prompt], PARAMS, [a0, a1])  # a0 again: prefix hit under a0, slot hit
    s = engine_stats(eng)
    assert s["requests_running"] == s["requests_waiting"] == 0
    assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == 64
    assert s["prefix_cache_queries"] > 0 and s["prefix_cache_hits"] == 12   # 3 blocks of a0's second request
    assert s["prefix_cache_hit_rate"] == pytest.approx(s["prefix_cache_hits"] / s["prefix_cache_queries"])
    assert sorted(s["adapters"]["gpu"]) == ["t/a0/1", "t/a1/1"]
    assert s["adapter_tiers"] == {"gpu": 2, "cpu": 2, "disk": 2}
    assert s["adapter_cold_starts"] == 2                                # one fetch per adapter
    c = s["adapter_counters"]
    assert c["activations"] == 2 and c["slot_hits"] >= 1
    assert s["gpu_slot_hit_rate"] == pytest.approx(c["slot_hits"] / (c["slot_hits"] + c["activations"]))


def test_engine_without_lora(tmp_path):
    base = make_tiny_base("llama", str(tmp_path / "base"))
    eng = LLMEngine.from_pretrained(base, device="cpu", dtype="float32", num_kv_blocks=16, block_size=4,
                                    progress=False)
    s = engine_stats(eng)
    assert s["lora_enabled"] is False and s["adapter_tiers"] == {"gpu": 0, "cpu": 0, "disk": 0}
    assert s["kv_blocks_total"] == 16


def test_empty_stats_has_the_same_keys(engine):
    from loraplex.engine.stats import empty_stats

    eng, _ = engine
    assert set(empty_stats()) == set(engine_stats(eng)) and empty_stats()["kv_blocks_total"] == 0
