"""What only the Redis backend has: an unreachable store (fail closed / open), EVALSHA falling back to EVAL, one
round trip per check, keys that clean themselves up."""
from __future__ import annotations

import asyncio

import pytest

from loraplex.platform.quotas import QuotaLimits, RedisQuotaStore, make_quota_store
from loraplex.platform.quotas.memory_store import InMemoryQuotaStore
from tests.utils.services import free_port

LIMITS = QuotaLimits(requests_per_minute=60, tokens_per_minute=1000, max_concurrency=2)


def test_unreachable_redis_fails_closed_by_default():
    async def main():
        store = make_quota_store(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3)
        try:
            d = await store.acquire("t1", LIMITS, tokens=10)
            await store.finish(d, used_tokens=0)  # must not raise
            return d
        finally:
            await store.close()

    d = asyncio.run(main())
    assert not d.allowed and d.status_code == 503 and d.reason == "store_unavailable"
    assert "quota store is unavailable" in d.message
    assert d.headers()["retry-after"] == "1"


def test_unreachable_redis_fails_open_when_configured():
    async def main():
        store = make_quota_store(f"redis://127.0.0.1:{free_port()}/0", fail_open=True, timeout_s=0.3)
        try:
            d = await store.acquire("t1", LIMITS, tokens=10)
            await store.finish(d, used_tokens=5)
            return d, await store.renew(d)
        finally:
            await store.close()

    d, renewed = asyncio.run(main())
    assert d.allowed and d.degraded and d.status_code == 200 and d.lease_id is None
    assert renewed is False


def test_evalsha_falls_back_when_scripts_are_flushed(redis_url, key_prefix):
    import redis

    async def main():
        store = RedisQuotaStore.from_url(redis_url, key_prefix=key_prefix)
        try:
            first = await store.acquire("t1", LIMITS, tokens=10)
            redis.Redis.from_url(redis_url).script_flush()
            second = await store.acquire("t1", LIMITS, tokens=10)
            await store.finish(second, used_tokens=10)
            return first, second
        finally:
            await store.close()

    first, second = asyncio.run(main())
    assert first.allowed and second.allowed and second.remaining_requests == 58


def test_one_round_trip_per_check_and_keys_expire(redis_url, key_prefix):
    import redis

    calls = []

    async def main():
        store = RedisQuotaStore.from_url(redis_url, key_prefix=key_prefix)
        real = store.client.evalsha

        async def counting(*args):
            calls.append(args[0])
            return await real(*args)

        store.client.evalsha = counting
        try:
            d = await store.acquire("t1", QuotaLimits(requests_per_minute=600, tokens_per_minute=60000,
                                                      max_concurrency=3, tokens_per_day=10**6), tokens=100)
            n_acquire = len(calls)
            await store.finish(d, used_tokens=40)
            return d, n_acquire
        finally:
            await store.close()

    d, n_acquire = asyncio.run(main())
    assert d.allowed and n_acquire == 1 and len(calls) == 2
    unlimited = asyncio.run(_acquire_unlimited(redis_url, key_prefix, calls))
    assert unlimited.allowed and unlimited.headers() == {} and len(calls) == 2  # no round trip
    client = redis.Redis.from_url(redis_url)
    keys = {k.decode() for k in client.scan_iter(match=f"{key_prefix}:*")}
    base = f"{key_prefix}:{{t1}}"
    assert keys == {f"{base}:rpm", f"{base}:tpm", f"{base}:day:{d.budget_day}"}  # the lease is gone
    assert 0 < client.pttl(f"{base}:rpm") <= 1100      # expires once the bucket is full again
    assert int(client.get(f"{base}:day:{d.budget_day}")) == 40


async def _acquire_unlimited(redis_url, key_prefix, calls):
    store = RedisQuotaStore.from_url(redis_url, key_prefix=key_prefix)
    store.client.evalsha = lambda *a: calls.append(a)
    try:
        return await store.acquire("t2", QuotaLimits(), tokens=10)
    finally:
        await store.close()


def test_factory_picks_the_backend():
    assert isinstance(make_quota_store(None), InMemoryQuotaStore)
    with pytest.raises(ValueError, match="key_prefix must be non-empty and brace-free"):
        RedisQuotaStore(object(), key_prefix="a{b}")


def test_requests_right_after_a_redis_restart_are_admitted():
    """Every pooled connection dies with the server; the first command on each must reconnect, not answer 503
    (found by the fault-mode long run: 0 of 20 admitted 0.5 s after a restart before the retry)."""
    from tests.utils.faults import RedisProcess

    redis_proc = RedisProcess()

    async def main():
        store = make_quota_store(redis_proc.url, timeout_s=0.5)
        limits = QuotaLimits(requests_per_minute=10_000, max_concurrency=100)
        try:
            warm = await asyncio.gather(*(store.acquire(f"t{i}", limits) for i in range(20)))  # fill the pool
            for d in warm:
                await store.finish(d, used_tokens=0)
            redis_proc.kill()
            redis_proc.start()  # same port, empty state
            after = await asyncio.gather(*(store.acquire(f"t{i}", limits) for i in range(20)))
            for d in after:
                await store.finish(d, used_tokens=0)
            redis_proc.kill()
            down = await store.acquire("t0", limits)  # really down: still refused
            return warm, after, down
        finally:
            await store.close()

    try:
        warm, after, down = asyncio.run(main())
    finally:
        redis_proc.kill()
    assert all(d.allowed for d in warm)
    assert [d.allowed for d in after] == [True] * 20, [d.reason for d in after if not d.allowed]
    assert not down.allowed and down.status_code == 503
