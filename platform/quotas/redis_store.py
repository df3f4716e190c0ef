"""RedisQuotaStore: the quota checks as Lua scripts in Redis (redis-py asyncio), one round trip per call.

Keys share the hash tag ``{tenant}`` (one cluster slot per tenant)::

    <prefix>:{<tenant>}:rpm      GCRA tat of requests/min (µs, expires when the bucket is full)
    <prefix>:{<tenant>}:tpm      GCRA tat of tokens/min
    <prefix>:{<tenant>}:leases   zset lease -> expiry (µs); expired ones are swept by the next check
    <prefix>:{<tenant>}:day:<n>  tokens reserved on UTC day n (epoch days), kept two days
    <prefix>:instance:<id>       heartbeat of one platform process (expires after ``instance_ttl_s``)

Time is Redis' own clock (``TIME`` inside the script), so gateways with skewed clocks agree.
Unreachable Redis (connection refused, timeout) is decided by ``fail_open``: admit unchecked, or deny with 503.

Leases survive a Redis stall or outage at release time. A lease is named ``<instance id>|<request id>|<random>``.

    release fails (timeout, refused)  ─▶ retried in the background with backoff until it lands or the lease's
                                         TTL has passed (FINISH is idempotent: a repeat removes nothing and refunds
                                         nothing)
    every ``reap_interval_s``          ─▶ this process's own leases whose request is no longer running here are
                                         removed, and so are the leases of instances whose heartbeat key expired
                                         (a process killed with its requests in flight)
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
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

    def __init__(self, client, *, key_prefix: str = "loraplex:quota", fail_open: bool = False,
                 instance_id: str | None = None, reap_interval_s: float = 10.0, instance_ttl_s: float = 30.0,
                 retry_max_delay_s: float = 1.0) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix must be non-empty and brace-free, got {key_prefix!r}")
        if reap_interval_s <= 0 or instance_ttl_s <= 0:
            raise ValueError("reap_interval_s and instance_ttl_s must be > 0")
        self.client = client
        self.key_prefix = key_prefix
        self.fail_open = fail_open
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self.reap_interval_s, self.instance_ttl_s, self.retry_max_delay_s = reap_interval_s, instance_ttl_s, \
            retry_max_delay_s
        self._outage = _outage_errors()
        self._live: dict[str, str] = {}          # lease -> tenant: requests of this process still running
        self._tenants: set[str] = set()          # tenants this process took leases of (for the own-lease sweep)
        self._retries: set[asyncio.Task] = set()
        self._background: asyncio.Task | None = None
        self._beat_at = 0.0                      # monotonic time of the last heartbeat that landed
        self.reaped = 0                          # leases released by the sweeps (own and dead instances')

    @classmethod
    def from_url(cls, url: str, *, key_prefix: str = "loraplex:quota", fail_open: bool = False,
                 timeout_s: float = 0.5, max_connections: int = 64, **kw) -> "RedisQuotaStore":
        """A store over a new connection pool; ``timeout_s`` bounds connect and each command (an outage is
        decided within it). ``kw``: the lease options of ``__init__``."""
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
        return cls(Redis(connection_pool=pool), key_prefix=key_prefix, fail_open=fail_open, **kw)

    def _keys(self, tenant_id: str) -> list[str]:
        base = f"{self.key_prefix}:{{{tenant_id}}}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:leases", f"{base}:day"]

    def _instance_key(self, instance_id: str) -> str:
        return f"{self.key_prefix}:instance:{instance_id}"

    async def _heartbeat(self) -> None:
        await self.client.set(self._instance_key(self.instance_id), str(time.time()),
                              px=int(self.instance_ttl_s * 1000))
        self._beat_at = time.monotonic()

    async def _ensure_running(self) -> None:
        """Before a lease is taken: this instance's heartbeat is fresh (so no other instance's sweep can take the
        lease for a dead one's), and the heartbeat/sweep task runs."""
        if self._background is None or self._background.done():
            self._background = asyncio.create_task(self._maintain(), name="loraplex-quota-leases")
        if time.monotonic() - self._beat_at > self.instance_ttl_s / 3:
            await self._heartbeat()

    async def acquire(self, tenant_id: str, limits: QuotaLimits, *, tokens: int = 0,
                      request_id: str | None = None) -> QuotaDecision:
        check_acquire_args(tenant_id, limits, tokens)
        if limits.unlimited:  # nothing to count: no round trip
            return build_decision(tenant_id, limits, reason_code=0, retry_after_s=0.0, req_remaining=-1,
                                  req_reset_s=0.0, tok_remaining=-1, tok_reset_s=0.0, lease_id=None, tokens=tokens,
                                  budget_day=None)
        lease_id = None
        if limits.max_concurrency:
            lease_id = f"{self.instance_id}|{(request_id or '-')[:64]}|{uuid.uuid4().hex[:8]}"
        args = [limits.request_interval_s * US if limits.requests_per_minute else 0,
                limits.effective_request_burst or 0,
                limits.token_interval_s * US if limits.tokens_per_minute else 0,
                limits.effective_token_burst or 0, tokens,
                limits.max_concurrency or 0, lease_id or "", int(limits.lease_ttl_s * US),
                limits.tokens_per_day or 0]
        try:
            if lease_id is not None:
                await self._ensure_running()
                self._live[lease_id] = tenant_id       # before the script: a sweep never takes it for a stray
                self._tenants.add(tenant_id)
            raw = await _ACQUIRE(self.client, self._keys(tenant_id), args)
        except self._outage as e:
            if lease_id is not None:
                self._live.pop(lease_id, None)          # its ZADD may have landed: the sweep removes it
            logger.warning("quota store unreachable (%s); failing %s for tenant %s", type(e).__name__,
                           "open" if self.fail_open else "closed", tenant_id)
            return unavailable_decision(tenant_id, limits, fail_open=self.fail_open, tokens=tokens)
        reason, retry_us, req_rem, req_reset_us, tok_rem, tok_reset_us, day = (int(x) for x in raw)
        if reason and lease_id is not None:
            self._live.pop(lease_id, None)
        return build_decision(tenant_id, limits, reason_code=reason, retry_after_s=retry_us / US,
                              req_remaining=req_rem, req_reset_s=req_reset_us / US, tok_remaining=tok_rem,
                              tok_reset_s=tok_reset_us / US, lease_id=lease_id, tokens=tokens,
                              budget_day=day if limits.tokens_per_day else None)

    def _finish_call(self, decision: QuotaDecision, refund: int, lease_id: str | None,
                     renew_ttl_s: float) -> tuple[list[str], list] | None:
        """The FINISH script's keys and arguments, or None when there is nothing to do. ``refund`` < 0 is a charge
        (tokens used past the reservation; only ``finish`` passes one)."""
        if not decision.allowed or decision.degraded or decision.limits is None:
            return None
        limits = decision.limits
        if decision.released:
            refund, lease_id = 0, None
        if refund >= 0:
            refund = max(0, min(refund, decision.reserved_tokens - decision.refunded_tokens))
        if refund == 0 and lease_id is None:
            return None
        decision.refunded_tokens += refund
        if lease_id is not None and renew_ttl_s == 0:
            decision.released = True
            self._live.pop(lease_id, None)
        keys = self._keys(decision.tenant_id)
        day_key = f"{keys[3]}:{decision.budget_day}" if decision.budget_day is not None else ""
        args = [limits.token_interval_s * US if limits.tokens_per_minute else 0, refund, lease_id or "",
                int(renew_ttl_s * US)]
        return [keys[1], keys[2], day_key], args

    async def _finish(self, decision: QuotaDecision, refund: int, lease_id: str | None, renew_ttl_s: float) -> int:
        call = self._finish_call(decision, refund, lease_id, renew_ttl_s)
        if call is None:
            return 0
        try:
            return int(await _FINISH(self.client, *call))
        except self._outage as e:
            if lease_id is not None and renew_ttl_s == 0:   # a release: try again until it lands
                logger.warning("quota store unreachable releasing lease %s of tenant %s (%s); retrying in the "
                               "background", lease_id, decision.tenant_id, type(e).__name__)
                deadline = time.monotonic() + (decision.limits.lease_ttl_s if decision.limits else 60.0)
                task = asyncio.create_task(self._retry_finish(call, deadline), name="loraplex-lease-release")
                self._retries.add(task)
                task.add_done_callback(self._retries.discard)
            else:   # a refund or a renewal: the tokens refill with time; renew reports the lease as lost
                logger.warning("quota store unreachable on finish (%s) for tenant %s", type(e).__name__,
                               decision.tenant_id)
            return 0

    async def _retry_finish(self, call: tuple[list[str], list], deadline: float) -> None:
        delay = 0.05
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            try:
                await _FINISH(self.client, *call)
                logger.info("lease %s released after a retry", call[1][2])
                return
            except self._outage:
                delay = min(self.retry_max_delay_s, delay * 2)
        logger.warning("lease %s not released before its TTL passed; it has expired by itself", call[1][2])

    async def finish(self, decision: QuotaDecision, *, used_tokens: int) -> None:
        if decision.released:
            return
        unused = decision.reserved_tokens - decision.refunded_tokens - max(0, used_tokens)  # < 0: charged
        await self._finish(decision, unused, decision.lease_id, 0)
        decision.released = True
        if decision.lease_id is not None:
            self._live.pop(decision.lease_id, None)

    async def refund(self, decision: QuotaDecision, tokens: int) -> None:
        await self._finish(decision, tokens, None, 0)

    async def release(self, decision: QuotaDecision) -> None:
        if decision.lease_id is not None:
            await self._finish(decision, 0, decision.lease_id, 0)

    async def renew(self, decision: QuotaDecision) -> bool:
        if decision.lease_id is None or decision.limits is None:
            return False
        return bool(await self._finish(decision, 0, decision.lease_id, decision.limits.lease_ttl_s))

    # -- heartbeat and sweeps ---------------------------------------------------------------------------------
    async def _maintain(self) -> None:
        """The heartbeat every ``instance_ttl_s / 3`` and a sweep every ``reap_interval_s`` (outages are logged
        and retried at the next tick)."""
        next_sweep = time.monotonic() + self.reap_interval_s
        while True:
            await asyncio.sleep(max(0.01, min(self.instance_ttl_s / 3, next_sweep - time.monotonic())))
            try:
                if time.monotonic() - self._beat_at >= self.instance_ttl_s / 3 - 0.01:
                    await self._heartbeat()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.reap_interval_s
                    await self.sweep()
            except self._outage as e:
                logger.warning("quota lease heartbeat/sweep: Redis unreachable (%s)", type(e).__name__)

    async def sweep(self) -> int:
        """Releases this process's leases whose request is gone and the leases of instances whose heartbeat
        expired; returns how many."""
        removed = 0
        own = f"{self.instance_id}|"
        for tenant_id in list(self._tenants):
            key = self._keys(tenant_id)[2]
            members = [m.decode() if isinstance(m, bytes) else m for m in await self.client.zrange(key, 0, -1)]
            mine = [m for m in members if m.startswith(own)]
            stray = [m for m in mine if m not in self._live]
            if stray:
                removed += int(await self.client.zrem(key, *stray))
            if len(stray) == len(mine) and tenant_id not in self._live.values():
                self._tenants.discard(tenant_id)
        alive: dict[str, bool] = {self.instance_id: True}
        async for raw_key in self.client.scan_iter(match=f"{self.key_prefix}:*:leases", count=500):
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            members = [m.decode() if isinstance(m, bytes) else m for m in await self.client.zrange(key, 0, -1)]
            dead = []
            for m in members:
                instance = m.split("|", 1)[0] if "|" in m else None
                if instance is None:
                    continue            # a lease without an owner (older gateways): its TTL ends it
                if instance not in alive:
                    alive[instance] = bool(await self.client.exists(self._instance_key(instance)))
                if not alive[instance]:
                    dead.append(m)
            if dead:
                removed += int(await self.client.zrem(key, *dead))
        if removed:
            self.reaped += removed
            logger.info("quota leases: released %d lease(s) of requests that are gone", removed)
        return removed

    async def close(self) -> None:
        """Lets pending releases land (briefly), releases the leases still held here, drops the heartbeat key (so
        other instances reap whatever is left at once), closes the connections."""
        if self._background is not None:
            self._background.cancel()
            try:
                await self._background
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        if self._retries:
            _, pending = await asyncio.wait(set(self._retries), timeout=2.0)
            for task in pending:
                task.cancel()
        try:
            for lease_id, tenant_id in list(self._live.items()):
                await self.client.zrem(self._keys(tenant_id)[2], lease_id)
            self._live.clear()
            await self.client.delete(self._instance_key(self.instance_id))
        except self._outage:
            pass
        await self.client.aclose()
