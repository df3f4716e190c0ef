"""``loraplex engine serve --null`` as a real process: streaming, a killed process becomes
``EngineUnavailableError``, and the router fails over to a live replica."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loraplex.platform.engines.errors import EngineUnavailableError
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.engines.messages import AdapterReference, EngineRequest
from loraplex.platform.routing import Replica, Router, hrw_rank

REF = AdapterReference("t/bot/1", "s3://bucket/adapters/t/bot/x.safetensors", "a" * 64, rank=8, targets=("q_proj",))


def test_null_engine_process_streams_fixed_tokens_and_dies_loudly(engine_process):
    url, proc = engine_process("--null", "--null-tokens", "5")

    async def main():
        client = HttpEngineClient(url, connect_timeout_s=0.5)
        try:
            health = await client.health()
            chunks = [c async for c in client.generate(EngineRequest("r1", "t", [1, 2, 3], {}, REF))]
            sized = [c async for c in client.generate(EngineRequest("r2", "t", "hi", {"max_tokens": 2}))]
            residency = await client.residency()
            proc.kill()
            proc.wait(10)
            with pytest.raises(EngineUnavailableError, match="is unreachable: ConnectError"):
                [c async for c in client.generate(EngineRequest("r3", "t", [1], {}))]
            with pytest.raises(EngineUnavailableError):
                await client.health()
            return health, chunks, sized, residency
        finally:
            await client.close()

    health, chunks, sized, residency = asyncio.run(main())
    assert health.ready and health.model == "null"
    assert [c.completion_tokens for c in chunks] == [1, 2, 3, 4, 5] and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == " tok" * 5 and chunks[-1].prompt_tokens == 3
    assert len(sized) == 2
    assert residency.cpu == ["t/bot/1"]
    assert isinstance(EngineUnavailableError("x"), ConnectionError)


def test_router_fails_over_from_a_killed_replica(engine_process):
    url_a, proc_a = engine_process("--null", "--null-tokens", "3")
    url_b, proc_b = engine_process("--null", "--null-tokens", "3")
    urls = {"a": url_a, "b": url_b}
    owner = hrw_rank(REF.adapter_id, ["a", "b"])[0]
    other = "b" if owner == "a" else "a"
    (proc_a if owner == "a" else proc_b).kill()

    async def main():
        clients = {k: HttpEngineClient(u, connect_timeout_s=0.5) for k, u in urls.items()}
        router = Router([Replica(k, client=c) for k, c in clients.items()])
        served = []
        try:
            for i in range(4):
                chunks = [c async for c in router.stream(
                    REF.adapter_id,
                    lambda r, i=i: r.client.generate(EngineRequest(f"r{i}", "t", [1], {}, REF)))]
                served.append(len(chunks))
            return served, router
        finally:
            for c in clients.values():
                await c.close()

    served, router = asyncio.run(main())
    assert served == [3, 3, 3, 3]
    assert router.replicas[owner].consecutive_failures == 1
    assert not router.replicas[owner].is_up(time.monotonic())  # cooling down
    assert REF.adapter_id in router.replicas[other].resident
    assert httpx.get(f"{urls[other]}/health").json()["ready"] is True


def test_null_client_in_process():
    client = NullEngineClient(num_tokens=3)

    async def main():
        chunks = [c async for c in client.generate(EngineRequest("r", "t", [1, 2], {}))]
        stream = client.generate(EngineRequest("r2", "t", [1, 2], {"max_tokens": 100}))
        await stream.__anext__()
        await stream.aclose()
        return chunks, (await client.health()), client.service.in_flight

    chunks, health, in_flight = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [[7], [7], [7]] and chunks[-1].finished
    assert health.ready and in_flight == 0
