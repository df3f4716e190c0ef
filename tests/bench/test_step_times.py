"""The serving benchmark's step times: each engine.step() call is a graph replay (it launched one) or an eager step
that returned outputs; calls that returned nothing (waits on an adapter load) are in neither."""
from __future__ import annotations

import json

import pytest

from loraplex.bench.probe import split_step_times


def test_calls_split_into_graph_replays_and_eager_steps_with_outputs():
    seconds = [0.010, 0.060, 0.011, 0.002, 0.012, 0.070, 0.013]
    outputs = [16, 16, 16, 0, 16, 15, 16]
    graph = [True, False, True, False, True, False, True]
    split = split_step_times(seconds, outputs, graph)
    assert split["graph"]["n"] == 4 and split["graph"]["mean"] == pytest.approx(11.5)
    assert split["graph"]["p50"] == pytest.approx(11.5)
    assert split["eager"]["n"] == 2 and split["eager"]["mean"] == pytest.approx(65.0)   # the empty call left out


def test_no_calls_and_mismatched_lists():
    assert split_step_times([], [], []) == {"graph": {"n": 0, "p50": None, "mean": None},
                                            "eager": {"n": 0, "p50": None, "mean": None}}
    with pytest.raises(ValueError):
        split_step_times([0.1, 0.2], [1, 1], [True])


def test_a_serving_run_counts_the_arrivals_launched_behind_a_decode_step(tmp_path):
    """With overlapped scheduling (the padded decode path, run eagerly on the CPU) a closed loop's arrivals find a
    decode step in flight: their steps are launched before it is read back, and each run reports how many."""
    from loraplex.cli import main

    out = tmp_path / "out"
    rc = main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--num-requests", "8", "--concurrency", "3",
               "--output-len", "6", "--input-len", "12", "--num-adapters", "2", "--async-scheduling",
               "--max-num-batched-tokens", "16",  # prompts split over steps: requests finish at different steps
               "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench_serve.json").read_text(encoding="utf-8"))
    for s in report["scenarios"]:
        e = s["extra"]
        assert e["early_launched_steps"] > 0, s["name"]
        assert e["step_ms"]["eager"]["n"] > 0 and e["step_ms"]["graph"]["n"] == 0  # CPU: no graphs captured
