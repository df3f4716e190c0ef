"""Quota fixtures: the REAL Redis at 127.0.0.1:6379 (missing Redis is an error, never a skip), a unique key prefix
per test (deleted afterwards), and ``store`` parametrized over the Redis and in-process backends."""
from __future__ import annotations

import asyncio
import os
import uuid

import pytest

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.exceptions.ConnectionError as e:
        pytest.fail(f"Redis is required at {REDIS_URL} for the quota tests (start redis-server or set "
                    f"LORAPLEX_TEST_REDIS): {e}")
    return REDIS_URL


@pytest.fixture
def key_prefix(redis_url):
    import redis

    prefix = f"loraplex-test:{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def run():
    """Run a coroutine on a fresh event loop (each test owns its loop and its Redis connections)."""
    return asyncio.run


@pytest.fixture(params=["redis", "memory"])
def make_store(request, redis_url, key_prefix):
    """``make_store(**kw)`` → a new store of the parametrized backend; tests close it themselves."""
    from loraplex.platform.quotas import InMemoryQuotaStore, RedisQuotaStore

    def make(**kw):
        if request.param == "redis":
            # A generous timeout: on a loaded 2-core CI machine 120 concurrent checks can queue past the 0.5 s
            # production default and fail closed, which is not what these tests measure.
            kw.setdefault("timeout_s", 5.0)
            return RedisQuotaStore.from_url(redis_url, key_prefix=key_prefix, **kw)
        return InMemoryQuotaStore(**kw)

    make.backend = request.param
    return make
