"""The janitor: finds what crashed or interrupted uploads left behind and removes it. One pass (``run_once``):

    1. spool     folders of platform processes that are gone (``spool.py``; this host's spool root only)
    2. expire    versions `uploading` / `validating` whose heartbeat (``updated_at``) is older than
                 UPLOAD_STALE_AFTER_S → `failed`, Idempotency-Key freed (a retry with the same key goes ahead),
                 and their intended blob removed unless a live version shares it
    3. abort     incomplete writes under ``adapters/`` (S3: ListMultipartUploads + AbortMultipartUpload; local
                 store: temp files) started more than UPLOAD_STALE_AFTER_S ago whose key no upload in progress owns
    4. orphans   blobs under ``adapters/`` older than UPLOAD_STALE_AFTER_S that no live (ready or in progress)
                 version needs (failed uploads whose cleanup was cut short, deletes the store refused)
    5. sessions  expired dashboard sign-ins

Several platform replicas (and the CronJob) may run it at once: on PostgreSQL one pass at a time holds an advisory
lock (the others skip), and every step is safe without it too: expiry is a conditional UPDATE per row (one janitor
wins; an upload that heartbeated meanwhile is left alone), and the store is always listed *before* the registry is
read, while an upload commits its row with its blob key *before* its first byte, so a write that starts after the
listing is not seen and one that was listed is found in the registry.

    Janitor(sessionmaker, store, stale_after_s=900, spool=Spool(...)).run_once()   # -> JanitorReport
    install_janitor(app)          # the platform process: a pass at start, then every JANITOR_INTERVAL_S
    loraplex db janitor           # one pass from the command line (the chart's CronJob)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Iterator

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.blobs.base import BlobStore
from loraplex.platform.core.tasks import cancel_and_wait
from loraplex.platform.crud import adapters as crud
from loraplex.platform.crud import dashboard_sessions
from loraplex.platform.db.base import utcnow
from loraplex.platform.uploads.service import INTERRUPTED
from loraplex.platform.uploads.spool import Spool, spool_of

logger = logging.getLogger(__name__)

PREFIX = "adapters/"
LOCK_ID = 0x6C6F7261706C6578   # "loraplex": the PostgreSQL advisory lock of a janitor pass


@dataclass
class JanitorReport:
    skipped: bool = False               # another janitor held the lock: only the spool was swept
    spool_folders_removed: int = 0
    uploads_expired: int = 0
    blobs_removed: int = 0
    incomplete_uploads_aborted: int = 0
    dashboard_sessions_removed: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def changed(self) -> bool:
        return any((self.spool_folders_removed, self.uploads_expired, self.blobs_removed,
                    self.incomplete_uploads_aborted, self.dashboard_sessions_removed))


@contextlib.contextmanager
def janitor_lock(engine: Engine) -> Iterator[bool]:
    """True when this pass may run: on PostgreSQL, if it got the advisory lock (held until the block ends); other
    databases (SQLite: the embedded, single-process deployment) always."""
    if engine.dialect.name != "postgresql":
        yield True
        return
    with engine.connect() as conn:
        got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_ID}).scalar())
        conn.commit()
        try:
            yield got
        finally:
            if got:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_ID})
                conn.commit()


class Janitor:
    def __init__(self, sessions: sessionmaker[Session], store: BlobStore, *, stale_after_s: float,
                 spool: Spool | None = None) -> None:
        self.sessions, self.store, self.stale_after_s, self.spool = sessions, store, stale_after_s, spool

    def run_once(self) -> JanitorReport:
        """One pass; raises on a registry or store outage (the next pass retries)."""
        start = time.monotonic()
        report = JanitorReport()
        if self.spool is not None:
            report.spool_folders_removed = len(self.spool.sweep())
        with janitor_lock(self.sessions.kw["bind"]) as got:
            if not got:
                report.skipped = True
            else:
                cutoff = utcnow() - timedelta(seconds=self.stale_after_s)
                self._expire(cutoff, report)
                self._abort_incomplete(cutoff, report)
                self._remove_orphans(cutoff, report)
                with self.sessions() as session:
                    report.dashboard_sessions_removed = dashboard_sessions.remove_expired(session=session)
                    session.commit()
        report.seconds = round(time.monotonic() - start, 3)
        if report.changed:
            logger.info("janitor: %s", report.as_dict())
        return report

    def _expire(self, cutoff, report: JanitorReport) -> None:
        with self.sessions() as session:
            for version_id in crud.stale_uploads(session=session, cutoff=cutoff):
                key = crud.expire_upload(session=session, version_id=version_id, cutoff=cutoff, error=INTERRUPTED)
                session.commit()
                if key is None:        # another janitor expired it, or its upload heartbeated meanwhile
                    continue
                report.uploads_expired += 1
                logger.info("janitor: expired interrupted upload %s (blob key %s)", version_id, key or "-")
                if key and not crud.blob_in_use(session=session, blob_key=key, excluding=[version_id]) \
                        and self.store.exists(key):
                    self.store.delete(key)
                    report.blobs_removed += 1

    def _abort_incomplete(self, cutoff, report: JanitorReport) -> None:
        uploads = [u for u in self.store.incomplete_uploads(PREFIX) if u.initiated < cutoff]
        if not uploads:
            return
        with self.sessions() as session:
            running = crud.in_progress_blob_keys(session=session)
        for upload in uploads:
            if upload.key not in running:
                self.store.abort_incomplete(upload)
                report.incomplete_uploads_aborted += 1

    def _remove_orphans(self, cutoff, report: JanitorReport) -> None:
        blobs = [b for b in self.store.list_blobs(PREFIX) if b.modified < cutoff]
        if not blobs:
            return
        with self.sessions() as session:
            live = crud.live_blob_keys(session=session, keys=[b.key for b in blobs], uri_of=self.store.uri)
        for blob in blobs:
            if blob.key not in live:
                self.store.delete(blob.key)
                report.blobs_removed += 1
                logger.info("janitor: removed orphan blob %s", blob.key)


def janitor_of(app: Any) -> Janitor:
    """The janitor of a platform app (its registry, blob store, settings and spool)."""
    settings = app.state.settings
    return Janitor(app.state.sessionmaker, app.state.blob_store, stale_after_s=settings.upload_stale_after_s,
                   spool=spool_of(app))


def install_janitor(app: Any) -> None:
    """Runs in the app's lifespan, around the app's own: the spool heartbeat every SPOOL_LEASE_S / 4 and a janitor
    pass at start and every JANITOR_INTERVAL_S (0: no passes, e.g. when the chart's CronJob runs them).
    ``app.state.janitor_reports`` keeps the last reports."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        janitor = janitor_of(a)
        a.state.janitor_reports = []
        task = asyncio.create_task(_loop(a, janitor), name="loraplex-janitor")
        try:
            async with inner(a) as state:
                yield state
        finally:
            await cancel_and_wait(task)
            janitor.spool.close()

    app.router.lifespan_context = lifespan


async def _loop(app: Any, janitor: Janitor) -> None:
    settings = app.state.settings
    beat_s = settings.spool_lease_s / 4
    interval = settings.janitor_interval_s
    due = time.monotonic()
    while True:
        try:
            await asyncio.to_thread(janitor.spool.heartbeat)
        except OSError as e:
            logger.warning("spool heartbeat failed: %s", e)
        if interval > 0 and time.monotonic() >= due:
            due = time.monotonic() + interval
            try:
                report = await asyncio.to_thread(janitor.run_once)
                app.state.janitor_reports = [*app.state.janitor_reports[-9:], report]
            except Exception as e:  # noqa: BLE001 - an outage: the next pass retries
                logger.warning("janitor pass failed (%s: %s); retrying in %.0f s", type(e).__name__, e, interval)
        await asyncio.sleep(min(beat_s, max(0.05, due - time.monotonic())) if interval > 0 else beat_s)
