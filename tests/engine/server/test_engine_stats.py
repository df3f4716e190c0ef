"""The engine server's ``GET /v1/stats`` (``engine_stats`` JSON, what the platform polls) and ``GET /metrics``
(the same numbers in Prometheus text) on a real tiny engine with LoRA, and on the null engine while it loads."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.messages import EngineRequest
from tests.engine.server.conftest import ThreadServer
from tests.engine.server.test_engine_http import GREEDY, PROMPT, _ref, _wait_idle


def _scrape(url: str) -> dict[tuple[str, frozenset], float]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples if not s.name.endswith("_created")}


def _stats(url: str) -> dict:
    r = httpx.get(f"{url}/v1/stats", timeout=10)
    assert r.status_code == 200
    return r.json()


def test_stats_and_metrics_follow_a_request_with_an_adapter(engine_server, llama_adapter):
    service, server = engine_server
    ref = _ref(llama_adapter, "tenant-s/stats-bot/1")
    before = _stats(server.url)

    async def run():
        http = HttpEngineClient(server.url)
        try:
            return [c async for c in http.generate(EngineRequest("r-stats", "tenant-s", PROMPT, GREEDY, ref))]
        finally:
            await http.close()

    chunks = asyncio.run(run())
    assert chunks[-1].finished and chunks[-1].completion_tokens == GREEDY["max_tokens"]
    assert _wait_idle(service) == 0
    after = _stats(server.url)
    llm = service.engine.engine
    assert after["kv_blocks_total"] == llm.kv_cache.num_blocks > 0
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["requests_running"] == after["requests_waiting"] == after["queue_length"] == 0
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] >= len(PROMPT) - 1
    assert ref.adapter_id in after["adapters"]["gpu"] and ref.adapter_id in after["adapters"]["cpu"]
    assert after["adapter_tiers"]["gpu"] == len(after["adapters"]["gpu"]) >= 1
    assert after["adapter_cold_starts"] == before["adapter_cold_starts"] + 1   # a new adapter: fetched once
    assert after["lora_enabled"] is True and 0.0 <= after["gpu_slot_hit_rate"] <= 1.0

    v = _scrape(server.url)
    p = "loraplex_engine_server"

    def at(name, **labels):
        return v.get((f"{p}_{name}", frozenset(labels.items())))

    assert at("info", model="tiny-llama") == 1
    assert at("kv_blocks_total") == after["kv_blocks_total"] and at("kv_blocks_used") == 0
    assert at("kv_blocks_free") == after["kv_blocks_free"] and at("requests_running") == 0
    assert at("prefix_cache_queries_total") == after["prefix_cache_queries"]
    assert at("prefix_cache_hits_total") == after["prefix_cache_hits"]
    assert at("adapter_cold_starts_total") == after["adapter_cold_starts"]
    # Triton compiles since start (a CPU engine installs no watch; the counters are there, at the watch's value)
    assert at("kernel_compiles_total") == after["kernel_compiles"] >= 0
    assert at("kernel_compile_seconds_total") == after["kernel_compile_seconds"] >= 0
    for tier in ("gpu", "cpu", "disk"):
        assert at("adapters_resident", tier=tier) == after["adapter_tiers"][tier]
    assert at("adapter_events_total", event="activations") == after["adapter_counters"]["activations"] >= 1
    assert at("gpu_slot_hit_rate") == after["gpu_slot_hit_rate"]
    # the adapter pool: bytes against the budget, loads, evictions, load latency (every load since start)
    pool = llm.adapters.pool
    assert at("adapter_gpu_bytes") == after["adapter_gpu_bytes"] == pool.used_bytes > 0
    assert at("adapter_gpu_budget_bytes") == after["adapter_gpu_budget_bytes"] == pool.budget_bytes >= pool.used_bytes
    assert at("adapter_cpu_bytes") == after["adapter_cpu_bytes"] > 0 and at("adapters_copying") == 0
    assert at("adapter_events_total", event="evictions") == after["adapter_counters"]["evictions"]
    for stage, loads in (("cpu", after["adapter_counters"]["loads"]),
                         ("gpu", after["adapter_counters"]["activations"])):
        assert at("adapter_load_seconds_count", stage=stage) == loads >= 1
        assert at("adapter_load_seconds_bucket", stage=stage, le="+Inf") == loads
        assert at("adapter_load_seconds_sum", stage=stage) >= 0
    # engine-wide: no adapter id is a label value of any sample (label sets stay bounded whatever is served)
    assert not [k for k in v if ref.adapter_id in dict(k[1]).values()]


def test_stats_and_metrics_are_503_while_loading_then_null_stats():
    from loraplex.engine.server.app import ServiceHolder, create_app
    from loraplex.engine.server.serve import null_service, start_loading
    from loraplex.engine.stats import empty_stats

    holder, release = ServiceHolder(), threading.Event()
    server = ThreadServer(create_app(holder))
    try:
        start_loading(holder, lambda: (release.wait(10), null_service())[1])
        for path in ("/v1/stats", "/metrics"):
            r = httpx.get(f"{server.url}{path}", timeout=10)
            assert r.status_code == 503 and r.json()["error"]["message"] == "the model is still loading"
        release.set()
        for _ in range(200):
            if holder.service is not None:
                break
            time.sleep(0.02)
        assert _stats(server.url) == empty_stats()
        v = _scrape(server.url)
        assert v[("loraplex_engine_server_info", frozenset({("model", "null")}))] == 1
        assert v[("loraplex_engine_server_kv_blocks_total", frozenset())] == 0
        assert ("loraplex_engine_server_prefix_cache_hit_rate", frozenset()) not in v   # no lookups yet: absent
    finally:
        release.set()
        server.stop()
