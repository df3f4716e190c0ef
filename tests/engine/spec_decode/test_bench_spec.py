"""Speculative decoding in the benchmarks, at tiny scale on the CPU: ``loraplex bench serve --speculative-method``
(replay: a recorded pass without speculation, then replayed proposals at the set acceptance length; ngram) and a
smoke run of ``benchmarks/engine/bench_spec_gpu.py``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from loraplex.bench.serve import ServeBenchConfig, run_serve_bench
from tests.utils.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = dict(scale="tiny", num_adapters=2, rank=4, concurrency=2, num_requests=4, input_len=16, output_len=24,
            max_num_batched_tokens=64, block_size=4, base_only=False)


def test_bench_serve_replay_and_ngram(tmp_path):
    report = run_serve_bench(ServeBenchConfig(**TINY, speculative_method="replay", num_speculative_tokens=3,
                                              speculative_acceptance_length=2.5, work_dir=str(tmp_path)))
    (s,) = report["scenarios"]
    assert s["name"] == "float32 2 adapters r4 [replayed proposals]"
    spec, plain = s["extra"]["speculative"], s["extra"]["no_speculation"]
    assert spec["method"] == "replay" and "replayed proposals" in spec["label"]
    assert plain["num_requests"] == 4 and plain["name"].endswith("(no speculation, recorded)")
    assert 1.5 < spec["acceptance_length"] <= 4.0 and spec["verified"] > 10
    assert spec["replay_agreement"] == 1.0  # float32 on CPU: the target agrees with the recording
    assert s["total_output_tokens"] == 4 * 24
    report = run_serve_bench(ServeBenchConfig(**TINY, speculative_method="ngram", work_dir=str(tmp_path)))
    spec = report["scenarios"][0]["extra"]["speculative"]
    assert spec["method"] == "ngram" and report["scenarios"][0]["extra"]["no_speculation"] is None
    with pytest.raises(ValueError, match="acceptance length"):
        ServeBenchConfig(**TINY, speculative_method="replay", num_speculative_tokens=2,
                         speculative_acceptance_length=3.5)


def test_profile_of_a_replayed_run_verifies_drafts(tmp_path):
    """--profile-steps with replay records the profiled requests first, so the profiled arrival verifies drafts
    (the replay proposer had the arrival's prompt on record; the header counts the drafts its steps verified)."""
    out = tmp_path / "out"
    run_serve_bench(ServeBenchConfig(**TINY, speculative_method="replay", num_speculative_tokens=3,
                                     speculative_acceptance_length=3.0, profile_steps=2, work_dir=str(tmp_path),
                                     out_dir=str(out)))
    text = (out / "profile_adapters.txt").read_text(encoding="utf-8")
    arrival = text[text.index("# arrival profile"):]
    head = re.search(r"profiled: (\d+) steps until its first token.*drafts verified during it: (\d+)\n", arrival)
    steps, drafts = int(head.group(1)), int(head.group(2))
    assert 1 <= drafts <= 3 * steps  # the one decoding sequence's drafts (k = 3 a step)
    assert "## Python functions" in arrival and "(step)" in arrival


def test_bench_serve_flags():
    import argparse

    from loraplex.commands.bench import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve", "--scale", "tiny", "--speculative-method", "replay",
                              "--num-speculative-tokens", "4", "--speculative-acceptance-length", "3",
                              "--speculative-verify-cuda-graphs"])
    cfg = config_from_args(args)
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.speculative_acceptance_length,
            cfg.speculative_verify_cuda_graphs) == ("replay", 4, 3.0, True)
    assert "--speculative-method replay" in cfg.command


def test_gpu_script_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "engine", "bench_spec_gpu.py"), "--scale", "tiny",
           "--device", "cpu", "--skip-check", "--quantizations", "none", "--concurrency", "2", "--adapters", "1",
           "--rank", "4", "--input-len", "12", "--output-len", "16"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "bench_spec_gpu.json").read_text())
    names = [v["variant"] for v in report["variants"]]
    assert names == ["float32 plain", "float32 replay L=2.0 k=2 graphs", "float32 replay L=2.5 k=3 graphs",
                     "float32 replay L=3.0 k=3 graphs", "float32 replay L=3.0 k=3 eager"]
    assert report["failures"] == [] and "FAIL" not in done.stdout
    plain = report["variants"][0]
    assert plain["steps"] >= 16 and plain["ttft_ms"] > 0 and plain["tpot_ms"] > 0
    for v in report["variants"][1:]:
        assert v["matches_recording"] and v["all_tokens"] and v["acceptance_length"] > 1.0
        assert abs(v["acceptance_length"] - v["set_acceptance_length"]) <= v["acceptance_tolerance"]
        assert (v["verify_steps_on_graphs"] > 0) == (v["verify"] == "graphs")
        assert v["verify_steps_on_graphs"] <= v["verify_steps_total"]
        assert v["steps"] < plain["steps"]  # speculating all the way: fewer steps than one per token
    assert "| float32 replay L=3.0 k=3 eager (replayed) |" in done.stdout


def _gpu_script():
    return load_script("engine", "bench_spec_gpu")


def test_gpu_script_failures():
    """A replay variant off its recording, or off the set acceptance length by more than 10% on a full run (3
    standard errors on a small one), is reported as a failure."""
    script = _gpu_script()
    rate = 0.6180339887498947  # k = 2, L = 2
    full, small = script.acceptance_tolerance(2.0, 2, rate, 2400), script.acceptance_tolerance(2.0, 2, rate, 10)
    assert full == pytest.approx(0.2) and small > 0.5
    ok = dict(variant="v", matches_recording=True, acceptance_length=2.1, set_acceptance_length=2.0,
              acceptance_tolerance=full)
    assert script.replay_failures(ok) == []
    off = script.replay_failures(dict(ok, acceptance_length=2.3))
    assert len(off) == 1 and "more than 0.200 off the set 2.0" in off[0]
    diverged = script.replay_failures(dict(ok, matches_recording=False, acceptance_length=None))
    assert len(diverged) == 2 and "differ from the recording" in diverged[0]
