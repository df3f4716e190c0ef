"""Stores a validated adapter and registers it; a failure at any step leaves no ``ready`` row and no orphan blob.

    row `uploading` (commit) ─▶ blob write (skipped when this adapter already stores the same sha256)
        ─▶ row `ready` + alias `latest` moved (one commit)
    blob write fails   ─▶ row `failed`, 503
    final commit fails ─▶ the blob just written is removed, row `failed` if the database still answers, 503
"""
from __future__ import annotations

import logging

from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from loraplex.platform.blobs.base import BlobStore, BlobStoreUnavailable
from loraplex.platform.crud import adapters as crud
from loraplex.platform.db.models import AdapterStatus, AdapterVersion, Tenant
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.validate import ValidatedAdapter

log = logging.getLogger(__name__)


def blob_key(tenant: Tenant, adapter_name: str, sha256: str) -> str:
    return f"adapters/{tenant.id}/{adapter_name}/{sha256}.safetensors"


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
    if previous.status in (AdapterStatus.uploading, AdapterStatus.validating):
        raise UploadError(409, f"an upload with Idempotency-Key {key!r} is still in progress; retry when it has "
                               "finished", code="idempotency_in_progress")
    if previous.status == AdapterStatus.failed:  # a failed attempt may be retried under the same key
        previous.idempotency_key = None
        session.commit()
        return None
    return previous


def register_upload(*, session: Session, store: BlobStore, tenant: Tenant, name: str, adapter: ValidatedAdapter,
                    idempotency_key: str | None) -> AdapterVersion:
    """Writes the blob and the registry rows for a validated adapter; returns the ready version."""
    version = _new_version(session=session, tenant=tenant, name=name, idempotency_key=idempotency_key)
    parent = version.adapter
    key = blob_key(tenant, name, adapter.sha256)
    reused = crud.find_ready_blob(session=session, adapter=parent, sha256=adapter.sha256) is not None
    try:
        reused = reused and store.exists(key)
        uri = store.uri(key) if reused else store.put_file(key, adapter.weights_path, sha256=adapter.sha256)
    except BlobStoreUnavailable as e:
        log.warning("upload of %s/%s v%d: %s", tenant.id, name, version.number, e)
        _mark_failed(session, version, "blob store unavailable during upload")
        raise UploadError(503, "the blob store is unavailable; nothing was stored — retry the upload later",
                          code="blob_store_unavailable") from None
    try:
        spec = adapter.spec
        version.status = AdapterStatus.ready
        version.sha256, version.size_bytes, version.blob_uri = adapter.sha256, adapter.size_bytes, uri
        version.rank, version.alpha, version.dtype = spec.rank, spec.alpha, spec.dtype
        version.targets, version.base_model = list(spec.targets), spec.base_model_name_or_path
        version.adapter_config = adapter.config
        session.flush()
        crud.set_alias(session=session, adapter=parent, alias=crud.LATEST, version=version)
        session.commit()
    except SQLAlchemyError as e:
        session.rollback()
        log.warning("upload of %s/%s v%d: registry error after the blob write: %s", tenant.id, name,
                    version.number, type(e).__name__)
        if not reused:
            try:
                store.delete(key)
            except BlobStoreUnavailable:
                log.error("orphan blob %s: the registry failed and the blob could not be removed", key)
        _mark_failed(session, version, "registry error while recording the upload")
        raise UploadError(503, "the registry failed while recording the upload; nothing was stored — retry the "
                               "upload", code="registry_unavailable") from None
    return version


def _new_version(*, session: Session, tenant: Tenant, name: str, idempotency_key: str | None) -> AdapterVersion:
    for attempt in range(3):  # racing uploads of one name collide on the unique constraints; retry
        try:
            parent = crud.get_or_create_adapter(session=session, tenant=tenant, name=name)
            version = crud.create_version(session=session, adapter=parent, idempotency_key=idempotency_key)
            session.commit()
            return version
        except IntegrityError:
            session.rollback()
            if idempotency_key and crud.get_version_by_idempotency_key(session=session, tenant=tenant,
                                                                       key=idempotency_key):
                raise UploadError(409, f"an upload with Idempotency-Key {idempotency_key!r} is already in progress",
                                  code="idempotency_in_progress") from None
    raise UploadError(409, f"too many concurrent uploads of {name!r}; retry", code="conflict")


def _mark_failed(session: Session, version: AdapterVersion, error: str) -> None:
    try:
        version.status, version.error = AdapterStatus.failed, error
        session.commit()
    except SQLAlchemyError:
        session.rollback()
        log.error("could not mark version %s failed", version.id)
