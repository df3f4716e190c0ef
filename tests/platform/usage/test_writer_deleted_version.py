"""A usage event whose adapter version was deleted while the request ran must not poison the batch (found by the
load tests: uploads and deletes while inference runs lost every later usage record to a foreign-key error)."""
from __future__ import annotations

import asyncio

from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from loraplex.platform.usage import UsageEvent, UsageWriter


def test_event_of_a_deleted_version_is_written_with_null_version(pg_url):
    engine = create_engine(pg_url)
    sessions = sessionmaker(engine)
    with sessions() as s:
        s.execute(text("INSERT INTO tenants (id, name, disabled, created_at) VALUES ('t1', 'usage-fk', false, now())"))
        s.commit()
    events = [UsageEvent(tenant_id="t1", request_id=f"r{i}", model="gone", prompt_tokens=1, completion_tokens=2,
                         adapter_name="gone", adapter_version_id="deleted-version-id" if i == 1 else None)
              for i in range(3)]

    async def scenario() -> UsageWriter:
        writer = UsageWriter(sessions, max_rows=10, interval_s=60)
        for e in events:
            writer.record(e)
        assert await writer.flush() == 3
        return writer

    writer = asyncio.run(scenario())
    assert writer.pending == 0 and writer.written == 3
    with sessions() as s:
        rows = s.execute(text("SELECT request_id, adapter_version_id, adapter_name FROM usage_records "
                              "ORDER BY request_id")).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("r0", None, "gone"), ("r1", None, "gone"), ("r2", None, "gone")]
