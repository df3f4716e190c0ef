"""``tenant_id`` / ``tenant_weight`` over the engine's HTTP API (the platform's HttpEngineClient, real sockets): the
scheduler records the tenant with its weight, /v1/stats lists it, and a bad weight is a 400 naming the field."""
from __future__ import annotations

import asyncio

import httpx

from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.messages import EngineRequest
from tests.engine.server.test_engine_http import GREEDY, PROMPT, _wait_idle


def test_tenant_weight_over_http(engine_server):
    service, server = engine_server

    async def run():
        http = HttpEngineClient(server.url)
        try:
            request = EngineRequest("r-weight", "tenant-w", PROMPT, GREEDY, tenant_weight=3.0)
            return [c async for c in http.generate(request)]
        finally:
            await http.close()

    chunks = asyncio.run(run())
    assert chunks[-1].finished and chunks[-1].completion_tokens == GREEDY["max_tokens"]
    assert _wait_idle(service) == 0
    state = service.engine.engine.scheduler.counters.get("tenant-w")
    assert state.weight == 3.0
    assert (state.input_tokens, state.output_tokens) == (len(PROMPT), GREEDY["max_tokens"])
    stats = httpx.get(f"{server.url}/v1/stats", timeout=10).json()
    assert stats["scheduling_policy"] == "vtc" and stats["tenants_active"] == 0
    for bad in (0, -2, "heavy", 1e9):
        raw = httpx.post(f"{server.url}/v1/generate", json={"request_id": "bad-w", "prompt": PROMPT,
                                                            "tenant_id": "t", "tenant_weight": bad})
        assert raw.status_code == 400 and "'tenant_weight' must be" in raw.json()["error"]["message"]
