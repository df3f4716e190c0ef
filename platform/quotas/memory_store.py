"""InMemoryQuotaStore: the same checks as ``lua_scripts.py`` in this process (the embedded default).

Only correct when one process serves the tenant; several gateway processes need ``RedisQuotaStore``. Nothing can
be unreachable here, so a release always lands; releasing twice is a no-op, and the tokens of a lease are refunded
by the call that released it (as in ``FINISH``).
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from loraplex.platform.quotas.base import (CONCURRENCY_RETRY_S, DAY_S, build_decision, check_acquire_args)
from loraplex.platform.quotas.decision import QuotaDecision
from loraplex.platform.quotas.gcra import gcra_charge, gcra_check, gcra_refund
from loraplex.platform.quotas.limits import QuotaLimits


@dataclass
class _TenantState:
    req_tat: float | None = None
    tok_tat: float | None = None
    leases: dict[str, float] = field(default_factory=dict)   # lease id -> expiry
    day_used: dict[int, int] = field(default_factory=dict)   # epoch day -> tokens reserved


class InMemoryQuotaStore:
    """Quotas in a dict, behind a lock. ``clock`` (seconds, default ``time.time``) is injectable for tests."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.fail_open = False  # nothing to be unreachable
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantState] = {}

    async def acquire(self, tenant_id: str, limits: QuotaLimits, *, tokens: int = 0,
                      request_id: str | None = None) -> QuotaDecision:
        check_acquire_args(tenant_id, limits, tokens)
        with self._lock:
            return self._acquire(tenant_id, limits, tokens)

    def _acquire(self, tenant_id: str, limits: QuotaLimits, tokens: int) -> QuotaDecision:
        now = self._clock()
        st = self._tenants.setdefault(tenant_id, _TenantState())
        day = int(now // DAY_S)
        reason, retry = 0, 0.0

        def deny(code: int, wait: float) -> None:
            nonlocal reason, retry
            reason = reason or code
            retry = max(retry, wait)

        common = dict(lease_id=None, tokens=tokens, budget_day=day if limits.tokens_per_day else None)
        if limits.tokens_per_minute and tokens > limits.effective_token_burst:
            return build_decision(tenant_id, limits, reason_code=5, retry_after_s=0.0, req_remaining=-1,
                                  req_reset_s=0.0, tok_remaining=-1, tok_reset_s=0.0, **common)
        if limits.max_concurrency:
            st.leases = {k: exp for k, exp in st.leases.items() if exp > now}  # leases of dead holders
            if len(st.leases) >= limits.max_concurrency:
                deny(3, min(CONCURRENCY_RETRY_S, min(st.leases.values()) - now))
        req = tok = None
        if limits.requests_per_minute:
            req = gcra_check(st.req_tat, now, 1, limits.request_interval_s, limits.effective_request_burst)
            if not req.allowed:
                deny(1, req.retry_after_s)
        if limits.tokens_per_minute:
            tok = gcra_check(st.tok_tat, now, tokens, limits.token_interval_s, limits.effective_token_burst)
            if not tok.allowed:
                deny(2, tok.retry_after_s)
        if limits.tokens_per_day and st.day_used.get(day, 0) + tokens > limits.tokens_per_day:
            deny(4, (day + 1) * DAY_S - now)
        raw = dict(req_remaining=req.remaining if req else -1, req_reset_s=req.reset_s if req else 0.0,
                   tok_remaining=tok.remaining if tok else -1, tok_reset_s=tok.reset_s if tok else 0.0)
        if reason:
            return build_decision(tenant_id, limits, reason_code=reason, retry_after_s=retry, **raw, **common)
        if req:
            st.req_tat = req.new_tat
        if tok and tokens:
            st.tok_tat = tok.new_tat
        lease_id = None
        if limits.max_concurrency:
            lease_id = uuid.uuid4().hex
            st.leases[lease_id] = now + limits.lease_ttl_s
        if limits.tokens_per_day and tokens:
            st.day_used = {d: n for d, n in st.day_used.items() if d >= day - 1}
            st.day_used[day] = st.day_used.get(day, 0) + tokens
        common["lease_id"] = lease_id
        return build_decision(tenant_id, limits, reason_code=0, retry_after_s=0.0, **raw, **common)

    def _finish(self, decision: QuotaDecision, refund: int, release: bool, renew: bool) -> bool:
        if not decision.allowed or decision.degraded or decision.limits is None or decision.released:
            return False
        limits = decision.limits
        with self._lock:
            now = self._clock()
            st = self._tenants.setdefault(decision.tenant_id, _TenantState())
            if refund >= 0 or not release:   # a charge (< 0: tokens used past the reservation) comes with finish
                refund = max(0, min(refund, decision.reserved_tokens - decision.refunded_tokens))
            if release and decision.lease_id is not None and decision.lease_id not in st.leases:
                refund = 0          # the lease expired and was swept: as FINISH, no refund without its release
            if refund:
                decision.refunded_tokens += refund
                if limits.tokens_per_minute:
                    st.tok_tat = gcra_refund(st.tok_tat, now, refund, limits.token_interval_s) if refund > 0 \
                        else gcra_charge(st.tok_tat, now, -refund, limits.token_interval_s)
                if decision.budget_day is not None and decision.budget_day in st.day_used:
                    st.day_used[decision.budget_day] = max(0, st.day_used[decision.budget_day] - refund)
            if decision.lease_id is None:
                return False
            if renew:
                expiry = st.leases.get(decision.lease_id)
                if expiry is None or expiry <= now:
                    st.leases.pop(decision.lease_id, None)
                    return False
                st.leases[decision.lease_id] = now + limits.lease_ttl_s
                return True
            if release:
                decision.released = True
                return st.leases.pop(decision.lease_id, None) is not None
            return False

    async def finish(self, decision: QuotaDecision, *, used_tokens: int) -> None:
        if decision.released:
            return
        unused = decision.reserved_tokens - decision.refunded_tokens - max(0, used_tokens)
        self._finish(decision, unused, release=True, renew=False)
        decision.released = True

    async def refund(self, decision: QuotaDecision, tokens: int) -> None:
        self._finish(decision, tokens, release=False, renew=False)

    async def release(self, decision: QuotaDecision) -> None:
        self._finish(decision, 0, release=True, renew=False)

    async def renew(self, decision: QuotaDecision) -> bool:
        return self._finish(decision, 0, release=False, renew=True)

    async def close(self) -> None:
        return None
