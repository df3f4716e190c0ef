"""QuotaDecision: what one quota check answered, and the HTTP headers it implies (OpenAI's names)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from loraplex.platform.quotas.limits import QuotaLimits

DenyReason = Literal["requests", "tokens", "concurrency", "daily_tokens", "request_too_large", "store_unavailable"]

_MESSAGES = {
    "requests": "rate limit reached for requests per minute",
    "tokens": "rate limit reached for tokens per minute (prompt + max_tokens are reserved up front)",
    "concurrency": "too many concurrent requests for this tenant",
    "daily_tokens": "daily token budget exhausted; it resets at 00:00 UTC",
    "request_too_large": "prompt + max_tokens exceed the tenant's tokens-per-minute burst; lower max_tokens or "
                         "shorten the prompt",
    "store_unavailable": "the quota store is unavailable; retry shortly",
}


def format_reset(seconds: float) -> str:
    """OpenAI's reset format: ``"20ms"``, ``"1.5s"``, ``"6m0s"``, ``"1h2m3s"``."""
    seconds = max(0.0, seconds)
    if seconds < 1.0:
        return f"{int(math.ceil(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600.0)
    minutes, secs = divmod(rest, 60.0)
    s = f"{secs:.3f}".rstrip("0").rstrip(".")
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{s}s"
    if minutes >= 1:
        return f"{int(minutes)}m{s}s"
    return f"{s}s"


@dataclass
class QuotaDecision:
    """The answer of ``QuotaStore.acquire``. Keep it: ``QuotaStore.finish(decision, used_tokens)`` refunds the
    unused reservation and releases the lease (idempotent: a second ``finish`` does nothing).

    ``status_code`` is 200 when allowed, else 429 (a limit), 400 (``request_too_large``: can never pass) or 503
    (store unreachable and fail-closed). ``*_remaining``/``*_reset_s`` are after this request's reservation;
    None where that limit is off. ``degraded`` marks an admission without checks (store down, fail-open).
    """

    allowed: bool
    tenant_id: str
    reason: DenyReason | None = None
    status_code: int = 200
    retry_after_s: float | None = None
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    lease_id: str | None = None
    reserved_tokens: int = 0
    limits: QuotaLimits | None = None
    budget_day: int | None = None      # UTC day number (epoch days) the daily reservation was counted on
    degraded: bool = False
    refunded_tokens: int = 0           # given back so far (refund/finish never give back more than reserved)
    released: bool = False             # finish (or release) ran: the lease is gone, finishing again is a no-op

    @property
    def message(self) -> str:
        """A client-facing sentence for a denial ("" when allowed); never names internals."""
        if self.allowed or self.reason is None:
            return ""
        text = _MESSAGES[self.reason]
        if self.retry_after_s is not None and self.reason != "request_too_large":
            text += f"; retry after {self.retry_after_s:.2f} s"
        return text

    def headers(self) -> dict[str, str]:
        """``Retry-After``/``retry-after-ms`` on a retryable denial, and ``x-ratelimit-{limit,remaining,reset}-
        {requests,tokens}`` for every limit that is on."""
        h: dict[str, str] = {}
        if not self.allowed and self.retry_after_s is not None and self.reason != "request_too_large":
            h["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            h["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        for kind in ("requests", "tokens"):
            limit = getattr(self, f"limit_{kind}")
            if limit is None:
                continue
            h[f"x-ratelimit-limit-{kind}"] = str(limit)
            h[f"x-ratelimit-remaining-{kind}"] = str(max(0, getattr(self, f"remaining_{kind}") or 0))
            h[f"x-ratelimit-reset-{kind}"] = format_reset(getattr(self, f"reset_{kind}_s") or 0.0)
        return h
