"""Tenant authentication for the inference path, with a short-lived cache.

Every inference request needs its tenant and quotas; looking the key up costs an HMAC, a query and (once a
minute) a ``last_used_at`` write. ``TenantAuth`` keeps what a key resolved to for ``ttl_s`` seconds (default 1 s),
keyed by the key's HMAC, never the key itself. The admin routes that revoke a key, disable a tenant or change its
quotas call ``forget_cached_keys(app)``, so this process applies them at once; other gateway processes apply them
when their entry expires (within ``ttl_s``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.core.security import hash_api_key


@dataclass(frozen=True)
class TenantInfo:
    """What the gateway needs of a tenant (plain data; ``QuotaLimits.resolve`` reads the quota fields)."""

    id: str
    name: str
    disabled: bool
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrency: int | None
    tokens_per_day: int | None
    scheduling_weight: float | None = None  # None: the deployment default


class TenantAuth:
    """``lookup(key)`` → ``TenantInfo`` or None (unknown or revoked key). Blocking: call it in a worker thread."""

    def __init__(self, sessions: sessionmaker[Session], *, secret: str, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions, self._secret, self._ttl_s, self._clock = sessions, secret, ttl_s, clock
        self._cache: dict[str, tuple[float, TenantInfo | None]] = {}

    def cached(self, key: str) -> tuple[bool, TenantInfo | None]:
        """(hit, tenant) without touching the database."""
        if self._ttl_s <= 0:
            return False, None
        entry = self._cache.get(hash_api_key(key, self._secret))
        if entry is None or entry[0] < self._clock():
            return False, None
        return True, entry[1]

    def lookup(self, key: str) -> TenantInfo | None:
        from loraplex.platform.api.deps import touch_key
        from loraplex.platform.crud.tenants import authenticate_key

        with self._sessions() as session:
            row = authenticate_key(session=session, key=key, secret=self._secret)
            info = None
            if row is not None:
                t = row.tenant
                info = TenantInfo(id=t.id, name=t.name, disabled=t.disabled,
                                  requests_per_minute=t.requests_per_minute, tokens_per_minute=t.tokens_per_minute,
                                  max_concurrency=t.max_concurrency, tokens_per_day=t.tokens_per_day,
                                  scheduling_weight=t.scheduling_weight)
                touch_key(session, row)
        if self._ttl_s > 0:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[hash_api_key(key, self._secret)] = (self._clock() + self._ttl_s, info)
        return info

    def invalidate(self) -> None:
        self._cache.clear()


def forget_cached_keys(app) -> None:
    """Drops the app's cached key → tenant lookups (after a revocation, a disable or a quota change)."""
    gateway = getattr(app.state, "gateway", None)
    if gateway is not None:
        gateway.auth.invalidate()
