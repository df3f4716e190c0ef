"""The QuotaStore interface shared by the Redis and in-process backends, and the decision builder both use.

    decision = await store.acquire(tenant_id, limits, tokens=prompt_tokens + max_tokens)
    if not decision.allowed:
        return error(decision.status_code, decision.message, headers=decision.headers())
    try:
        ... stream, renewing the lease with ``await store.renew(decision)`` on long streams ...
    finally:
        await store.finish(decision, used_tokens=prompt_tokens + completion_tokens)
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from loraplex.platform.quotas.decision import DenyReason, QuotaDecision
from loraplex.platform.quotas.limits import QuotaLimits

# reason codes shared with lua_scripts.py (index = code)
REASONS: tuple[DenyReason | None, ...] = (None, "requests", "tokens", "concurrency", "daily_tokens",
                                         "request_too_large")
CONCURRENCY_RETRY_S = 1.0  # hint for a concurrency denial: leases usually end within seconds
DAY_S = 86400


class QuotaStoreError(RuntimeError):
    """Bad use of a quota store (not an outage: outages become decisions per the fail-open setting)."""


@runtime_checkable
class QuotaStore(Protocol):
    """Per-tenant admission: GCRA requests/min and tokens/min, a concurrency lease, a daily token budget."""

    fail_open: bool

    async def acquire(self, tenant_id: str, limits: QuotaLimits, *, tokens: int = 0,
                      request_id: str | None = None) -> QuotaDecision:
        """Check every limit and, only if all pass, take one request, ``tokens`` tokens (tokens/min and the
        day's budget) and a concurrency lease, atomically. ``tokens`` is prompt + max_tokens; ``request_id``
        names the lease's request (so a lease whose request is gone can be told apart and released)."""

    async def finish(self, decision: QuotaDecision, *, used_tokens: int) -> None:
        """Give back ``reserved_tokens - used_tokens`` and release the lease, once (a second call does nothing).
        Never raises for an outage: a release that fails is retried in the background."""

    async def refund(self, decision: QuotaDecision, tokens: int) -> None:
        """Give back ``tokens`` of the decision's reservation (tokens/min and the day's budget)."""

    async def release(self, decision: QuotaDecision) -> None:
        """Release the decision's concurrency lease (no-op without one)."""

    async def renew(self, decision: QuotaDecision) -> bool:
        """Push the lease's expiry to now + ``lease_ttl_s``; False if it already expired (or the store is down)."""

    async def close(self) -> None:
        ...


def check_acquire_args(tenant_id: str, limits: QuotaLimits, tokens: int) -> None:
    if not isinstance(tenant_id, str) or not tenant_id or any(c in tenant_id for c in "{}: \n"):
        raise QuotaStoreError(f"tenant_id must be a non-empty id without braces, colons or spaces, got "
                              f"{tenant_id!r}")
    if not isinstance(limits, QuotaLimits):
        raise QuotaStoreError(f"limits must be QuotaLimits, got {type(limits).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise QuotaStoreError(f"tokens must be an integer >= 0 (prompt + max_tokens), got {tokens!r}")


def build_decision(tenant_id: str, limits: QuotaLimits, *, reason_code: int, retry_after_s: float,
                   req_remaining: int, req_reset_s: float, tok_remaining: int, tok_reset_s: float,
                   lease_id: str | None, tokens: int, budget_day: int | None) -> QuotaDecision:
    """One decision from the raw answer of either backend (remaining < 0 means that limit is off)."""
    reason = REASONS[reason_code]
    allowed = reason is None
    status = 200 if allowed else 400 if reason == "request_too_large" else 429
    return QuotaDecision(
        allowed=allowed, tenant_id=tenant_id, reason=reason, status_code=status,
        retry_after_s=None if allowed or reason == "request_too_large" else retry_after_s,
        limit_requests=limits.requests_per_minute,
        remaining_requests=req_remaining if limits.requests_per_minute else None,
        reset_requests_s=req_reset_s if limits.requests_per_minute else None,
        limit_tokens=limits.tokens_per_minute,
        remaining_tokens=tok_remaining if limits.tokens_per_minute else None,
        reset_tokens_s=tok_reset_s if limits.tokens_per_minute else None,
        lease_id=lease_id if allowed else None, reserved_tokens=tokens if allowed else 0, limits=limits,
        budget_day=budget_day if allowed else None)


def unavailable_decision(tenant_id: str, limits: QuotaLimits, *, fail_open: bool, tokens: int) -> QuotaDecision:
    """The store cannot be reached: admit without checks (fail open) or deny with 503 (fail closed)."""
    if fail_open:
        return QuotaDecision(allowed=True, tenant_id=tenant_id, limits=limits, degraded=True)
    return QuotaDecision(allowed=False, tenant_id=tenant_id, reason="store_unavailable", status_code=503,
                         retry_after_s=1.0, limits=limits)
