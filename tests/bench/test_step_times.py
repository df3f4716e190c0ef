"""The serving benchmark's step times: each engine.step() call is a graph replay (it launched one) or an eager step
that returned outputs; calls that returned nothing (waits on an adapter load) are in neither."""
from __future__ import annotations

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
