"""Usage metering: per tenant, adapter and UTC day through the API (tenant view and admin view), written in
batches, and nothing lost on a graceful stop."""
from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from sqlalchemy import text

from loraplex.platform.usage import UsageEvent, UsageWriter
from tests.platform.gateway.conftest import ADMIN_KEY, settings_for


def test_usage_per_tenant_adapter_and_day(serve, tmp_path, tiny_base, adapters):
    server = serve(settings_for(tmp_path, tiny_base, usage_flush_rows=1000, usage_flush_s=30))
    t1, k1 = server.new_tenant()
    t2, k2 = server.new_tenant()
    server.upload(k1, "bot", adapters["a"])
    base = server.gateway.model_name
    c1, c2 = server.openai(k1), server.openai(k2)
    for _ in range(3):
        c1.completions.create(model="bot", prompt=[1, 2, 3], max_tokens=4)
    c1.completions.create(model=base, prompt=[1, 2, 3, 4, 5], max_tokens=2)
    c2.completions.create(model=base, prompt=[9], max_tokens=7)
    assert server.gateway.usage.pending == 5  # buffered (the flush interval is 30 s) ...
    r = server.http.get("/v1/usage", headers={"Authorization": f"Bearer {k1}"})
    assert r.status_code == 200, r.text  # ... and a usage read flushes first
    today = datetime.now(timezone.utc).date().isoformat()
    rows = {(row["day"], row["adapter"]): row for row in r.json()["data"]}
    assert rows[(today, "bot")] == {"day": today, "adapter": "bot", "requests": 3, "prompt_tokens": 9,
                                    "completion_tokens": 12, "total_tokens": 21}
    assert rows[(today, None)]["prompt_tokens"] == 5 and rows[(today, None)]["completion_tokens"] == 2
    assert r.json()["totals"] == {"requests": 4, "prompt_tokens": 14, "completion_tokens": 14, "total_tokens": 28}
    assert server.gateway.usage.batches == 1  # five records, one INSERT

    admin = server.http.get("/admin/usage", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert {row["tenant_id"] for row in admin["data"]} == {t1, t2}
    assert admin["totals"]["requests"] == 5 and admin["totals"]["completion_tokens"] == 21
    only2 = server.http.get(f"/admin/usage?tenant_id={t2}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert only2.json()["data"][0]["completion_tokens"] == 7 and len(only2.json()["data"]) == 1
    assert server.http.get("/admin/usage", headers={"Authorization": f"Bearer {k1}"}).status_code == 401
    tomorrow = (datetime.now(timezone.utc) + timedelta(days=1)).date().isoformat()
    empty = server.http.get(f"/v1/usage?start={tomorrow}", headers={"Authorization": f"Bearer {k1}"}).json()
    assert empty["data"] == [] and empty["totals"]["requests"] == 0
    bad = server.http.get(f"/v1/usage?start={tomorrow}&end={today}", headers={"Authorization": f"Bearer {k1}"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_range"


def test_writer_batches_by_size_and_flushes_on_stop(serve, tmp_path):
    server = serve(settings_for(tmp_path, None))
    tid, _ = server.new_tenant()
    sessions = server.gateway.sessions

    def event(i: int) -> UsageEvent:
        return UsageEvent(tenant_id=tid, request_id=f"r{i}", model="m", prompt_tokens=1, completion_tokens=2)

    async def scenario() -> UsageWriter:
        writer = UsageWriter(sessions, max_rows=10, interval_s=60)
        await writer.start()
        for i in range(9):
            writer.record(event(i))
        await asyncio.sleep(0.3)        # below max_rows and before the interval: nothing written yet
        assert writer.written == 0 and writer.pending == 9
        for i in range(9, 25):
            writer.record(event(i))
        for _ in range(200):            # max_rows reached: everything queued goes, in batches of <= 10
            if writer.written == 25:    # (polled: how long 3 INSERTs take is the machine's business)
                break
            await asyncio.sleep(0.05)
        assert writer.written == 25 and writer.pending == 0 and writer.batches == 3
        for i in range(25, 29):
            writer.record(event(i))
        await writer.stop()             # graceful stop writes the rest
        return writer

    writer = asyncio.run(scenario())
    assert writer.pending == 0 and writer.written == 29 and writer.batches == 4
    with sessions() as s:
        n, completion = s.execute(text("SELECT count(*), sum(completion_tokens) FROM usage_records "
                                       "WHERE tenant_id = :t"), {"t": tid}).one()
    assert (n, completion) == (29, 58)


def test_server_shutdown_flushes_buffered_usage(serve, tmp_path, tiny_base):
    server = serve(settings_for(tmp_path, tiny_base, usage_flush_rows=1000, usage_flush_s=60))
    tid, key = server.new_tenant()
    for _ in range(3):
        server.openai(key).completions.create(model=server.gateway.model_name, prompt=[1], max_tokens=2)
    sessions = server.gateway.sessions
    assert server.gateway.usage.pending == 3
    server.stop()
    with sessions() as s:
        assert s.execute(text("SELECT count(*) FROM usage_records WHERE tenant_id = :t"), {"t": tid}).scalar() == 3
