"""RecentWindow: per-bin throughput and nearest-rank percentiles, per-tenant usage, bounded memory."""
from __future__ import annotations

import pytest

from loraplex.platform.metrics.window import RecentWindow, percentile


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record(w: RecentWindow, tenant="acme", status=200, e2e=0.1, prompt=3, completion=2, error=None):
    w.record(tenant=tenant, adapter="a", status=status, prompt_tokens=prompt, completion_tokens=completion,
             latencies={"ttft": None, "tpot": None, "e2e": e2e}, error=error)


def test_percentile_is_nearest_rank():
    values = sorted(float(v) for v in range(1, 101))
    assert [percentile(values, p) for p in (50, 90, 99)] == [50.0, 90.0, 99.0]
    assert percentile([], 50) is None and percentile([7.0], 99) == 7.0


def test_bins_rates_percentiles_and_errors():
    clock = Clock(1000.0)
    w = RecentWindow(clock=clock)
    for i in range(1, 11):               # second 1000: ten requests, e2e 0.1 .. 1.0
        record(w, e2e=i / 10)
    clock.t = 1006.0
    record(w, status=500, e2e=None, error="boom")
    record(w, status=429, e2e=None)
    clock.t = 1012.5                     # bins [1000, 1005) and [1005, 1010) complete; [1010, 1015) in progress
    s = w.series(bin_s=5, span_s=15)
    assert s["t"] == [995, 1000, 1005]
    assert s["requests_per_s"] == [0.0, 2.0, 0.4]
    assert s["tokens_per_s"] == [0.0, 10.0, 2.0]
    assert s["e2e_p50"] == [None, 0.5, None] and s["e2e_p90"][1] == 0.9 and s["e2e_p99"][1] == 1.0
    assert s["errors_4xx"] == [0, 0, 1] and s["errors_5xx"] == [0, 0, 1]
    assert w.series(bin_s=5, span_s=15, since=1000.0)["t"] == [1000, 1005]
    assert [e["status"] for e in w.recent_errors()] == [429, 500] and w.recent_errors()[1]["error"] == "boom"
    with pytest.raises(ValueError, match="need 1 <= bin_s <= span_s"):
        w.series(bin_s=10, span_s=5)


def test_tenant_usage_looks_back_one_minute_and_old_seconds_are_dropped():
    clock = Clock(2000.0)
    w = RecentWindow(horizon_s=60, clock=clock)
    record(w, tenant="acme", prompt=10, completion=5)
    clock.t = 2030.0
    record(w, tenant="acme", prompt=1, completion=1)
    record(w, tenant="globex", prompt=4, completion=0)
    assert w.tenant_usage(60) == {"acme": {"requests": 2, "tokens": 17}, "globex": {"requests": 1, "tokens": 4}}
    clock.t = 2075.0
    record(w, tenant="globex", prompt=1, completion=0)   # second 2000 falls out of the 60 s horizon
    assert w.tenant_usage(60) == {"acme": {"requests": 1, "tokens": 2}, "globex": {"requests": 2, "tokens": 5}}
    assert min(w._buckets) > 2075 - 60


def test_latency_samples_per_second_are_bounded():
    w = RecentWindow(samples_per_second=16, clock=Clock(3000.0), seed=1)
    for i in range(1000):
        record(w, e2e=float(i))
    [bucket] = w._buckets.values()
    assert bucket.requests == 1000 and len(bucket.samples["e2e"]) == 16
