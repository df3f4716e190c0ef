"""LatencyHistogram: cumulative buckets with Prometheus' ``le`` rule (a value on a bound counts in it), count, sum."""
from __future__ import annotations

import pytest

from loraplex.engine.lora.latency import LatencyHistogram


def test_cumulative_buckets_count_and_sum():
    h = LatencyHistogram((0.01, 0.1, 1.0))
    for seconds in (0.005, 0.01, 0.05, 2.0, -1.0):      # a negative duration (clock step) counts as 0
        h.observe(seconds)
    assert h.snapshot() == {"buckets": [[0.01, 3], [0.1, 4], [1.0, 4]], "count": 5,
                            "sum": pytest.approx(2.065)}


@pytest.mark.parametrize("buckets", [(), (0.1, 0.1), (1.0, 0.5), (0.0, 1.0)])
def test_bad_buckets_are_refused(buckets):
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyHistogram(buckets)
