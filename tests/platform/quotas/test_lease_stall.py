"""Concurrency leases survive a Redis stall, on a Redis of the test's own (``CLIENT PAUSE <ms> WRITE`` would stall
every other user of a shared one):

- store level: releases that time out during the stall land after it (retried in the background), tokens are
  refunded once however often FINISH runs; an acquire that timed out but landed later, and the leases of a process
  that died (heartbeat key expired), are swept;
- the real app (PostgreSQL registry, the gateway, the null engine streaming): 24 streams of a tenant with
  max_concurrency end while Redis is paused 6 s; 0 leases are left well within 30 s (the TTL is 300 s), and the
  tenant gets its full concurrency back.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest

from loraplex.platform.quotas import QuotaLimits, RedisQuotaStore
from loraplex.platform.quotas.redis_store import _FINISH
from tests.utils.faults import RedisProcess


@pytest.fixture(scope="module")
def own_redis():
    r = RedisProcess()
    yield r
    r.kill()


def pause(redis_url: str, ms: int) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.execute_command("CLIENT", "PAUSE", str(ms), "WRITE")
    client.close()


def leases(redis_url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return sum(client.zcard(k) for k in client.scan_iter(match=f"{prefix}:*:leases"))
    finally:
        client.close()


def test_releases_during_a_stall_land_after_it_and_refund_once(own_redis):
    prefix = f"lease-{uuid.uuid4().hex[:8]}"
    limits = QuotaLimits(max_concurrency=8, tokens_per_day=10_000)    # the day's counter: exact, no refill

    async def main():
        store = RedisQuotaStore.from_url(own_redis.url, key_prefix=prefix, timeout_s=0.3, reap_interval_s=60)
        try:
            decisions = [await store.acquire("t1", limits, tokens=500, request_id=f"r{i}") for i in range(4)]
            assert all(d.allowed for d in decisions) and leases(own_redis.url, prefix) == 4
            assert all(d.lease_id.startswith(store.instance_id + "|r") for d in decisions)
            await asyncio.to_thread(pause, own_redis.url, 3000)
            t0 = time.monotonic()
            await asyncio.gather(*(store.finish(d, used_tokens=100) for d in decisions))   # each times out
            assert time.monotonic() - t0 < 2 and leases(own_redis.url, prefix) == 4        # (reads still work)
            assert all(d.released for d in decisions)
            while leases(own_redis.url, prefix) and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.1)
            assert leases(own_redis.url, prefix) == 0, "released after the stall"
            day_key = f"{prefix}:{{t1}}:day:{decisions[0].budget_day}"
            assert int(await store.client.get(day_key)) == 4 * 100     # 4 x 400 unused tokens refunded once
            for d in decisions:                               # releasing again is harmless
                await store.finish(d, used_tokens=0)
                await store.release(d)
            again = await _FINISH(store.client, [f"{prefix}:{{t1}}:tpm", f"{prefix}:{{t1}}:leases", day_key],
                                  [0, 400, decisions[0].lease_id, 0])
            assert again == 0 and int(await store.client.get(day_key)) == 400   # a repeated FINISH: no-op
        finally:
            await store.close()
    asyncio.run(main())


def test_stray_and_dead_instance_leases_are_swept(own_redis):
    prefix = f"lease-{uuid.uuid4().hex[:8]}"
    limits = QuotaLimits(max_concurrency=5)

    async def main():
        dead = RedisQuotaStore.from_url(own_redis.url, key_prefix=prefix, timeout_s=1, instance_ttl_s=1.0,
                                        reap_interval_s=60)
        alive = RedisQuotaStore.from_url(own_redis.url, key_prefix=prefix, timeout_s=1, reap_interval_s=60)
        try:
            held = await dead.acquire("t1", limits, request_id="killed-with-its-process")
            mine = await alive.acquire("t1", limits, request_id="running")
            assert held.allowed and mine.allowed
            dead._background.cancel()                         # the process "dies": no more heartbeats
            # an acquire whose reply was lost (it timed out, then ran): a lease nobody holds
            ghost = f"{alive.instance_id}|lost-reply|0"
            await alive.client.zadd(f"{prefix}:{{t1}}:leases", {ghost: time.time() * 1e6 + 300e6})
            assert await alive.sweep() == 1                   # only the ghost: the dead one's key is still fresh
            await asyncio.sleep(1.2)
            assert await alive.sweep() == 1                   # now its heartbeat expired
            left = [m.decode() for m in await alive.client.zrange(f"{prefix}:{{t1}}:leases", 0, -1)]
            assert left == [mine.lease_id]                    # the running request keeps its lease
            await alive.finish(mine, used_tokens=0)
            assert leases(own_redis.url, prefix) == 0
        finally:
            await alive.close()
            await dead.client.aclose()
    asyncio.run(main())


def test_streams_ending_in_a_redis_stall_leak_no_lease(own_redis, pg_url, tmp_path):
    from sqlalchemy import text

    from loraplex.platform.engines.inprocess import NullEngineClient
    from loraplex.platform.main import create_app
    from loraplex.platform.routing import Replica
    from tests.platform.conftest import TABLES
    from tests.platform.gateway.conftest import LiveServer, settings_for

    prefix = f"lease-app-{uuid.uuid4().hex[:8]}"
    settings = settings_for(tmp_path, None, database_url=pg_url, redis_url=own_redis.url, quota_key_prefix=prefix,
                            quota_timeout_s=0.5, quota_lease_reap_s=1.0, quota_instance_ttl_s=5.0)
    engine = NullEngineClient(num_tokens=48, token_delay_s=0.1)        # each stream ~4.8 s
    server = LiveServer(create_app(settings, replicas=[Replica("null", engine)]))
    try:
        _, key = server.new_tenant(quotas={"max_concurrency": 32})
        body = {"model": server.gateway.model_name, "prompt": "hi", "max_tokens": 24, "stream": True}
        outcomes: list[str] = []

        def stream() -> None:
            try:
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    text_ = "".join(r.iter_text())
                outcomes.append("ok" if r.status_code == 200 and "[DONE]" in text_ else f"{r.status_code}")
            except httpx.HTTPError as e:
                outcomes.append(type(e).__name__)
        threads = [threading.Thread(target=stream) for _ in range(24)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while leases(own_redis.url, prefix) < 24 and time.monotonic() < deadline:
            time.sleep(0.02)
        # every stream holds its lease before the stall (an acquire inside it fails closed, by design)
        assert leases(own_redis.url, prefix) == 24, "the streams did not take their leases"
        pause(own_redis.url, 6000)                            # the streams end inside the stall
        t_pause = time.monotonic()
        for t in threads:
            t.join(60)
        assert outcomes.count("ok") == 24, outcomes           # every stream served (the stall hits only its end)
        while leases(own_redis.url, prefix) and time.monotonic() - t_pause < 30:
            time.sleep(0.2)
        left, waited = leases(own_redis.url, prefix), time.monotonic() - t_pause
        assert left == 0, f"{left} leases leaked 30 s after a 6 s stall"
        print(f"all leases released {waited:.1f} s after the stall began")
        # the tenant is admitted again
        r = [httpx.post(server.url + "/v1/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                        json={**body, "stream": False, "max_tokens": 1}).status_code for _ in range(3)]
        assert r == [200, 200, 200]
    finally:
        server.stop()
        with server.app.state.sessionmaker() as s:
            s.execute(text(f"TRUNCATE {TABLES} CASCADE"))
            s.commit()
