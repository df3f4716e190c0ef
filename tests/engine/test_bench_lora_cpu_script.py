"""benchmarks/engine/bench_lora_cpu.py: its small checkpoint builds for every family it offers (gpt_oss's used to
fail: the harmony tokenizer cannot have the other families' 1,024 ids), and a run of the default family at the
smallest batch prints the three setups with positive step times and tokens/s that follow from them."""
from __future__ import annotations

import pytest

from tests.utils.scripts import load_script

bench = load_script("engine", "bench_lora_cpu")
FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")


@pytest.mark.parametrize("family", FAMILIES)
def test_small_checkpoint_of_every_family(tmp_path, family):
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    cfg = ModelConfig.from_pretrained(make_tiny_checkpoint(family, str(tmp_path / family),
                                                           **bench.small_overrides(family)))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (256, 4, 8, 2, 32)
    assert cfg.is_moe == (family in bench.MOE)
    if cfg.is_moe:
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)


def test_three_setups_at_the_smallest_batch(capsys):
    bench.main(["--batch", "2", "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1"])  # qwen3_moe
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("qwen3_moe: H=256, 4 layers, batch 2,"))
    assert lines[head + 1].split() == ["setup", "prefill", "step", "ms", "decode", "step", "ms", "decode", "tok/s"]
    rows = {line[:22].strip(): [float(v) for v in line[22:].split()] for line in lines[head + 2:head + 5]}
    assert list(rows) == ["base, LoRA off", "base, LoRA on", "8 adapters (r 8/16)"]
    for prefill_ms, decode_ms, tok_s in rows.values():
        assert prefill_ms > 0 and decode_ms > 0
        assert tok_s == pytest.approx(2 / decode_ms * 1e3, rel=0.02, abs=0.1)
