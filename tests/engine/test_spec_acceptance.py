"""benchmarks/engine/spec_acceptance.py at tiny step counts: the four models and both heads train and save, every
variant (shared draft, per-adapter draft LoRA, shared and per-adapter EAGLE heads) runs the mixed workload, greedy
runs pass the script's own token-for-token check against non-speculative decoding, and the per-adapter counters
name the adapter and the base model."""
from __future__ import annotations

import torch

from tests.utils.scripts import load_script


def _load(name: str):
    return load_script("engine", name)


def test_spec_acceptance_flow(tmp_path):
    bench = _load("spec_acceptance")
    torch.set_num_threads(1)
    trained = bench.train_models(str(tmp_path), steps=4, batch=4, seq_len=16, head_steps=4)
    assert set(trained["paths"]) == {"target", "draft", "target_lora", "draft_lora", "eagle_head",
                                     "eagle_head_adapter"}
    res = bench.measure(trained["paths"], trained["chains"], ks=[2], temperatures=[0.0, 1.0], num_adapter=2,
                        num_base=1, prompt_len=8, max_tokens=6, cache_dir=str(tmp_path / "cache"))
    rows = res["rows"]
    assert [(r["temperature"], r["draft"]) for r in rows] == [
        (t, v) for t in (0.0, 1.0)
        for v in ("shared draft", "per-adapter draft LoRA", "EAGLE head", "per-adapter EAGLE head")]
    for r in rows:
        assert r["lossless_checked"] == (r["temperature"] == 0.0)
        for who in ("adapter", "base"):
            assert r[who]["verified"] > 0 and 1.0 <= r[who]["acceptance_length"] <= 3.0, r
