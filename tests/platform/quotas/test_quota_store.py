"""Both quota backends (real Redis and in-process) against the same expectations: GCRA bursts, token refunds,
leases that expire when their holder dies, the daily budget, tenant isolation."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from loraplex.platform.quotas import QuotaLimits, QuotaStoreError


async def _burst(store, tenant, limits, n, tokens=0):
    start = time.monotonic()
    decisions = await asyncio.gather(*(store.acquire(tenant, limits, tokens=tokens) for _ in range(n)))
    return decisions, time.monotonic() - start


@pytest.mark.parametrize("burst", [None, 10])
def test_120_at_once_at_60_rpm_gets_gcra_prediction(make_store, run, burst):
    limits = QuotaLimits(requests_per_minute=60, request_burst=burst)

    async def main():
        store = make_store()
        try:
            return await _burst(store, "tenant-a", limits, 120)
        finally:
            await store.close()

    decisions, elapsed = run(main())
    allowed = [d for d in decisions if d.allowed]
    # GCRA: `burst` at once from idle, then one per 60/60 = 1 s while the burst is being sent; the store sees the
    # requests within the `elapsed` s measured around them (however slow the machine), so the count is bounded by it
    at_once = burst or 60
    assert at_once <= len(allowed) <= at_once + math.floor(elapsed / 1.0) + 1, (len(allowed), at_once, elapsed)
    denied = [d for d in decisions if not d.allowed]
    assert len(denied) == 120 - len(allowed)
    for d in denied:
        assert d.status_code == 429 and d.reason == "requests"
        assert "requests per minute" in d.message
        assert 0 < d.retry_after_s <= 1.0 + 1e-6
        h = d.headers()
        assert h["retry-after"] == "1" and int(h["retry-after-ms"]) >= 1
        assert h["x-ratelimit-limit-requests"] == "60" and h["x-ratelimit-remaining-requests"] == "0"
        assert h["x-ratelimit-reset-requests"].endswith("s")
    remaining = sorted(d.remaining_requests for d in allowed)
    assert remaining[0] == 0 and remaining[-1] == (burst or 60) - 1
    assert all(d.lease_id is None for d in allowed)  # no concurrency limit: no lease


def test_headers_count_down_and_reset(make_store, run):
    limits = QuotaLimits(requests_per_minute=600, tokens_per_minute=6000)

    async def main():
        store = make_store()
        try:
            t0 = time.monotonic()
            decisions = [await store.acquire("t1", limits, tokens=100) for _ in range(3)]
            return decisions, time.monotonic() - t0
        finally:
            await store.close()

    (d1, d2, d3), took = run(main())

    def regained(interval_s: float) -> int:   # units that come back while the acquires run (0 when instant)
        return math.floor(took / interval_s + 1e-6)

    assert d1.remaining_requests == 599 and d1.remaining_tokens == 5900      # from idle: exact
    for d, requests, tokens in ((d2, 598, 5800), (d3, 597, 5700)):
        assert requests <= d.remaining_requests <= requests + regained(0.1), (d.remaining_requests, took)
        assert tokens <= d.remaining_tokens <= tokens + regained(0.01), (d.remaining_tokens, took)
    h = d3.headers()
    assert "retry-after" not in h
    assert h["x-ratelimit-limit-tokens"] == "6000"
    assert h["x-ratelimit-remaining-tokens"] == str(d3.remaining_tokens)
    # 3 requests at 0.1 s each and 300 tokens at 0.01 s each until full again, less the time the three acquires
    # took (measured around them: the bound holds on a slow machine too); a reset is never below one interval
    eps = 1e-3
    assert max(0.1, 0.3 - took) - eps <= d3.reset_requests_s <= 0.3 + eps, (d3.reset_requests_s, took)
    assert 3.0 - took - eps <= d3.reset_tokens_s <= 3.0 + eps, (d3.reset_tokens_s, took)
    assert h["x-ratelimit-reset-requests"].endswith("ms") and h["x-ratelimit-reset-tokens"].endswith("s")


def test_tokens_reserve_prompt_plus_max_tokens_and_refund_unused(make_store, run):
    limits = QuotaLimits(tokens_per_minute=1000)

    async def main():
        store = make_store()
        try:
            t0 = time.monotonic()
            first = await store.acquire("t1", limits, tokens=600)
            second = await store.acquire("t1", limits, tokens=600)
            await store.finish(first, used_tokens=100)      # 500 unused come back
            third = await store.acquire("t1", limits, tokens=600)
            took = time.monotonic() - t0
            await store.finish(first, used_tokens=0)        # finishing twice gives nothing more back
            fourth = await store.acquire("t1", limits, tokens=400)
            return first, second, third, fourth, took
        finally:
            await store.close()

    first, second, third, fourth, took = run(main())
    assert first.allowed and first.reserved_tokens == 600 and first.remaining_tokens == 400
    assert not second.allowed and second.status_code == 429 and second.reason == "tokens"
    assert "tokens per minute" in second.message
    assert 11.0 < second.retry_after_s <= 12.0  # 200 tokens short, 0.06 s each
    assert second.headers()["retry-after"] == "12"
    assert first.refunded_tokens == 500 and first.released
    # 300 left, plus one token per 0.06 s that passed meanwhile (measured around the calls)
    assert third.allowed and 299 <= third.remaining_tokens <= 300 + math.floor(took / 0.06 + 1e-6)
    assert not fourth.allowed and fourth.reason == "tokens"


def test_request_larger_than_token_burst_is_refused_for_good(make_store, run):
    async def main():
        store = make_store()
        try:
            return await store.acquire("t1", QuotaLimits(tokens_per_minute=1000), tokens=1001)
        finally:
            await store.close()

    d = run(main())
    assert not d.allowed and d.status_code == 400 and d.reason == "request_too_large"
    assert "lower max_tokens" in d.message
    assert d.retry_after_s is None and "retry-after" not in d.headers()


def test_concurrency_lease_release_and_expiry_after_holder_dies(make_store, run):
    # renewals 0.3 s apart against a 1.5 s TTL: a stall of up to 1.2 s between two of them is tolerated
    limits = QuotaLimits(max_concurrency=2, lease_ttl_s=1.5)

    async def main():
        store = make_store()
        try:
            a = await store.acquire("t1", limits)
            b = await store.acquire("t1", limits)
            full = await store.acquire("t1", limits)
            await store.release(a)
            c = await store.acquire("t1", limits)              # a's slot
            # b and c "die": nobody releases them; c is kept alive by renewals, b is not
            for _ in range(6):                                  # 1.8 s: past b's TTL
                await asyncio.sleep(0.3)
                assert await store.renew(c)
            d = await store.acquire("t1", limits)              # b expired and was swept
            still_full = await store.acquire("t1", limits)     # c (renewed) and d hold both slots
            await asyncio.sleep(1.8)                            # past d's TTL
            renewed_late = await store.renew(d)
            return a, b, full, c, d, still_full, renewed_late
        finally:
            await store.close()

    a, b, full, c, d, still_full, renewed_late = run(main())
    assert a.allowed and b.allowed and a.lease_id and a.lease_id != b.lease_id
    assert not full.allowed and full.status_code == 429 and full.reason == "concurrency"
    assert "concurrent" in full.message and 0 < full.retry_after_s <= 1.0
    assert c.allowed and d.allowed
    assert not still_full.allowed and still_full.reason == "concurrency"
    assert renewed_late is False


def test_daily_budget(make_store, run):
    limits = QuotaLimits(tokens_per_day=1000)

    async def main():
        store = make_store()
        try:
            first = await store.acquire("t1", limits, tokens=600)
            over = await store.acquire("t1", limits, tokens=600)
            await store.finish(first, used_tokens=300)
            after_refund = await store.acquire("t1", limits, tokens=600)
            return first, over, after_refund
        finally:
            await store.close()

    first, over, after_refund = run(main())
    assert first.allowed and first.budget_day == int(time.time() // 86400)
    assert not over.allowed and over.status_code == 429 and over.reason == "daily_tokens"
    assert "00:00 UTC" in over.message and 0 < over.retry_after_s <= 86400
    assert after_refund.allowed


def test_a_denial_takes_nothing(make_store, run):
    """All or nothing: a request denied by tokens/min does not spend a request or a lease."""
    limits = QuotaLimits(requests_per_minute=2, request_burst=2, tokens_per_minute=100, max_concurrency=1)

    async def main():
        store = make_store()
        try:
            big = await store.acquire("t1", limits, tokens=90)
            await store.release(big)
            denied = await store.acquire("t1", limits, tokens=90)  # tokens short
            ok = await store.acquire("t1", limits, tokens=5)
            return big, denied, ok
        finally:
            await store.close()

    big, denied, ok = run(main())
    assert big.allowed and not denied.allowed and denied.reason == "tokens"
    assert ok.allowed and ok.remaining_requests == 0


def test_another_tenant_is_unaffected(make_store, run):
    limits = QuotaLimits(requests_per_minute=60, request_burst=5, max_concurrency=5)

    async def main():
        store = make_store()
        try:
            a, _ = await _burst(store, "tenant-a", limits, 20)
            b, _ = await _burst(store, "tenant-b", limits, 5)
            return a, b
        finally:
            await store.close()

    a, b = run(main())
    assert sum(d.allowed for d in a) in (5, 6)
    assert all(d.allowed for d in b) and b[-1].remaining_requests >= 0


def test_bad_arguments_name_the_problem(make_store, run):
    async def main():
        store = make_store()
        try:
            with pytest.raises(QuotaStoreError, match="tenant_id must be"):
                await store.acquire("a:b", QuotaLimits())
            with pytest.raises(QuotaStoreError, match="tokens must be an integer >= 0"):
                await store.acquire("t1", QuotaLimits(), tokens=-1)
        finally:
            await store.close()

    run(main())


def test_finish_charges_tokens_used_past_the_reservation(make_store, run):
    """A request that used more than it reserved (no max_tokens: the default reservation) pays the rest at finish,
    on tokens/minute and the day's budget; a second finish charges nothing more."""
    limits = QuotaLimits(tokens_per_minute=1000, tokens_per_day=10_000, max_concurrency=2)

    async def scenario():
        store = make_store()
        try:
            first = await store.acquire("t-charge", limits, tokens=10)
            assert first.allowed and first.remaining_tokens == 990
            await store.finish(first, used_tokens=300)
            await store.finish(first, used_tokens=300)              # idempotent: charged once
            probe = await store.acquire("t-charge", limits, tokens=1)
            await store.finish(probe, used_tokens=1)
            return probe
        finally:
            await store.close()
    probe = run(scenario())
    assert 698 <= probe.remaining_tokens <= 700, probe.remaining_tokens
