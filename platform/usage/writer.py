"""UsageWriter: usage events buffered in memory and inserted in batches, off the event loop.

    writer = UsageWriter(sessionmaker, max_rows=500, interval_s=1.0)
    await writer.start()
    writer.record(event)          # O(1), never blocks, never raises
    await writer.stop()           # flushes what is left (graceful shutdown loses nothing)

A batch is written when ``max_rows`` events are waiting or ``interval_s`` after the oldest one, whichever comes
first, as one multi-row INSERT in a worker thread. A failed write keeps its events for the next attempt; past
``max_buffer`` events (the database down for long) the oldest are dropped and counted in ``dropped``.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.core.tasks import cancel_and_wait
from loraplex.platform.db.models import AdapterVersion, UsageRecord
from loraplex.platform.usage.events import UsageEvent

logger = logging.getLogger(__name__)


class UsageWriter:
    def __init__(self, sessions: sessionmaker[Session], *, max_rows: int = 500, interval_s: float = 1.0,
                 max_buffer: int = 100_000) -> None:
        if max_rows < 1 or interval_s <= 0 or max_buffer < max_rows:
            raise ValueError(f"need max_rows >= 1, interval_s > 0 and max_buffer >= max_rows, got {max_rows}, "
                             f"{interval_s}, {max_buffer}")
        self._sessions = sessions
        self.max_rows, self.interval_s, self.max_buffer = max_rows, interval_s, max_buffer
        self._buffer: deque[UsageEvent] = deque()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()       # one flush at a time
        self._task: asyncio.Task | None = None
        self.written = 0                  # rows inserted so far
        self.batches = 0                  # INSERT statements so far
        self.dropped = 0                  # events lost to a full buffer

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def record(self, event: UsageEvent) -> None:
        """Queue one event (the batch goes out by size or time)."""
        if len(self._buffer) >= self.max_buffer:
            self._buffer.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.error("usage buffer full (%d events, database unreachable?); %d events dropped so far",
                             self.max_buffer, self.dropped)
        self._buffer.append(event)
        if len(self._buffer) >= self.max_rows:
            self._wake.set()

    async def flush(self) -> int:
        """Write everything queued now; returns rows written. On a database error the events stay queued."""
        async with self._lock:
            written = 0
            while self._buffer:
                batch = [self._buffer.popleft() for _ in range(min(self.max_rows, len(self._buffer)))]
                try:
                    await asyncio.to_thread(self._insert, [e.row() for e in batch])
                except Exception:  # noqa: BLE001 - keep the events, retry on the next flush
                    self._buffer.extendleft(reversed(batch))
                    logger.exception("writing %d usage records failed; keeping them for the next flush", len(batch))
                    break
                written += len(batch)
            return written

    def _insert(self, rows: list[dict]) -> None:
        with self._sessions() as session:
            _drop_deleted_versions(session, rows)
            session.execute(insert(UsageRecord), rows)
            session.commit()
        self.written += len(rows)
        self.batches += 1

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._buffer:
                await self.flush()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loraplex-usage-writer")

    async def stop(self) -> None:
        """Stop the background task and write what is left."""
        await cancel_and_wait(self._task)
        self._task = None
        await self.flush()
        if self._buffer:
            logger.error("%d usage records could not be written at shutdown", len(self._buffer))


def _drop_deleted_versions(session: Session, rows: list[dict]) -> None:
    """Sets ``adapter_version_id`` to None in rows whose version no longer exists. The versions that do exist are
    locked against deletion (``FOR KEY SHARE`` on PostgreSQL) until the INSERT commits."""
    ids = {r["adapter_version_id"] for r in rows if r.get("adapter_version_id")}
    if not ids:
        return
    live = set(session.scalars(select(AdapterVersion.id).where(AdapterVersion.id.in_(ids))
                               .with_for_update(key_share=True)))
    for r in rows:
        if r.get("adapter_version_id") and r["adapter_version_id"] not in live:
            r["adapter_version_id"] = None
