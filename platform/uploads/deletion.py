"""Deleting adapter versions, whole adapters and tenants: the registry first (committed), then engines evict, then
every blob goes: each version's recorded or intended key (``adapter_versions.blob_key``, written before its upload
began), and for a tenant everything under ``adapters/<tenant id>/`` including incomplete multipart uploads.

A blob is removed only when no other live version points at it (the same content uploaded twice to one adapter
shares one). If the store is down the registry change stands and the call answers 503; repeating the DELETE
finishes it (and the janitor removes blobs that no live version needs in any case)."""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.blobs.base import BlobStore, BlobStoreUnavailable
from loraplex.platform.crud import adapters as crud
from loraplex.platform.crud import tenants as tenants_crud
from loraplex.platform.db.models import Adapter, AdapterStatus, AdapterVersion, Tenant
from loraplex.platform.engines.notifier import EngineNotifier, Eviction
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.service import tenant_prefix


def _store_down(what: str) -> UploadError:
    return UploadError(503, f"the {what} was deleted but the blob store is unavailable to remove its weights; "
                            "repeat the DELETE later to finish", code="blob_store_unavailable")


def _retire(session: Session, notifier: EngineNotifier, adapter: Adapter, versions: list[AdapterVersion],
            by_key_id: str | None = None) -> None:
    """Marks ``versions`` deleted (commit) and tells engines to evict them."""
    live = [v for v in versions if v.status != AdapterStatus.deleted]
    for v in live:
        crud.mark_deleted(session=session, adapter=adapter, version=v, by_key_id=by_key_id)
    session.commit()
    if live:
        notifier.evict([Eviction(tenant_id=adapter.tenant_id, adapter_name=adapter.name, version_id=v.id,
                                 sha256=v.sha256) for v in live])


def delete_versions(*, session: Session, store: BlobStore, notifier: EngineNotifier, adapter: Adapter,
                    versions: list[AdapterVersion], by_key_id: str | None = None, keep_adapter: bool = True) -> bool:
    """Marks ``versions`` deleted, tells engines to evict them and removes their unshared blobs (recorded or
    intended) and any incomplete upload of those keys. Unless ``keep_adapter``, an adapter left without a ready or
    in-progress version goes too (its name is freed); returns whether it did."""
    _retire(session, notifier, adapter, versions, by_key_id)
    ids = [v.id for v in versions]
    keys = sorted({v.blob_key for v in versions if v.blob_key})
    unshared = {k for k in keys if not crud.blob_in_use(session=session, blob_key=k, excluding=ids)}
    try:
        for key in sorted(unshared):
            store.delete(key)
        if unshared:
            for upload in store.incomplete_uploads(f"adapters/{adapter.tenant_id}/{adapter.name}/"):
                if upload.key in unshared:
                    store.abort_incomplete(upload)
    except BlobStoreUnavailable:
        raise _store_down("adapter") from None
    if keep_adapter or crud.has_live_versions(session=session, adapter=adapter):
        return False
    _remove_empty(session, store, adapter)
    return True


def _remove_empty(session: Session, store: BlobStore, adapter: Adapter) -> None:
    """The rows of an adapter none of whose versions is live any more, after the blobs its failed versions
    intended (their uploads stopped before the store had them, or left them behind)."""
    versions = list(adapter.versions)
    ids = [v.id for v in versions]
    try:
        for key in sorted({v.blob_key for v in versions if v.blob_key}):
            if not crud.blob_in_use(session=session, blob_key=key, excluding=ids) and store.exists(key):
                store.delete(key)
    except BlobStoreUnavailable:
        raise _store_down("adapter") from None
    crud.delete_adapter(session=session, adapter=adapter)
    session.commit()


def delete_whole_adapter(*, session: Session, store: BlobStore, notifier: EngineNotifier, adapter: Adapter,
                         by_key_id: str | None = None) -> None:
    """Every version (engines evict), every blob any of them recorded or intended, every alias and the name."""
    delete_versions(session=session, store=store, notifier=notifier, adapter=adapter, versions=list(adapter.versions),
                    by_key_id=by_key_id)
    _remove_empty(session, store, adapter)


def delete_tenant(*, session: Session, store: BlobStore, notifier: EngineNotifier, tenant: Tenant) -> None:
    """Disables the tenant (its keys stop working), retires every version of every adapter (engines evict), removes
    every blob the registry recorded for it and everything else under its prefix (incomplete uploads included),
    then the tenant row with its keys, adapters, versions and usage."""
    tenant.disabled = True
    session.commit()
    for adapter in session.scalars(select(Adapter).where(Adapter.tenant_id == tenant.id)).all():
        _retire(session, notifier, adapter, list(adapter.versions))
    prefix = tenant_prefix(tenant.id)
    try:
        for key in sorted(crud.blob_keys_of_tenant(session=session, tenant_id=tenant.id) |
                          set(store.list_keys(prefix))):
            store.delete(key)
        for upload in store.incomplete_uploads(prefix):
            store.abort_incomplete(upload)
    except BlobStoreUnavailable:
        raise _store_down("tenant's adapters") from None
    tenants_crud.delete_tenant(session=session, tenant=tenant)
    session.commit()
