"""EngineStatsPoller + apply_engine_stats: gauges per replica, cumulative engine counters as Prometheus counters,
a failing source marks its replica down, load latency from the loading list."""
from __future__ import annotations

import asyncio

import pytest

from loraplex.platform.metrics import EngineStatsPoller, PlatformMetrics
from tests.platform.metrics.conftest import parse_scrape, sample


def stats(**kw) -> dict:
    base = {"requests_running": 3, "requests_waiting": 2, "queue_length": 2, "num_preemptions": 1,
            "kv_blocks_total": 100, "kv_blocks_free": 60, "kv_blocks_used": 40, "kv_usage": 0.4,
            "prefix_cache_queries": 1000, "prefix_cache_hits": 250, "prefix_cache_hit_rate": 0.25,
            "adapters": {"gpu": ["t/a/1"], "cpu": ["t/a/1", "t/b/1"], "disk": 5, "loading": []},
            "adapter_tiers": {"gpu": 1, "cpu": 2, "disk": 5}, "adapter_cold_starts": 4, "gpu_slot_hit_rate": 0.75}
    base.update(kw)
    return base


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_gauges_and_counter_growth_per_replica():
    clock = Clock()
    m = PlatformMetrics(clock=clock)
    feed = {"e0": [stats(), stats(prefix_cache_queries=1600, prefix_cache_hits=550, adapter_cold_starts=6,
                                  requests_running=1, adapters={"loading": ["t/c/1"]}),
                   stats(prefix_cache_queries=100, prefix_cache_hits=10, adapter_cold_starts=1,  # engine restarted
                         adapters={"loading": []})]}

    async def e0() -> dict:
        return feed["e0"].pop(0)

    def e1() -> dict:
        raise ConnectionError("connection refused")

    poller = EngineStatsPoller(m, {"e0": e0, "e1": e1}, max_age_s=0.0)
    for step in range(3):
        clock.t += 1.5
        asyncio.run(poller.poll_once())
    v = parse_scrape(m.exposition().decode())
    g = dict(replica="e0")
    assert sample(v, "loraplex_engine_up", **g) == 1
    assert sample(v, "loraplex_engine_up", replica="e1") == 0
    assert sample(v, "loraplex_engine_requests_running", **g) == 3
    assert sample(v, "loraplex_engine_kv_blocks_used", **g) == 40
    assert sample(v, "loraplex_engine_kv_blocks_free", **g) == 60
    assert sample(v, "loraplex_engine_prefix_cache_hit_rate", **g) == 0.25
    assert sample(v, "loraplex_engine_gpu_slot_hit_rate", **g) == 0.75
    assert sample(v, "loraplex_engine_adapters_resident", replica="e0", tier="disk") == 5
    # 1000 -> 1600 -> restart at 100: 1000 + 600 + 100
    assert sample(v, "loraplex_engine_prefix_cache_queries_total", **g) == 1700
    assert sample(v, "loraplex_engine_prefix_cache_hits_total", **g) == 250 + 300 + 10
    assert sample(v, "loraplex_engine_adapter_cold_starts_total", **g) == 4 + 2 + 1
    # t/c/1 was loading at the 2nd poll and gone at the 3rd: one load of 1.5 s (the poll interval)
    assert sample(v, "loraplex_engine_adapter_load_seconds_count", **g) == 1
    assert sample(v, "loraplex_engine_adapter_load_seconds_sum", **g) == pytest.approx(1.5)
    assert m.engines["e1"]["up"] is False and "connection refused" in m.engines["e1"]["error"]


def test_adapter_pool_gauges_and_gpu_load_counters_per_replica():
    m = PlatformMetrics()
    pool = dict(adapter_gpu_bytes=3 << 20, adapter_gpu_budget_bytes=24 << 30)
    feed = [stats(**pool, adapter_counters={"activations": 5, "evictions": 1}),
            stats(**pool, adapter_counters={"activations": 9, "evictions": 4}),
            stats(adapter_gpu_bytes=1 << 20, adapter_gpu_budget_bytes=24 << 30,      # restarted
                  adapter_counters={"activations": 2, "evictions": 0})]
    poller = EngineStatsPoller(m, {"e0": lambda: feed.pop(0), "null": lambda: stats()}, max_age_s=0.0)
    for _ in range(3):
        asyncio.run(poller.poll_once())
    v = parse_scrape(m.exposition().decode())
    assert sample(v, "loraplex_engine_adapter_gpu_bytes", replica="e0") == 1 << 20
    assert sample(v, "loraplex_engine_adapter_gpu_budget_bytes", replica="e0") == 24 << 30
    assert sample(v, "loraplex_engine_adapter_gpu_loads_total", replica="e0") == 9 + 2
    assert sample(v, "loraplex_engine_adapter_gpu_evictions_total", replica="e0") == 4 + 0
    assert sample(v, "loraplex_engine_adapter_gpu_bytes", replica="null") == 0        # no LoRA: zero, not absent
    assert sample(v, "loraplex_engine_adapter_gpu_loads_total", replica="null") == 0
    adapter_ids = {"t/a/1", "t/b/1"}
    assert not [k for k in v if adapter_ids & set(dict(k[1]).values())]              # replica labels only


def test_refresh_polls_at_most_once_per_max_age_and_a_bad_source_is_refused():
    calls = []
    m = PlatformMetrics()
    poller = EngineStatsPoller(m, {"e0": lambda: calls.append(1) or stats()}, max_age_s=60.0)

    async def twice() -> None:
        await poller.refresh()
        await poller.refresh()
    asyncio.run(twice())
    assert len(calls) == 1
    with pytest.raises(TypeError, match="stats source of 'x' must be callable"):
        poller.add_source("x", {"not": "callable"})
    poller.add_source("bad", lambda: ["not", "a", "dict"])
    asyncio.run(poller.poll_once())
    assert m.engines["bad"]["up"] is False and "expected a dict" in m.engines["bad"]["error"]
