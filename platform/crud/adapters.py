"""Adapters, versions and aliases of one tenant."""
from __future__ import annotations

from datetime import datetime
from typing import Callable

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import Adapter, AdapterAlias, AdapterStatus, AdapterVersion, Tenant

LATEST = "latest"
IN_PROGRESS = (AdapterStatus.uploading, AdapterStatus.validating)
LIVE = (AdapterStatus.ready, *IN_PROGRESS)          # versions whose blob must stay


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
                   status: AdapterStatus = AdapterStatus.uploading, created_by_key_id: str | None = None,
                   source: str | None = None) -> AdapterVersion:
    """A new version numbered after every earlier one (deleted and failed included, so numbers never repeat)."""
    last = session.scalar(select(func.max(AdapterVersion.number)).where(AdapterVersion.adapter_id == adapter.id))
    version = AdapterVersion(adapter_id=adapter.id, tenant_id=adapter.tenant_id, number=(last or 0) + 1,
                             status=status, idempotency_key=idempotency_key, targets=[],
                             created_by_key_id=created_by_key_id, source=source)
    session.add(version)
    session.flush()
    return version


def find_duplicate(*, session: Session, adapter: Adapter, sha256: str, config: dict) -> AdapterVersion | None:
    """The newest ready version of ``adapter`` with these weights (sha256) and this ``adapter_config.json`` (the
    config decides the scaling and patterns, so equal weights with another config are another adapter)."""
    rows = session.scalars(select(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.sha256 == sha256,
        AdapterVersion.status == AdapterStatus.ready).order_by(AdapterVersion.number.desc()))
    return next((v for v in rows if (v.adapter_config or {}) == config), None)


def find_ready_blob(*, session: Session, adapter: Adapter, sha256: str) -> str | None:
    """The blob key of a ready version of ``adapter`` with this content, if any."""
    return session.scalar(select(AdapterVersion.blob_key).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.sha256 == sha256,
        AdapterVersion.status == AdapterStatus.ready, AdapterVersion.blob_key.is_not(None)).limit(1))


def blob_in_use(*, session: Session, blob_key: str, excluding: list[str]) -> bool:
    """Whether a live (ready or in progress) version other than ``excluding`` still needs ``blob_key``."""
    return session.scalar(select(func.count()).select_from(AdapterVersion).where(
        AdapterVersion.blob_key == blob_key, AdapterVersion.id.not_in(excluding),
        AdapterVersion.status.in_(LIVE))) > 0


def live_blob_keys(*, session: Session, keys: list[str], uri_of: Callable[[str], str] | None = None,
                   chunk: int = 500) -> set[str]:
    """Those of ``keys`` that a live version needs: by its ``blob_key``, or, when ``uri_of`` is given, by its
    ``blob_uri`` (rows that recorded no key: written by an older platform, e.g. during a rolling upgrade)."""
    out: set[str] = set()
    for i in range(0, len(keys), chunk):
        part = keys[i:i + chunk]
        out |= set(session.scalars(select(AdapterVersion.blob_key).where(
            AdapterVersion.blob_key.in_(part), AdapterVersion.status.in_(LIVE))))
        if uri_of is not None:
            by_uri = {uri_of(k): k for k in part}
            out |= {by_uri[u] for u in session.scalars(select(AdapterVersion.blob_uri).where(
                AdapterVersion.blob_uri.in_(list(by_uri)), AdapterVersion.status.in_(LIVE)))}
    return out


def in_progress_blob_keys(*, session: Session) -> set[str]:
    """The blob keys of every upload in progress (their store writes may be running)."""
    return set(session.scalars(select(AdapterVersion.blob_key).where(
        AdapterVersion.status.in_(IN_PROGRESS), AdapterVersion.blob_key.is_not(None))))


def touch_upload(*, session: Session, version_id: str) -> bool:
    """The uploader's heartbeat: ``updated_at`` = now while the version is in progress; False once it is not
    (the janitor expired it)."""
    result = session.execute(update(AdapterVersion).where(
        AdapterVersion.id == version_id, AdapterVersion.status.in_(IN_PROGRESS)).values(updated_at=utcnow())
        .execution_options(synchronize_session=False))
    return result.rowcount == 1


def finish_upload(*, session: Session, version: AdapterVersion, **values) -> bool:
    """Sets ``values`` and status ``ready`` on ``version`` if it is still in progress (one conditional UPDATE, so an
    upload the janitor expired meanwhile can never turn ready); False otherwise."""
    result = session.execute(update(AdapterVersion).where(
        AdapterVersion.id == version.id, AdapterVersion.status.in_(IN_PROGRESS))
        .values(status=AdapterStatus.ready, updated_at=utcnow(), **values)
        .execution_options(synchronize_session=False))
    return result.rowcount == 1


def stale_uploads(*, session: Session, cutoff: datetime, limit: int = 1000) -> list[str]:
    """Ids of in-progress versions whose heartbeat (``updated_at``) is older than ``cutoff``."""
    return list(session.scalars(select(AdapterVersion.id).where(
        AdapterVersion.status.in_(IN_PROGRESS), AdapterVersion.updated_at < cutoff)
        .order_by(AdapterVersion.updated_at).limit(limit)))


def expire_upload(*, session: Session, version_id: str, cutoff: datetime, error: str) -> str | None:
    """Marks one stale in-progress version ``failed`` and frees its Idempotency-Key, if it is still stale (a
    conditional UPDATE: of several janitors, one wins; an upload that heartbeated meanwhile is left alone).
    Returns the version's blob key when this call expired it, else None (also "" when it had no key)."""
    result = session.execute(update(AdapterVersion).where(
        AdapterVersion.id == version_id, AdapterVersion.status.in_(IN_PROGRESS), AdapterVersion.updated_at < cutoff)
        .values(status=AdapterStatus.failed, error=error, idempotency_key=None, updated_at=utcnow())
        .execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return None
    return session.scalar(select(AdapterVersion.blob_key).where(AdapterVersion.id == version_id)) or ""


def blob_keys_of_tenant(*, session: Session, tenant_id: str) -> set[str]:
    """Every blob key any version of the tenant recorded (ready, intended, failed or deleted)."""
    return set(session.scalars(select(AdapterVersion.blob_key).where(
        AdapterVersion.tenant_id == tenant_id, AdapterVersion.blob_key.is_not(None))))


def alias_version(*, session: Session, adapter: Adapter, alias: str) -> AdapterVersion | None:
    """The version ``alias`` names, or None."""
    return session.scalar(select(AdapterVersion).join(AdapterAlias, AdapterAlias.version_id == AdapterVersion.id)
                          .where(AdapterAlias.adapter_id == adapter.id, AdapterAlias.name == alias))


def aliases_of(*, session: Session, adapter: Adapter) -> dict[str, int]:
    rows = session.execute(select(AdapterAlias.name, AdapterVersion.number)
                           .join(AdapterVersion, AdapterAlias.version_id == AdapterVersion.id)
                           .where(AdapterAlias.adapter_id == adapter.id).order_by(AdapterAlias.name))
    return {name: number for name, number in rows}


def set_alias(*, session: Session, adapter: Adapter, alias: str, version: AdapterVersion,
              by_key_id: str | None = None) -> None:
    """Points ``alias`` at ``version`` in one statement (an upsert), so readers see the old or the new target.
    ``by_key_id``: the API key that moved it (kept for the history)."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    now = utcnow()
    stmt = insert(AdapterAlias).values(adapter_id=adapter.id, name=alias, version_id=version.id, updated_at=now,
                                       updated_by_key_id=by_key_id)
    stmt = stmt.on_conflict_do_update(index_elements=["adapter_id", "name"],
                                      set_={"version_id": version.id, "updated_at": now,
                                            "updated_by_key_id": by_key_id})
    session.execute(stmt)


def delete_alias(*, session: Session, adapter: Adapter, alias: str) -> bool:
    """Removes ``alias``; False when the adapter has no such alias."""
    result = session.execute(delete(AdapterAlias).where(AdapterAlias.adapter_id == adapter.id,
                                                        AdapterAlias.name == alias)
                             .execution_options(synchronize_session=False))
    return result.rowcount == 1


def alias_rows(*, session: Session, adapter: Adapter) -> list[tuple[AdapterAlias, int]]:
    """Every alias of ``adapter`` with the number of the version it names, by name."""
    return [(a, n) for a, n in session.execute(
        select(AdapterAlias, AdapterVersion.number).join(AdapterVersion, AdapterAlias.version_id == AdapterVersion.id)
        .where(AdapterAlias.adapter_id == adapter.id).order_by(AdapterAlias.name))]


def has_live_versions(*, session: Session, adapter: Adapter) -> bool:
    """Whether a version of ``adapter`` is ready or still being uploaded."""
    return (session.scalar(select(func.count()).select_from(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.status.in_(LIVE))) or 0) > 0


def latest_ready(*, session: Session, adapter: Adapter) -> AdapterVersion | None:
    return session.scalar(select(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.status == AdapterStatus.ready)
        .order_by(AdapterVersion.number.desc()).limit(1))


def mark_deleted(*, session: Session, adapter: Adapter, version: AdapterVersion, by_key_id: str | None = None) -> None:
    """Marks a version deleted (when, and by which API key), drops the aliases naming it and moves ``latest`` to the
    newest ready version."""
    version.status = AdapterStatus.deleted
    version.deleted_at, version.deleted_by_key_id = utcnow(), by_key_id
    session.execute(delete(AdapterAlias).where(AdapterAlias.version_id == version.id))
    session.flush()
    newest = latest_ready(session=session, adapter=adapter)
    if newest is not None:
        set_alias(session=session, adapter=adapter, alias=LATEST, version=newest, by_key_id=by_key_id)


def delete_adapter(*, session: Session, adapter: Adapter) -> None:
    """Removes an adapter with its versions and aliases (usage rows keep their numbers, lose the link)."""
    session.execute(delete(AdapterAlias).where(AdapterAlias.adapter_id == adapter.id))
    session.execute(delete(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id))
    session.execute(delete(Adapter).where(Adapter.id == adapter.id))
    session.expire_all()
