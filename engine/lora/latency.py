"""LatencyHistogram: durations counted into fixed buckets since start (Prometheus histogram semantics), so a scrape
sees every adapter load, not only the last ones. Pure bookkeeping; the owner serialises ``observe`` calls.

    observe(0.004)  ->  le=0.001: 0  le=0.0025: 0  le=0.005: 1  ...  le=+Inf: 1   count 1, sum 0.004
"""
from __future__ import annotations

import bisect

# adapter loads: a CPU -> GPU copy takes about a millisecond, a fetch from the blob store up to a minute
LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class LatencyHistogram:
    """Cumulative bucket counts, count and sum of observed seconds."""

    def __init__(self, buckets: tuple[float, ...] = LOAD_BUCKETS_S) -> None:
        if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be positive and strictly increasing, got {buckets}")
        self.buckets = tuple(float(b) for b in buckets)
        self._in_bucket = [0] * (len(self.buckets) + 1)   # the last one: above every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        self._in_bucket[bisect.bisect_left(self.buckets, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def snapshot(self) -> dict:
        """``{"buckets": [[upper bound, cumulative count], ...], "count": n, "sum": seconds}`` (JSON-ready; the
        +Inf bucket is ``count``)."""
        cumulative, total = [], 0
        for bound, n in zip(self.buckets, self._in_bucket):
            total += n
            cumulative.append([bound, total])
        return {"buckets": cumulative, "count": self.count, "sum": self.sum}


__all__ = ["LOAD_BUCKETS_S", "LatencyHistogram"]
