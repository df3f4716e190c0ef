"""Adapters, versions and aliases of one tenant."""
from __future__ import annotations

from sqlalchemy import delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import Adapter, AdapterAlias, AdapterStatus, AdapterVersion, Tenant

LATEST = "latest"


def get_adapter(*, session: Session, tenant: Tenant, name: str) -> Adapter | None:
    return session.scalar(select(Adapter).where(Adapter.tenant_id == tenant.id, Adapter.name == name))


def get_or_create_adapter(*, session: Session, tenant: Tenant, name: str) -> Adapter:
    adapter = get_adapter(session=session, tenant=tenant, name=name)
    if adapter is None:
        adapter = Adapter(tenant_id=tenant.id, name=name)
        session.add(adapter)
        session.flush()
    return adapter


def list_adapters(*, session: Session, tenant: Tenant, offset: int, limit: int) -> tuple[list[Adapter], int]:
    where = Adapter.tenant_id == tenant.id
    count = session.scalar(select(func.count()).select_from(Adapter).where(where)) or 0
    rows = session.scalars(select(Adapter).where(where).order_by(Adapter.name).offset(offset).limit(limit)).all()
    return list(rows), count


def get_version(*, session: Session, adapter: Adapter, number: int) -> AdapterVersion | None:
    return session.scalar(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id,
                                                       AdapterVersion.number == number))


def get_version_by_idempotency_key(*, session: Session, tenant: Tenant, key: str) -> AdapterVersion | None:
    return session.scalar(select(AdapterVersion).where(AdapterVersion.tenant_id == tenant.id,
                                                       AdapterVersion.idempotency_key == key))


def create_version(*, session: Session, adapter: Adapter, idempotency_key: str | None,
                   status: AdapterStatus = AdapterStatus.uploading) -> AdapterVersion:
    """A new version numbered after every earlier one (deleted and failed included, so numbers never repeat)."""
    last = session.scalar(select(func.max(AdapterVersion.number)).where(AdapterVersion.adapter_id == adapter.id))
    version = AdapterVersion(adapter_id=adapter.id, tenant_id=adapter.tenant_id, number=(last or 0) + 1,
                             status=status, idempotency_key=idempotency_key, targets=[])
    session.add(version)
    session.flush()
    return version


def find_ready_blob(*, session: Session, adapter: Adapter, sha256: str) -> str | None:
    """The blob URI of a ready version of ``adapter`` with this content, if any."""
    return session.scalar(select(AdapterVersion.blob_uri).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.sha256 == sha256,
        AdapterVersion.status == AdapterStatus.ready).limit(1))


def blob_in_use(*, session: Session, blob_uri: str, excluding: list[str]) -> bool:
    """Whether a live (not deleted/failed) version other than ``excluding`` still points at ``blob_uri``."""
    return session.scalar(select(func.count()).select_from(AdapterVersion).where(
        AdapterVersion.blob_uri == blob_uri, AdapterVersion.id.not_in(excluding),
        AdapterVersion.status.in_([AdapterStatus.ready, AdapterStatus.uploading, AdapterStatus.validating]))) > 0


def aliases_of(*, session: Session, adapter: Adapter) -> dict[str, int]:
    rows = session.execute(select(AdapterAlias.name, AdapterVersion.number)
                           .join(AdapterVersion, AdapterAlias.version_id == AdapterVersion.id)
                           .where(AdapterAlias.adapter_id == adapter.id).order_by(AdapterAlias.name))
    return {name: number for name, number in rows}


def set_alias(*, session: Session, adapter: Adapter, alias: str, version: AdapterVersion) -> None:
    """Points ``alias`` at ``version`` in one statement (an upsert), so readers see the old or the new target."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(AdapterAlias).values(adapter_id=adapter.id, name=alias, version_id=version.id, updated_at=utcnow())
    stmt = stmt.on_conflict_do_update(index_elements=["adapter_id", "name"],
                                      set_={"version_id": version.id, "updated_at": utcnow()})
    session.execute(stmt)


def latest_ready(*, session: Session, adapter: Adapter) -> AdapterVersion | None:
    return session.scalar(select(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.status == AdapterStatus.ready)
        .order_by(AdapterVersion.number.desc()).limit(1))


def mark_deleted(*, session: Session, adapter: Adapter, version: AdapterVersion) -> None:
    """Marks a version deleted, drops the aliases naming it and moves ``latest`` to the newest ready version."""
    version.status = AdapterStatus.deleted
    session.execute(delete(AdapterAlias).where(AdapterAlias.version_id == version.id))
    session.flush()
    newest = latest_ready(session=session, adapter=adapter)
    if newest is not None:
        set_alias(session=session, adapter=adapter, alias=LATEST, version=newest)


def delete_adapter(*, session: Session, adapter: Adapter) -> None:
    """Removes an adapter with its versions and aliases (usage rows keep their numbers, lose the link)."""
    session.execute(delete(AdapterAlias).where(AdapterAlias.adapter_id == adapter.id))
    session.execute(delete(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id))
    session.execute(delete(Adapter).where(Adapter.id == adapter.id))
    session.expire_all()
