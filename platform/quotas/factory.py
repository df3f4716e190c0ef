"""``make_quota_store``: Redis when a URL is configured, else the in-process store (embedded default)."""
from __future__ import annotations

from loraplex.platform.quotas.memory_store import InMemoryQuotaStore
from loraplex.platform.quotas.redis_store import RedisQuotaStore


def make_quota_store(redis_url: str | None, *, fail_open: bool = False, key_prefix: str = "loraplex:quota",
                     timeout_s: float = 0.5, reap_interval_s: float = 10.0,
                     instance_ttl_s: float = 30.0) -> InMemoryQuotaStore | RedisQuotaStore:
    """``redis_url`` None → ``InMemoryQuotaStore`` (one process only); else a ``RedisQuotaStore`` that fails
    open or closed (default) when Redis cannot be reached within ``timeout_s``, sweeping leases of gone requests
    every ``reap_interval_s`` (and of processes whose heartbeat is ``instance_ttl_s`` old)."""
    if redis_url is None:
        return InMemoryQuotaStore()
    return RedisQuotaStore.from_url(redis_url, key_prefix=key_prefix, fail_open=fail_open, timeout_s=timeout_s,
                                    reap_interval_s=reap_interval_s, instance_ttl_s=instance_ttl_s)
