"""RedisQuotaStore: the quota checks as Lua scripts in Redis (redis-py asyncio), one round trip per call.

Keys share the hash tag ``{tenant}`` (one cluster slot per tenant)::

    <prefix>:{<tenant>}:rpm      GCRA tat of requests/min (µs, expires when the bucket is full)
    <prefix>:{<tenant>}:tpm      GCRA tat of tokens/min
    <prefix>:{<tenant>}:leases   zset lease id -> expiry (µs); expired ones are swept by the next check
    <prefix>:{<tenant>}:day:<n>  tokens reserved on UTC day n (epoch days), kept two days

Time is Redis' own clock (``TIME`` inside the script), so gateways with skewed clocks agree.
Unreachable Redis (connection refused, timeout) is decided by ``fail_open``: admit unchecked, or deny with 503.
"""
from __future__ import annotations

import hashlib
import logging
import uuid

from loraplex.platform.quotas import lua_scripts
from loraplex.platform.quotas.base import build_decision, check_acquire_args, unavailable_decision
from loraplex.platform.quotas.decision import QuotaDecision
from loraplex.platform.quotas.limits import QuotaLimits

logger = logging.getLogger(__name__)

US = 1_000_000


class _Script:
    """A Lua script run by EVALSHA, falling back to EVAL (which also caches it) when Redis lacks it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, client, keys: list[str], args: list) -> object:
        from redis.exceptions import NoScriptError

        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)


_ACQUIRE = _Script(lua_scripts.ACQUIRE)
_FINISH = _Script(lua_scripts.FINISH)


def _outage_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return (RedisConnectionError, RedisTimeoutError, OSError)


class RedisQuotaStore:
    """Quotas shared by every gateway process through one Redis. See ``QuotaStore`` for the methods."""

    def __init__(self, client, *, key_prefix: str = "loraplex:quota", fail_open: bool = False) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix must be non-empty and brace-free, got {key_prefix!r}")
        self.client = client
        self.key_prefix = key_prefix
        self.fail_open = fail_open
        self._outage = _outage_errors()

    @classmethod
    def from_url(cls, url: str, *, key_prefix: str = "loraplex:quota", fail_open: bool = False,
                 timeout_s: float = 0.5, max_connections: int = 64) -> "RedisQuotaStore":
        """A store over a new connection pool; ``timeout_s`` bounds connect and each command (an outage is
        decided within it)."""
        from redis.asyncio import BlockingConnectionPool, Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        # A blocking pool: a burst beyond max_connections waits for a connection instead of failing. One immediate
        # retry on a connection error: after a Redis restart every pooled connection is dead and fails once, which
        # without the retry refuses requests (503) while Redis is already back; a Redis that is really down still
        # fails within the connect timeout.
        pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=max(5.0, timeout_s),
                                               socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                               retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
        return cls(Redis(connection_pool=pool), key_prefix=key_prefix, fail_open=fail_open)

    def _keys(self, tenant_id: str) -> list[str]:
        base = f"{self.key_prefix}:{{{tenant_id}}}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:leases", f"{base}:day"]

    async def acquire(self, tenant_id: str, limits: QuotaLimits, *, tokens: int = 0) -> QuotaDecision:
        check_acquire_args(tenant_id, limits, tokens)
        if limits.unlimited:  # nothing to count: no round trip
            return build_decision(tenant_id, limits, reason_code=0, retry_after_s=0.0, req_remaining=-1,
                                  req_reset_s=0.0, tok_remaining=-1, tok_reset_s=0.0, lease_id=None, tokens=tokens,
                                  budget_day=None)
        lease_id = uuid.uuid4().hex if limits.max_concurrency else None
        args = [limits.request_interval_s * US if limits.requests_per_minute else 0,
                limits.effective_request_burst or 0,
                limits.token_interval_s * US if limits.tokens_per_minute else 0,
                limits.effective_token_burst or 0, tokens,
                limits.max_concurrency or 0, lease_id or "", int(limits.lease_ttl_s * US),
                limits.tokens_per_day or 0]
        try:
            raw = await _ACQUIRE(self.client, self._keys(tenant_id), args)
        except self._outage as e:
            logger.warning("quota store unreachable (%s); failing %s for tenant %s", type(e).__name__,
                           "open" if self.fail_open else "closed", tenant_id)
            return unavailable_decision(tenant_id, limits, fail_open=self.fail_open, tokens=tokens)
        reason, retry_us, req_rem, req_reset_us, tok_rem, tok_reset_us, day = (int(x) for x in raw)
        return build_decision(tenant_id, limits, reason_code=reason, retry_after_s=retry_us / US,
                              req_remaining=req_rem, req_reset_s=req_reset_us / US, tok_remaining=tok_rem,
                              tok_reset_s=tok_reset_us / US, lease_id=lease_id, tokens=tokens,
                              budget_day=day if limits.tokens_per_day else None)

    async def _finish(self, decision: QuotaDecision, refund: int, lease_id: str | None, renew_ttl_s: float) -> int:
        if not decision.allowed or decision.degraded or decision.limits is None:
            return 0
        limits = decision.limits
        if decision.released:
            refund, lease_id = 0, None
        refund = max(0, min(refund, decision.reserved_tokens - decision.refunded_tokens))
        if refund == 0 and lease_id is None:
            return 0
        decision.refunded_tokens += refund
        if lease_id is not None and renew_ttl_s == 0:
            decision.released = True
        keys = self._keys(decision.tenant_id)
        day_key = f"{keys[3]}:{decision.budget_day}" if decision.budget_day is not None else ""
        args = [limits.token_interval_s * US if limits.tokens_per_minute else 0, refund, lease_id or "",
                int(renew_ttl_s * US)]
        try:
            return int(await _FINISH(self.client, [keys[1], keys[2], day_key], args))
        except self._outage as e:  # the lease expires on its own; tokens refill with time
            logger.warning("quota store unreachable on finish (%s) for tenant %s", type(e).__name__,
                           decision.tenant_id)
            return 0

    async def finish(self, decision: QuotaDecision, *, used_tokens: int) -> None:
        if decision.released:
            return
        unused = decision.reserved_tokens - decision.refunded_tokens - max(0, used_tokens)
        await self._finish(decision, unused, decision.lease_id, 0)
        decision.released = True

    async def refund(self, decision: QuotaDecision, tokens: int) -> None:
        await self._finish(decision, tokens, None, 0)

    async def release(self, decision: QuotaDecision) -> None:
        if decision.lease_id is not None:
            await self._finish(decision, 0, decision.lease_id, 0)

    async def renew(self, decision: QuotaDecision) -> bool:
        if decision.lease_id is None or decision.limits is None:
            return False
        return bool(await self._finish(decision, 0, decision.lease_id, decision.limits.lease_ttl_s))

    async def close(self) -> None:
        await self.client.aclose()
