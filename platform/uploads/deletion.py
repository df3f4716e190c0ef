"""Deleting adapter versions: the registry first (committed), then engines evict, then the blobs go.

A blob is removed only when no other live version points at it (the same content uploaded twice shares one).
If the store is down the registry change stands and the call answers 503; repeating the DELETE finishes it."""
from __future__ import annotations

from sqlalchemy.orm import Session

from loraplex.platform.blobs.base import BlobStore, BlobStoreUnavailable
from loraplex.platform.crud import adapters as crud
from loraplex.platform.db.models import Adapter, AdapterStatus, AdapterVersion
from loraplex.platform.engines.notifier import EngineNotifier, Eviction
from loraplex.platform.uploads.errors import UploadError


def delete_versions(*, session: Session, store: BlobStore, notifier: EngineNotifier, adapter: Adapter,
                    versions: list[AdapterVersion]) -> None:
    """Marks ``versions`` deleted, tells engines to evict them and removes their unshared blobs."""
    live = [v for v in versions if v.status != AdapterStatus.deleted]
    for v in live:
        crud.mark_deleted(session=session, adapter=adapter, version=v)
    session.commit()
    if live:
        notifier.evict([Eviction(tenant_id=adapter.tenant_id, adapter_name=adapter.name, version_id=v.id,
                                 sha256=v.sha256) for v in live])
    ids = [v.id for v in versions]
    for uri in sorted({v.blob_uri for v in versions if v.blob_uri}):
        if crud.blob_in_use(session=session, blob_uri=uri, excluding=ids):
            continue
        try:
            store.delete(_key_of(uri))
        except BlobStoreUnavailable:
            raise UploadError(503, "the adapter was deleted but the blob store is unavailable to remove its "
                                   "weights; repeat the DELETE later to finish", code="blob_store_unavailable") from None


def delete_whole_adapter(*, session: Session, store: BlobStore, notifier: EngineNotifier, adapter: Adapter) -> None:
    delete_versions(session=session, store=store, notifier=notifier, adapter=adapter, versions=list(adapter.versions))
    crud.delete_adapter(session=session, adapter=adapter)
    session.commit()


def _key_of(uri: str) -> str:
    """The store key of an ``s3://bucket/<key>`` or ``file:///<root>/<key>`` URI: keys are
    ``adapters/<tenant>/<adapter>/<sha256>.safetensors``, the last four path components."""
    return "/".join(uri.split("/")[-4:])
