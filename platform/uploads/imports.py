"""Imports by reference: ``POST /v1/adapters/import`` records an ``adapter_imports`` row (``running``) and runs the
import in the background of this platform process; the POST waits up to ``IMPORT_WAIT_S`` and answers the result
if it is done (201 with the version, or the error), else 202 with the import to poll (``GET /v1/imports/{id}``).

    row `running` (commit) ─▶ fetch both files into a spool folder (sources.py: allow-lists, checked and pinned
        addresses, timeouts, byte caps; the row's updated_at refreshed as a heartbeat with bytes_received)
        ─▶ validate (the upload's checks, in the upload pool) ─▶ register_upload (the upload's crash-safe store and
        registry path, dedupe included) ─▶ row `succeeded` + version id   |   any refusal ─▶ row `failed` + error

A process killed mid-import leaves a `running` row that stops heartbeating: read after UPLOAD_STALE_AFTER_S it is
`failed` (``import_interrupted``); its spool folder goes with the spool sweep and any version row it had begun
with the janitor, exactly as for an interrupted upload. The tenant's credentials stay in memory for the run.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from datetime import timedelta
from typing import Any

import anyio
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import AdapterImport, ImportStatus, Tenant
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.service import register_upload
from loraplex.platform.uploads.sources import Credentials, Source, fetch_folder
from loraplex.platform.uploads.spool import spool_of
from loraplex.platform.uploads.validate import validate_adapter

logger = logging.getLogger(__name__)
INTERRUPTED = ("the import stopped before it finished (the platform restarted or lost it); nothing was stored — "
               "import again")


def create_import(*, session: Session, tenant: Tenant, key_id: str, name: str, source: Source,
                  idempotency_key: str | None) -> AdapterImport:
    row = AdapterImport(tenant_id=tenant.id, adapter_name=name, source=source.uri, status=ImportStatus.running,
                        bytes_received=0, idempotency_key=idempotency_key, created_by_key_id=key_id,
                        deduplicated=False)
    session.add(row)
    session.commit()
    return row


def get_import(*, session: Session, tenant_id: str, import_id: str, stale_after_s: float) -> AdapterImport | None:
    """The tenant's import; a ``running`` one without a heartbeat for ``stale_after_s`` is marked failed first."""
    row = session.scalar(select(AdapterImport).where(AdapterImport.id == import_id,
                                                     AdapterImport.tenant_id == tenant_id))
    if row is not None:
        expire_stale(session=session, row=row, stale_after_s=stale_after_s)
    return row


def find_by_key(*, session: Session, tenant_id: str, key: str) -> AdapterImport | None:
    return session.scalar(select(AdapterImport).where(AdapterImport.tenant_id == tenant_id,
                                                      AdapterImport.idempotency_key == key))


def list_imports(*, session: Session, tenant_id: str, limit: int, stale_after_s: float) -> list[AdapterImport]:
    rows = list(session.scalars(select(AdapterImport).where(AdapterImport.tenant_id == tenant_id)
                                .order_by(AdapterImport.created_at.desc()).limit(limit)))
    for row in rows:
        expire_stale(session=session, row=row, stale_after_s=stale_after_s)
    return rows


def expire_stale(*, session: Session, row: AdapterImport, stale_after_s: float) -> None:
    if row.status != ImportStatus.running:
        return
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    result = session.execute(update(AdapterImport).where(
        AdapterImport.id == row.id, AdapterImport.status == ImportStatus.running, AdapterImport.updated_at < cutoff)
        .values(status=ImportStatus.failed, error_status=503, error_code="import_interrupted", error=INTERRUPTED,
                idempotency_key=None, updated_at=utcnow()).execution_options(synchronize_session=False))
    session.commit()
    if result.rowcount:
        session.refresh(row)


def _finish(app: Any, import_id: str, **values) -> None:
    with app.state.sessionmaker() as session:
        session.execute(update(AdapterImport).where(AdapterImport.id == import_id,
                                                    AdapterImport.status == ImportStatus.running)
                        .values(updated_at=utcnow(), **values).execution_options(synchronize_session=False))
        session.commit()


def _heartbeat(app: Any, import_id: str):
    """``on_bytes`` of the fetch: bytes_received and updated_at written at most every third of the heartbeat."""
    sessions, every = app.state.sessionmaker, app.state.settings.upload_heartbeat_s / 3
    state = {"at": time.monotonic(), "bytes": 0}

    def on_bytes(n: int) -> None:
        state["bytes"] += n
        if time.monotonic() - state["at"] >= every:
            state["at"] = time.monotonic()
            _finish(app, import_id, bytes_received=state["bytes"])
    on_bytes.state = state
    return on_bytes


def _register(app: Any, import_id: str, tenant_id: str, key_id: str, name: str, source: Source, validated) -> None:
    settings = app.state.settings
    with app.state.sessionmaker() as session:
        tenant = session.get(Tenant, tenant_id)
        result = register_upload(session=session, store=app.state.blob_store, tenant=tenant, name=name,
                                 adapter=validated, idempotency_key=None, heartbeat_s=settings.upload_heartbeat_s,
                                 created_by_key_id=key_id, source=source.uri)
    _finish(app, import_id, status=ImportStatus.succeeded, version_id=result.version.id,
            deduplicated=result.deduplicated)


async def run_import(app: Any, import_id: str, tenant_id: str, key_id: str, name: str, source: Source,
                     credentials: Credentials | None, limits: Any) -> None:
    """Runs one import to its end and records the outcome on its row; never raises. The fetch runs in a worker
    thread of its own, the validation in the upload pool (``UPLOAD_VALIDATION_THREADS``), as uploads do."""
    settings = app.state.settings
    limiter = getattr(app.state, "upload_limiter", None)
    if limiter is None:
        limiter = app.state.upload_limiter = anyio.CapacityLimiter(settings.upload_validation_threads)
    on_bytes = _heartbeat(app, import_id)
    try:
        with spool_of(app).upload_dir() as work:
            config_path, weights_path = await anyio.to_thread.run_sync(functools.partial(
                fetch_folder, source, work, settings=settings, credentials=credentials, on_bytes=on_bytes))
            await asyncio.to_thread(_finish, app, import_id, bytes_received=on_bytes.state["bytes"])
            validated = await anyio.to_thread.run_sync(functools.partial(
                validate_adapter, config_path, weights_path, settings=settings, model=app.state.base_model,
                limits=limits), limiter=limiter)
            await asyncio.to_thread(_register, app, import_id, tenant_id, key_id, name, source, validated)
    except UploadError as e:
        logger.info("import %s of %s/%s refused: %s %s", import_id, tenant_id, name, e.status, e.code)
        await asyncio.to_thread(_finish, app, import_id, status=ImportStatus.failed, error_status=e.status,
                                error_code=e.code, error=e.message)
    except Exception:  # noqa: BLE001 - a bug: recorded as a 500, the traceback in the log
        logger.exception("import %s of %s/%s failed", import_id, tenant_id, name)
        await asyncio.to_thread(_finish, app, import_id, status=ImportStatus.failed, error_status=500,
                                error_code="internal_error", error=f"the import failed on the platform (import id "
                                                                   f"{import_id}); the operator's log has the details")


def start_import(app: Any, **kw) -> asyncio.Task:
    """``run_import`` as a task of the app's loop, kept referenced until it ends."""
    tasks = getattr(app.state, "import_tasks", None)
    if tasks is None:
        tasks = app.state.import_tasks = set()
    task = asyncio.get_running_loop().create_task(run_import(app, **kw), name=f"loraplex-import-{kw['import_id']}")
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
