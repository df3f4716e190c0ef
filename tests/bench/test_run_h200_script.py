"""benchmarks/serve/run_h200.sh off the GPU: a speculative stage (``spec-<experts>-<L>``) runs ``bench serve`` with
replayed proposals at its acceptance length, the combined report checks its goal, and a malformed stage name is
refused before anything runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "serve", "run_h200.sh")
TINY = ("--scale tiny --device cpu --dtype bfloat16 --input-len 16 --output-len 8 --num-requests 3 "
        "--num-adapters 2 --rank 4 --concurrency 2")


def _run(tmp_path, stages: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "ARGS": TINY, "STAGES": stages, "PROFILE": "", "BUDGET": "200",
           "OUT": str(tmp_path / "out"), "NGPU": "1"}
    return subprocess.run(["bash", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_speculative_stage_runs_replay_and_its_goal_is_checked(tmp_path):
    proc = _run(tmp_path, "spec-bf16-3.0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    combined = json.loads((tmp_path / "out" / "bench_combined.json").read_text(encoding="utf-8"))
    (row,) = combined["rows"]
    assert row["run"] == "spec-bf16-3.0" and row["scenario"].endswith("[replayed proposals]")
    report = combined["reports"]["spec-bf16-3.0"]
    workload = report["workload"]
    assert (workload["speculative_method"], workload["num_speculative_tokens"],
            workload["speculative_acceptance_length"], workload["base_only"]) == ("replay", 3, 3.0, False)
    checks = {c["check"]: c for c in combined["checks"]}
    goal = checks["bf16, adapters, speculative (replayed, acceptance length 3): output tok/s per request >= 200"]
    assert goal["value"] == row["per_request_output_tok_s"] and goal["detail"] == "spec-bf16-3.0"
    assert checks["bf16, adapters: output tok/s per request >= 100"]["verdict"] == "n/a"  # not a plain bf16 run


def test_speculative_stage_name_needs_a_length(tmp_path):
    proc = _run(tmp_path, "spec-mxfp4-fast")
    assert proc.returncode == 2
    assert "L must be a number" in proc.stderr
    assert not (tmp_path / "out" / "bench_combined.json").exists()


def test_nomixed_suffix_runs_the_stage_with_eager_prompt_steps(tmp_path):
    proc = _run(tmp_path, "mxfp4 mxfp4-nomixed")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    combined = json.loads((tmp_path / "out" / "bench_combined.json").read_text(encoding="utf-8"))
    reports = combined["reports"]
    assert {r["run"] for r in combined["rows"]} == {"mxfp4", "mxfp4-nomixed"}
    assert "--no-mixed-cuda-graphs" in reports["mxfp4-nomixed"]["command"]
    assert "--no-mixed-cuda-graphs" not in reports["mxfp4"]["command"]
    assert "--quantization mxfp4" in reports["mxfp4-nomixed"]["command"]
    bad = _run(tmp_path / "bad", "bogus-nomixed")
    assert bad.returncode == 2 and "unknown stage 'bogus'" in bad.stderr
