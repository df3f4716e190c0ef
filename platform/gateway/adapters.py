"""Adapter resolution for inference: ``model`` → the tenant's ready adapter version → the engine's reference.

Tenant-scoped: another tenant's adapter is looked up under the caller's tenant id and so is simply not found
(404 ``model_not_found``, never 403). The reference's ``adapter_id`` is ``"<tenant id>/<adapter>/<version id>"``
(version ids never repeat, even when a name is deleted and reused).

The blob store holds only ``adapter_model.safetensors``; engines need ``adapter_config.json`` too (from the
registry). For S3 blobs the config travels inline in the URI fragment (``engine/lora/fetch_s3.py``); for the local
blob folder the gateway materialises a PEFT folder ``<ADAPTER_DIR>/<version id>/`` (config + a hard link to the
blob) that the engine's ``file://`` fetcher copies.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import Adapter, AdapterAlias, AdapterStatus, AdapterVersion
from loraplex.platform.engines.messages import AdapterReference
from loraplex.platform.inference.model_name import ModelTarget


@dataclass(frozen=True)
class ResolvedAdapter:
    """A ready adapter version as the gateway needs it (plain data: safe to keep past the DB session)."""

    tenant_id: str
    name: str
    version_id: str
    number: int
    sha256: str | None
    blob_uri: str
    rank: int | None
    targets: tuple[str, ...]
    config: dict

    @property
    def adapter_id(self) -> str:
        return engine_adapter_id(self.tenant_id, self.name, self.version_id)


def engine_adapter_id(tenant_id: str, adapter_name: str, version_id: str) -> str:
    return f"{tenant_id}/{adapter_name}/{version_id}"


def resolve_adapter(*, session: Session, tenant_id: str, target: ModelTarget) -> ResolvedAdapter | None:
    """The ready version ``target`` names within ``tenant_id``; None if there is none (→ 404)."""
    query = (select(Adapter.name, AdapterVersion)
             .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
             .where(Adapter.tenant_id == tenant_id, Adapter.name == target.adapter,
                    AdapterVersion.status == AdapterStatus.ready))
    if target.version is not None:
        query = query.where(AdapterVersion.number == target.version)
    else:
        query = query.join(AdapterAlias, AdapterAlias.version_id == AdapterVersion.id).where(
            AdapterAlias.name == target.alias)
    row = session.execute(query.limit(1)).first()
    if row is None or not row[1].blob_uri:
        return None
    name, v = row
    return ResolvedAdapter(tenant_id=tenant_id, name=name, version_id=v.id, number=v.number, sha256=v.sha256,
                           blob_uri=v.blob_uri, rank=v.rank, targets=tuple(v.targets or ()),
                           config=dict(v.adapter_config or {}))


def resolve_version(*, session: Session, tenant_id: str, version_id: str) -> ResolvedAdapter | None:
    """The ready version ``version_id`` of ``tenant_id`` (None if it is not ready or not the tenant's)."""
    row = session.execute(select(Adapter.name, AdapterVersion)
                          .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
                          .where(Adapter.tenant_id == tenant_id, AdapterVersion.id == version_id,
                                 AdapterVersion.status == AdapterStatus.ready)).first()
    if row is None or not row[1].blob_uri:
        return None
    name, v = row
    return ResolvedAdapter(tenant_id=tenant_id, name=name, version_id=v.id, number=v.number, sha256=v.sha256,
                           blob_uri=v.blob_uri, rank=v.rank, targets=tuple(v.targets or ()),
                           config=dict(v.adapter_config or {}))


def version_is_ready(*, session: Session, version_id: str) -> bool:
    """Whether the version is still ``ready`` (a request that resolved it may race its deletion)."""
    status = session.execute(select(AdapterVersion.status).where(AdapterVersion.id == version_id)).scalar()
    return status == AdapterStatus.ready


class AdapterReferences:
    """Builds the engine reference of a resolved version (materialising local PEFT folders once)."""

    def __init__(self, adapter_dir: str) -> None:
        self.adapter_dir = adapter_dir

    def reference(self, adapter: ResolvedAdapter) -> AdapterReference:
        uri = adapter.blob_uri
        if uri.startswith("s3://"):
            from loraplex.engine.lora.fetch_s3 import adapter_config_fragment

            uri = uri.split("#", 1)[0] + "#" + adapter_config_fragment(adapter.config)
        elif uri.startswith("file://"):
            uri = "file://" + self.materialise(adapter)
        return AdapterReference(adapter_id=adapter.adapter_id, uri=uri, sha256=adapter.sha256, rank=adapter.rank,
                                targets=adapter.targets)

    def materialise(self, adapter: ResolvedAdapter) -> str:
        """``<adapter_dir>/<version id>/`` with ``adapter_config.json`` and the weights (hard link, else a copy).
        Built in a temp folder and renamed into place, so a reader never sees half a folder."""
        folder = os.path.join(self.adapter_dir, adapter.version_id)
        if os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
            return folder
        os.makedirs(self.adapter_dir, exist_ok=True)
        blob = unquote(urlparse(adapter.blob_uri).path)
        work = tempfile.mkdtemp(prefix=".peft-", dir=self.adapter_dir)
        try:
            with open(os.path.join(work, "adapter_config.json"), "w", encoding="utf-8") as f:
                json.dump(adapter.config, f)
            dest = os.path.join(work, "adapter_model.safetensors")
            try:
                os.link(blob, dest)
            except OSError:
                shutil.copyfile(blob, dest)
            try:
                os.rename(work, folder)
            except OSError:  # a concurrent request won the race
                if not os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return folder

    def forget(self, version_id: str) -> None:
        """Remove a deleted version's materialised folder (no-op if none)."""
        shutil.rmtree(os.path.join(self.adapter_dir, version_id), ignore_errors=True)
