"""``loraplex bench serve`` at tiny scale on the CPU: the report's fields are consistent, the generated PEFT
adapters are what the engine and PEFT read, the adapter mixes and percentiles behave."""
from __future__ import annotations

import os

import pytest
import torch

from loraplex.bench.stats import RequestTiming, percentile, summarize
from loraplex.bench.workload import (GPT_OSS_20B, GPT_OSS_TINY, adapter_assignment, adapter_tensor_shapes,
                                     request_plan, write_model_config, write_random_adapter)


def test_report_counts_every_token_and_orders_percentiles(tiny_report):
    report, _ = tiny_report
    names = [s["name"] for s in report["scenarios"]]
    assert names == ["float32 base-only", "float32 2 adapters r4"]
    for s in report["scenarios"]:
        assert not s["truncated"]
        assert s["num_requests"] == 7
        assert s["total_output_tokens"] == s["num_requests"] * s["output_len"] == 35
        assert s["input_len"] == 20 and s["concurrency"] == 3
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"]
        assert 0 < s["tpot_p50_ms"] <= s["tpot_p99_ms"]
        assert s["per_request_output_tok_s"] > 0 and s["per_request_decode_tok_s"] > 0
        # output tokens over wall time; the total adds the prompts (20 per request)
        assert s["output_throughput_tok_s"] == pytest.approx(35 / s["duration_s"])
        assert s["total_throughput_tok_s"] == pytest.approx((35 + 7 * 20) / s["duration_s"])
        # each request's e2e latency is at most the scenario's wall time, so its rate is at least 5 / wall
        assert s["per_request_output_tok_s"] >= 5 / s["duration_s"] - 1e-9
        assert s["peak_memory_gib"] is None and s["peak_rss_gib"] > 0
    base, lora = report["scenarios"]
    assert base["extra"]["requests_per_adapter"] == {"None": 7}
    assert lora["extra"]["requests_per_adapter"] == {"0": 4, "1": 3}  # even mix: round-robin
    assert set(report["ratios"]) == {"float32 TPOT adapters / base"}
    assert report["env"]["device"] == "cpu" and report["workload"]["dtype"] == "float32"


def test_profiles_cover_decode_steps_and_an_arrival(tiny_report):
    """--profile-steps writes, per scenario kind, the decode-step operator table and the arrival (a new prompt's
    prefill mixed with the running decodes) table."""
    _, out = tiny_report
    for name in ("profile_base.txt", "profile_adapters.txt"):
        text = (out / name).read_text(encoding="utf-8")
        assert "# decode profile" in text and "3 sequences decoding, 2 steps" in text
        arrival = text[text.index("# arrival profile"):]
        assert "a 20-token prompt joins 2 decoding sequences; without the profiler: 1 steps" in arrival
        assert "## by device time" in arrival and "## by CPU time" in arrival and "aten::" in arrival
        assert "## Python functions" in arrival and "(step)" in arrival  # cProfile saw LLMEngine.step


def test_markdown_has_a_row_per_scenario(tiny_report):
    report, out = tiny_report
    md = (out / "bench_serve.md").read_text(encoding="utf-8")
    for s in report["scenarios"]:
        row = next(line for line in md.splitlines() if line.startswith(f"| {s['name']} |"))
        assert f"| {s['num_requests']} | {s['per_request_output_tok_s']:.1f} |" in row
    assert "bench serve --scale tiny" in md


def test_generated_adapter_matches_the_engine_format_and_peft(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from loraplex.engine.config import ModelConfig
    from loraplex.engine.lora.format import check_adapter, parse_adapter_config, read_safetensors_header

    folder = write_model_config(str(tmp_path / "model"), GPT_OSS_TINY)
    adapter = write_random_adapter(str(tmp_path / "a"), GPT_OSS_TINY, rank=4, dtype=torch.float32, seed=3)
    with open(os.path.join(adapter, "adapter_config.json"), encoding="utf-8") as f:
        cfg = parse_adapter_config(f.read(), max_rank=8)
    spec = check_adapter(cfg, read_safetensors_header(os.path.join(adapter, "adapter_model.safetensors")),
                         ModelConfig.from_pretrained(folder), max_rank=8)
    assert set(spec.targets) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                 "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert spec.rank == 4 and len(spec.modules) == 6 * GPT_OSS_TINY["num_hidden_layers"]
    # PEFT loads every tensor where we meant it (gate_up inner, down outer)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    peft_sd = PeftModel.from_pretrained(model, adapter).state_dict()
    ours = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    for name, t in ours.items():
        assert torch.equal(peft_sd[name.replace(".weight", ".default.weight")], t), name


def test_full_scale_adapter_shapes_are_gpt_oss_20b():
    shapes = adapter_tensor_shapes(GPT_OSS_20B, 32)
    pre = "base_model.model.model.layers.23"
    assert shapes[f"{pre}.self_attn.q_proj.lora_B.weight"] == (4096, 32)
    assert shapes[f"{pre}.self_attn.k_proj.lora_B.weight"] == (512, 32)
    assert shapes[f"{pre}.mlp.experts.base_layer.lora_A.weight"] == (32 * 32, 2880)
    assert shapes[f"{pre}.mlp.experts.base_layer.lora_B.weight"] == (5760, 32 * 32)
    assert shapes[f"{pre}.mlp.experts.lora_B.weight"] == (2880, 32 * 32)
    assert len(shapes) == 24 * 12


def test_adapter_mixes():
    assert adapter_assignment(10, 4, "even") == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    uniform = adapter_assignment(2000, 4, "uniform", seed=1)
    assert set(uniform) == {0, 1, 2, 3} and all(400 < uniform.count(k) < 600 for k in range(4))
    zipf = adapter_assignment(2000, 4, "zipf", seed=1)
    counts = [zipf.count(k) for k in range(4)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 1.6 * counts[1]  # P ∝ 1/(k+1)
    assert adapter_assignment(3, 0, "zipf") == [None, None, None]
    with pytest.raises(ValueError, match="adapter mix 'pareto' is not supported"):
        adapter_assignment(3, 2, "pareto")
    plan = request_plan(num_requests=4, num_adapters=2, mix="even", input_len=9, vocab=50, seed=0)
    assert [len(p.prompt) for p in plan] == [9] * 4 and all(2 <= t < 50 for p in plan for t in p.prompt)


def test_percentile_and_summary():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    t = [RequestTiming("a", None, 10, arrival=0.0, first_token=0.5, finish=2.5, output_tokens=5),
         RequestTiming("b", 0, 10, arrival=1.0, first_token=1.1, finish=3.1, output_tokens=5),
         RequestTiming("c", 0, 10, arrival=2.0)]  # never finished: left out
    s = summarize("x", t, concurrency=2, input_len=10, output_len=5, start=0.0, end=4.0, peak_memory_gib=None,
                  peak_rss_gib=1.0)
    assert s.num_requests == 2 and s.total_output_tokens == 10
    assert s.tpot_mean_ms == pytest.approx(500.0) and s.per_request_decode_tok_s == pytest.approx(2.0)
    assert s.ttft_p50_ms == pytest.approx(300.0)
    assert s.per_request_output_tok_s == pytest.approx((5 / 2.5 + 5 / 2.1) / 2)
    assert s.output_throughput_tok_s == pytest.approx(2.5)
    with pytest.raises(RuntimeError, match="no request finished"):
        summarize("y", t[2:], concurrency=1, input_len=1, output_len=1, start=0.0, end=1.0, peak_memory_gib=None,
                  peak_rss_gib=1.0)


def test_bad_config_is_refused_with_its_reason():
    from loraplex.bench.serve import ServeBenchConfig
    from loraplex.cli import main

    with pytest.raises(ValueError, match="scale 'huge' is not supported; choose one of full, tiny"):
        ServeBenchConfig(scale="huge")
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        ServeBenchConfig(scale="tiny", concurrency=0)
    with pytest.raises(SystemExit, match="nothing to run: num_adapters is 0"):
        main(["bench", "serve", "--scale", "tiny", "--num-adapters", "0", "--no-base-only"])


def test_a_spent_time_limit_skips_scenarios_and_still_writes_the_report(tmp_path):
    import json

    from loraplex.cli import main

    rc = main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--total-time", "0.001", "--out",
               str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "bench_serve.json").read_text(encoding="utf-8"))
    assert report["scenarios"] == [] and report["engine"] == {}
    assert report["skipped"] == ["float32 base-only (time limit)", "float32 2 adapters r4 (time limit)"]
    assert "Skipped: float32 base-only (time limit)" in (tmp_path / "bench_serve.md").read_text(encoding="utf-8")
