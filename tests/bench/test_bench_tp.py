"""``loraplex bench serve --tensor-parallel-size 2`` at tiny scale on the CPU (rank 0 here, one gloo worker spawned):
the run completes with adapters and INT8 experts on both ranks, reports the engine it ran, and stops its worker.
Also the bench's engine set-up: adapter reuse across invocations, the in-place fetcher, the engine keywords."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from loraplex.bench.engine_setup import InPlaceFileFetcher, engine_kwargs
from loraplex.bench.serve import ServeBenchConfig, prepare_adapters
from loraplex.bench.workload import GPT_OSS_TINY
from loraplex.engine.lora.fetch import AdapterFetchError, file_uri


def test_tp2_bench_completes_reports_and_stops_its_worker(tmp_path):
    from loraplex.cli import main

    out, work = tmp_path / "out", tmp_path / "work"
    rc = main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--tensor-parallel-size", "2",
               "--quantization", "int8", "--num-requests", "4", "--concurrency", "2", "--output-len", "3",
               "--input-len", "12", "--num-adapters", "2", "--out", str(out), "--work-dir", str(work)])
    assert rc == 0
    report = json.loads((out / "bench_serve.json").read_text(encoding="utf-8"))
    assert [s["name"] for s in report["scenarios"]] == ["int8 base-only", "int8 2 adapters r4"]
    for s in report["scenarios"]:
        assert not s["truncated"] and s["num_requests"] == 4 and s["total_output_tokens"] == 12
        assert s["extra"]["tensor_parallel_size"] == 2 and s["extra"]["quantization"] == "int8"
        assert s["extra"]["engine_steps"] > 0
    assert report["scenarios"][1]["extra"]["requests_per_adapter"] == {"0": 2, "1": 2}
    engine = report["engine"]["int8"]
    assert engine["tensor_parallel_size"] == 2 and engine["quantization"] == "int8"
    assert engine["cuda_graphs"] in (0, None)  # CPU, and TP never captures graphs
    setup = report["setup_s"]
    assert set(setup) >= {"adapters_write", "model_load_int8", "engine_start_int8", "warmup int8 base-only",
                          "warmup int8 2 adapters r4"}
    assert 0 < setup["model_load_int8"] < setup["engine_start_int8"]
    md = (out / "bench_serve.md").read_text(encoding="utf-8")
    assert "- engine int8: tensor parallel 2" in md
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("loraplex-tp-")]


def test_adapters_are_reused_by_a_later_stage_asking_for_no_more(tmp_path):
    root = str(tmp_path / "adapters")
    kw = dict(rank=4, device="cpu", dtype=torch.float32)
    folders, reused = prepare_adapters(root, GPT_OSS_TINY, num=2, **kw)
    assert not reused and [os.path.basename(f) for f in folders] == ["adapter-0", "adapter-1"]
    weights = os.path.join(folders[0], "adapter_model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    assert prepare_adapters(root, GPT_OSS_TINY, num=1, **kw) == (folders[:1], True)  # the HF stage needs one
    assert prepare_adapters(root, GPT_OSS_TINY, num=2, **kw) == (folders, True)
    assert os.stat(weights).st_mtime_ns == stamp
    _, reused = prepare_adapters(root, GPT_OSS_TINY, num=3, **kw)        # more than written: write again
    assert not reused
    _, reused = prepare_adapters(root, GPT_OSS_TINY, num=3, rank=8, device="cpu", dtype=torch.float32)
    assert not reused                                                     # another rank
    assert json.loads(open(os.path.join(root, "bench_adapters.json"), encoding="utf-8").read())["rank"] == 8


def test_in_place_fetcher_returns_the_source_folder(tmp_path):
    src = tmp_path / "peft"
    src.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    assert InPlaceFileFetcher().fetch(file_uri(src), str(dest)) == str(src)
    assert not os.listdir(dest)  # nothing copied
    with pytest.raises(AdapterFetchError, match="does not exist"):
        InPlaceFileFetcher().fetch(file_uri(tmp_path / "missing"), str(dest))
    with pytest.raises(AdapterFetchError, match="handles file:// URIs"):
        InPlaceFileFetcher().fetch("s3://bucket/key", str(dest))


def test_engine_kwargs_are_an_engine_config_of_the_workload(tmp_path):
    from loraplex.engine.engine_config import EngineConfig

    cfg = ServeBenchConfig(scale="full", tensor_parallel_size=2, enforce_eager=True, async_scheduling=False)
    kw = engine_kwargs(cfg, str(tmp_path), device="cpu", dtype="float32", quantization="int8")
    config = EngineConfig(model=str(tmp_path), **kw)     # every keyword is a field the engine validates
    assert (config.quantization, config.tensor_parallel_size, config.enforce_eager) == ("int8", 2, True)
    assert config.async_scheduling is False and config.load_format == "dummy"
    # the engine's defaults: no adapter cap, step budget, sequence count or KV pool patched by the bench
    assert config.max_loras is None and config.max_num_batched_tokens is None
    assert config.max_num_seqs is None and config.num_kv_blocks is None
    assert config.max_model_len == 1600 + 600 + 16 and config.max_lora_rank == 32
    sized = ServeBenchConfig(scale="full", kv_sizing="workload", max_loras=8, max_num_batched_tokens=2048)
    config = EngineConfig(model=str(tmp_path), **engine_kwargs(sized, str(tmp_path), device="cpu", dtype="float32",
                                                               quantization=None))
    assert config.num_kv_blocks == -(-(1600 + 600 + 16) // 16) * 16 + 64   # 16 full sequences + 64 blocks
    assert (config.max_loras, config.max_num_batched_tokens, config.max_num_seqs) == (8, 2048, 16)


def test_new_options_are_validated():
    with pytest.raises(ValueError, match="quantization 'fp8' is not supported; choose one of int8"):
        ServeBenchConfig(scale="tiny", quantization="fp8")
    with pytest.raises(ValueError, match="int8 \\(a second, INT8 phase"):
        ServeBenchConfig(scale="tiny", quantization="int8", int8=True)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        ServeBenchConfig(scale="tiny", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="scenario_time_s must be > 0, got 0"):
        ServeBenchConfig(scale="tiny", scenario_time_s=0)
    assert ServeBenchConfig(scale="tiny", hf_only=True, num_adapters=0, base_only=False).hf_baseline
