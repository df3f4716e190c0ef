"""The engine clients' ``stats()``: a separate engine's ``GET /v1/stats`` over the HTTP client's pool (here the
engine server's own app, over an ASGI transport, on the tiny llama speculating with n-gram drafts) and the
in-process client's service; ``client_source`` polls it, and the dashboard's speculative view reads what it
returned."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from loraplex.platform.engines.errors import EngineUnavailableError
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.engines.messages import EngineRequest
from loraplex.platform.metrics import client_source


def test_http_stats_of_a_speculating_engine_reach_the_dashboard(tiny_base, tmp_path):
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.server.app import ServiceHolder, create_app
    from loraplex.engine.server.service import EngineService
    from loraplex.platform.dashboard.data import dashboard_data
    from loraplex.platform.metrics import EngineStatsPoller, PlatformMetrics

    engine = AsyncEngine.from_pretrained(tiny_base, device="cpu", dtype="float32", num_kv_blocks=64, progress=False,
                                         speculative={"method": "ngram", "num_speculative_tokens": 2})
    holder = ServiceHolder(service=EngineService(engine, model_name="tiny"))
    client = HttpEngineClient("http://engine-0", transport=httpx.ASGITransport(app=create_app(holder)))

    async def run() -> tuple[dict, dict]:
        try:
            request = EngineRequest(request_id="r1", tenant_id="t1", prompt=list(range(3, 200)),
                                    sampling={"max_tokens": 16, "temperature": 0, "ignore_eos": True})
            chunks = [c async for c in client.generate(request)]
            assert chunks[-1].finished
            stats = await client.stats()
            metrics = PlatformMetrics()
            poller = EngineStatsPoller(metrics, {"engine-0": client_source(client)})
            await poller.poll_once()
            return stats, dashboard_data(metrics)
        finally:
            await client.close()
            await holder.service.close()

    stats, data = asyncio.run(run())
    spec = stats["speculative"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 2 and spec["proposed"] > 0
    view = data["speculative"]
    assert view["replicas"] == [{"replica": "engine-0", "method": "ngram", "num_speculative_tokens": 2}]
    assert view["proposed"] == spec["proposed"] and view["acceptance_length"] == pytest.approx(
        spec["acceptance_length"])
    assert [a["adapter_id"] for a in view["adapters"]] == [None]          # the base model's row


def test_http_stats_of_an_engine_that_is_down_or_loading():
    def loading(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/stats"
        return httpx.Response(503, json={"error": {"message": "loading", "type": "engine_unavailable"}})

    async def run(transport) -> None:
        client = HttpEngineClient("http://engine-0", transport=transport)
        try:
            await client.stats()
        finally:
            await client.close()

    with pytest.raises(EngineUnavailableError):
        asyncio.run(run(httpx.MockTransport(loading)))

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    with pytest.raises(EngineUnavailableError, match="unreachable"):
        asyncio.run(run(httpx.MockTransport(refused)))


def test_in_process_stats_and_the_poller_source():
    client = NullEngineClient()
    assert client_source(client) == client.stats
    stats = asyncio.run(client.stats())
    assert stats["speculative"] is None and stats["requests_running"] == 0
