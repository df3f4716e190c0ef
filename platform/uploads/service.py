"""Stores a validated adapter and registers it, crash-safe at every step: before any byte goes to the blob store the
registry holds a row that names the blob's key, so whatever is left after a crash is found from the registry by the
janitor (``janitor.py``) and removed.

    a ready version of the adapter has the same weights (sha256) and config ─▶ that version, nothing written
    row `uploading` + intended blob key (commit) ─▶ blob write (heartbeat: the row's updated_at every few seconds;
        skipped when a ready version of this adapter stores the same sha256: its blob is shared)
        ─▶ row `ready` if still `uploading` (one conditional UPDATE) + alias `latest` moved (one commit)

    blob write fails          ─▶ row `failed`, 503 (the store aborts its own partial write)
    final commit fails        ─▶ the blob just written is removed, row `failed` if the database still answers, 503
    janitor expired the row   ─▶ (no heartbeat for UPLOAD_STALE_AFTER_S) the write or the commit stops, blob removed
    process killed anywhere   ─▶ the row stays `uploading`, stops heartbeating; the janitor expires it (`failed`,
                                 Idempotency-Key freed) and removes its blob and incomplete multipart upload

Blob keys are unique per version (``adapters/<tenant id>/<adapter>/<version id>/<sha256>.safetensors``), so
removing one version's intended blob can never hit a concurrent upload of the same content.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from loraplex.platform.blobs.base import BlobStore, BlobStoreUnavailable
from loraplex.platform.blobs.removals import removals_of
from loraplex.platform.core import checkpoints
from loraplex.platform.crud import adapters as crud
from loraplex.platform.db.models import AdapterStatus, AdapterVersion, Tenant
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.validate import ValidatedAdapter

log = logging.getLogger(__name__)
INTERRUPTED = "upload interrupted before it finished (the platform stopped or lost it); retry the upload"


def blob_key(tenant_id: str, adapter_name: str, version_id: str, sha256: str) -> str:
    return f"adapters/{tenant_id}/{adapter_name}/{version_id}/{sha256}.safetensors"


def tenant_prefix(tenant_id: str) -> str:
    return f"adapters/{tenant_id}/"


class _Expired(Exception):
    """The janitor expired this upload's row while it was still running (it had stopped heartbeating)."""


def find_idempotent(*, session: Session, tenant: Tenant, name: str, key: str | None) -> AdapterVersion | None:
    """The version an earlier request with this ``Idempotency-Key`` made, to be replayed; None to go ahead."""
    if not key:
        return None
    previous = crud.get_version_by_idempotency_key(session=session, tenant=tenant, key=key)
    if previous is None:
        return None
    if previous.adapter.name != name:
        raise UploadError(422, f"Idempotency-Key {key!r} was already used for adapter {previous.adapter.name!r}; "
                               "use a new key for a different upload", code="idempotency_key_reused")
    if previous.status in crud.IN_PROGRESS:
        raise UploadError(409, f"an upload with Idempotency-Key {key!r} is still in progress; retry when it has "
                               "finished (an interrupted upload frees its key within minutes)",
                          code="idempotency_in_progress")
    if previous.status == AdapterStatus.failed:  # a failed attempt may be retried under the same key
        previous.idempotency_key = None
        session.commit()
        return None
    return previous


@dataclass(frozen=True)
class Registered:
    """The ready version an upload or import ended with; ``deduplicated``: an existing version with the same
    weights and config (nothing new was stored)."""

    version: AdapterVersion
    deduplicated: bool = False


def register_upload(*, session: Session, store: BlobStore, tenant: Tenant, name: str, adapter: ValidatedAdapter,
                    idempotency_key: str | None, heartbeat_s: float = 30.0, created_by_key_id: str | None = None,
                    source: str | None = None) -> Registered:
    """Writes the blob and the registry rows for a validated adapter; returns the ready version, or the existing
    ready version of the same adapter with the same weights and config (no row, no blob). ``heartbeat_s``: how
    often the row's ``updated_at`` is refreshed while the blob is written (``Settings.upload_heartbeat_s``);
    ``created_by_key_id`` / ``source``: the history (the uploading API key; an import's source URI)."""
    checkpoints.reached("upload.validated")
    version, reused = _new_version(session=session, tenant=tenant, name=name, adapter=adapter,
                                   idempotency_key=idempotency_key, created_by_key_id=created_by_key_id,
                                   source=source)
    if version.status == AdapterStatus.ready:
        return Registered(version, deduplicated=True)
    checkpoints.reached("upload.recorded")
    key = version.blob_key
    try:
        if reused and not store.exists(key):   # the shared blob is gone: write this version's own
            key = version.blob_key = blob_key(tenant.id, name, version.id, adapter.sha256)
            session.commit()
            reused = False
        uri = store.uri(key) if reused else store.put_file(
            key, adapter.weights_path, sha256=adapter.sha256,
            on_progress=_heartbeat(session, version.id, heartbeat_s))
    except BlobStoreUnavailable as e:
        log.warning("upload of %s/%s v%d: %s", tenant.id, name, version.number, e)
        if not reused:      # the store may hold the blob although the write failed (its answer was lost)
            removals_of(store).remove_later(key)   # the store just failed: the 503 does not wait on a retry
        _mark_failed(session, version, "blob store unavailable during upload")
        raise UploadError(503, "the blob store is unavailable; nothing was stored — retry the upload later",
                          code="blob_store_unavailable") from None
    except _Expired:
        raise _expired_error(tenant, name, version) from None
    spec = adapter.spec
    try:
        if not crud.finish_upload(session=session, version=version, sha256=adapter.sha256,
                                  size_bytes=adapter.size_bytes, blob_uri=uri, rank=spec.rank, alpha=spec.alpha,
                                  dtype=spec.dtype, targets=list(spec.targets),
                                  base_model=spec.base_model_name_or_path, adapter_config=adapter.config):
            raise _Expired()
        crud.set_alias(session=session, adapter=version.adapter, alias=crud.LATEST, version=version)
        session.flush()
        checkpoints.reached("upload.committing")
        session.commit()
    except (SQLAlchemyError, _Expired) as e:
        session.rollback()
        if not reused:
            _remove_own_blob(store, key)
        if isinstance(e, _Expired):
            raise _expired_error(tenant, name, version) from None
        log.warning("upload of %s/%s v%d: registry error after the blob write: %s", tenant.id, name,
                    version.number, type(e).__name__)
        _mark_failed(session, version, "registry error while recording the upload")
        raise UploadError(503, "the registry failed while recording the upload; nothing was stored — retry the "
                               "upload", code="registry_unavailable") from None
    session.refresh(version)
    return Registered(version)


def _new_version(*, session: Session, tenant: Tenant, name: str, adapter: ValidatedAdapter,
                 idempotency_key: str | None, created_by_key_id: str | None,
                 source: str | None) -> tuple[AdapterVersion, bool]:
    """The ``uploading`` row with its blob key, committed, and whether that key is a ready version's shared blob;
    or the ready duplicate (same weights and config) when there is one."""
    sha256 = adapter.sha256
    for attempt in range(3):  # racing uploads of one name collide on the unique constraints; retry
        try:
            parent = crud.get_or_create_adapter(session=session, tenant=tenant, name=name)
            duplicate = crud.find_duplicate(session=session, adapter=parent, sha256=sha256, config=adapter.config)
            if duplicate is not None:
                session.commit()
                return duplicate, True
            version = crud.create_version(session=session, adapter=parent, idempotency_key=idempotency_key,
                                          created_by_key_id=created_by_key_id, source=source)
            shared = crud.find_ready_blob(session=session, adapter=parent, sha256=sha256)
            version.blob_key = shared or blob_key(tenant.id, name, version.id, sha256)
            session.commit()
            return version, shared is not None
        except IntegrityError:
            session.rollback()
            if idempotency_key and crud.get_version_by_idempotency_key(session=session, tenant=tenant,
                                                                       key=idempotency_key):
                raise UploadError(409, f"an upload with Idempotency-Key {idempotency_key!r} is already in progress",
                                  code="idempotency_in_progress") from None
    raise UploadError(409, f"too many concurrent uploads of {name!r}; retry", code="conflict")


def _heartbeat(session: Session, version_id: str, every_s: float):
    """``on_progress`` of the blob write: refreshes the row's ``updated_at`` at most every ``every_s``; raises
    ``_Expired`` (aborting the write) when the janitor has expired the row. A database error is logged and the
    write goes on (the final conditional commit decides)."""
    last = [time.monotonic()]

    def beat(_done: int) -> None:
        now = time.monotonic()
        if now - last[0] < every_s:
            return
        last[0] = now
        try:
            alive = crud.touch_upload(session=session, version_id=version_id)
            session.commit()
        except SQLAlchemyError as e:
            session.rollback()
            log.warning("upload heartbeat of version %s failed: %s", version_id, type(e).__name__)
            return
        if not alive:
            raise _Expired()
    return beat


def _expired_error(tenant: Tenant, name: str, version: AdapterVersion) -> UploadError:
    log.warning("upload of %s/%s v%d was expired while it ran (no heartbeat for too long)", tenant.id, name,
                version.number)
    return UploadError(503, "the upload stalled for too long and was cancelled; nothing was stored — retry the "
                            "upload", code="upload_interrupted")


def _remove_own_blob(store: BlobStore, key: str) -> None:
    """Removes a failed upload's own blob: now, or in the background once the store answers again."""
    removals_of(store).remove(key)


def _mark_failed(session: Session, version: AdapterVersion, error: str) -> None:
    try:
        version.status, version.error = AdapterStatus.failed, error
        session.commit()
    except SQLAlchemyError:
        session.rollback()
        log.error("could not mark version %s failed; the janitor expires it", version.id)
