"""GCRA arithmetic with a controlled clock, the limits' validation, and the header formats."""
from __future__ import annotations

import asyncio

import pytest

from loraplex.platform.quotas import InMemoryQuotaStore, QuotaLimits, format_reset
from loraplex.platform.quotas.gcra import gcra_check, gcra_refund


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_exact_gcra_schedule_with_a_controlled_clock():
    clock = Clock()
    store = InMemoryQuotaStore(clock=clock)
    limits = QuotaLimits(requests_per_minute=60, request_burst=10)

    async def main():
        first = [await store.acquire("t", limits) for _ in range(120)]
        clock.t += 1.0
        one_more = [await store.acquire("t", limits) for _ in range(3)]
        clock.t += 5.5
        five_more = [await store.acquire("t", limits) for _ in range(10)]
        return first, one_more, five_more

    first, one_more, five_more = asyncio.run(main())
    assert sum(d.allowed for d in first) == 10 and all(d.allowed for d in first[:10])
    assert first[10].retry_after_s == pytest.approx(1.0)
    assert [d.allowed for d in one_more] == [True, False, False]
    assert sum(d.allowed for d in five_more) == 5
    assert five_more[5].retry_after_s == pytest.approx(0.5)


def test_gcra_refund_never_banks_credit():
    r = gcra_check(None, 100.0, 30, 1.0, 50)
    assert r.allowed and r.new_tat == 130.0 and r.remaining == 20
    assert gcra_refund(r.new_tat, 100.0, 10, 1.0) == 120.0
    assert gcra_refund(r.new_tat, 100.0, 1000, 1.0) == 100.0
    denied = gcra_check(130.0, 100.0, 25, 1.0, 50)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(5.0) and denied.remaining == 20


def test_limits_validation_and_resolution():
    with pytest.raises(ValueError, match="requests_per_minute must be a positive number"):
        QuotaLimits(requests_per_minute=0)
    with pytest.raises(ValueError, match="request_burst needs requests_per_minute"):
        QuotaLimits(request_burst=5)
    with pytest.raises(ValueError, match="tokens_per_day must be an integer"):
        QuotaLimits(tokens_per_day=1.5)

    class Tenant:
        requests_per_minute, tokens_per_minute, max_concurrency, tokens_per_day = 10, None, None, None

    class Defaults:
        default_requests_per_minute, default_tokens_per_minute = 99, 5000
        default_max_concurrency, default_tokens_per_day = 4, None

    limits = QuotaLimits.resolve(Tenant(), Defaults())
    assert (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrency,
            limits.tokens_per_day) == (10, 5000, 4, None)
    assert QuotaLimits().unlimited and not limits.unlimited


def test_reset_format_is_openais():
    assert format_reset(0.02) == "20ms"
    assert format_reset(1.0) == "1s"
    assert format_reset(1.5) == "1.5s"
    assert format_reset(360.0) == "6m0s"
    assert format_reset(3723.0) == "1h2m3s"
