"""Per-tenant quotas: GCRA requests/min and tokens/min, a concurrency lease, a daily token budget.

    store = make_quota_store(settings.redis_url, fail_open=False)     # RedisQuotaStore | InMemoryQuotaStore
    decision = await store.acquire(tenant.id, QuotaLimits.resolve(tenant, settings), tokens=prompt + max_tokens)
    ...; await store.finish(decision, used_tokens=prompt + completion)
"""
from loraplex.platform.quotas.base import QuotaStore, QuotaStoreError
from loraplex.platform.quotas.decision import QuotaDecision, format_reset
from loraplex.platform.quotas.factory import make_quota_store
from loraplex.platform.quotas.limits import QuotaLimits
from loraplex.platform.quotas.memory_store import InMemoryQuotaStore
from loraplex.platform.quotas.redis_store import RedisQuotaStore

__all__ = ["QuotaStore", "QuotaStoreError", "QuotaDecision", "QuotaLimits", "InMemoryQuotaStore", "RedisQuotaStore",
           "make_quota_store", "format_reset"]
