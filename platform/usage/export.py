"""Usage export for billing: one row per (UTC day, tenant, adapter) with requests and tokens, streamed as CSV or
JSON straight from the registry (rows are read in batches, never all held), ordered by day, tenant and adapter.

    GET /v1/usage/export?format=csv&from=2026-11-01&to=2026-11-30        the caller's tenant
    GET /admin/usage/export?format=json&from=...&to=...&tenant_id=...     every tenant (or one)

CSV columns (RFC 4180, a header line, UTF-8): ``day,tenant_id,tenant,adapter,requests,prompt_tokens,
completion_tokens,total_tokens``; ``adapter`` is empty for the base model. JSON:
``{"object": "list", "from": ..., "to": ..., "data": [{same fields, adapter null for the base model}, ...]}``.
"""
from __future__ import annotations

import csv
import io
import json
from datetime import date
from typing import Iterator

from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.usage.queries import usage_query

COLUMNS = ("day", "tenant_id", "tenant", "adapter", "requests", "prompt_tokens", "completion_tokens", "total_tokens")
BATCH = 1000


def usage_rows(*, session: Session, tenant_id: str | None, start: date | None, end: date | None) -> Iterator[dict]:
    """The export's rows, read ``BATCH`` at a time."""
    query = usage_query(tenant_id, start, end).execution_options(yield_per=BATCH)
    for tid, name, day, adapter, n, p, c in session.execute(query):
        p, c = int(p or 0), int(c or 0)
        yield {"day": day.isoformat() if day else None, "tenant_id": tid, "tenant": name, "adapter": adapter,
               "requests": int(n), "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _rows(sessions: sessionmaker, tenant_id: str | None, start: date | None, end: date | None) -> Iterator[dict]:
    with sessions() as session:
        yield from usage_rows(session=session, tenant_id=tenant_id, start=start, end=end)


def csv_lines(sessions: sessionmaker, *, tenant_id: str | None, start: date | None, end: date | None) -> Iterator[str]:
    """The CSV export, a header line then one line per row (a blocking iterator: run it in a worker thread)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\r\n")

    def line(values) -> str:
        buf.seek(0)
        buf.truncate()
        writer.writerow(values)
        return buf.getvalue()
    yield line(COLUMNS)
    for row in _rows(sessions, tenant_id, start, end):
        yield line(["" if row[c] is None else row[c] for c in COLUMNS])


def json_chunks(sessions: sessionmaker, *, tenant_id: str | None, start: date | None,
                end: date | None) -> Iterator[str]:
    """The JSON export, streamed (a blocking iterator: run it in a worker thread)."""
    head = {"object": "list", "from": start.isoformat() if start else None, "to": end.isoformat() if end else None}
    yield json.dumps(head)[:-1] + ', "data": ['
    first = True
    for row in _rows(sessions, tenant_id, start, end):
        yield ("" if first else ",") + json.dumps(row)
        first = False
    yield "]}"
