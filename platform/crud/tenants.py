"""Tenants and their API keys."""
from __future__ import annotations

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from loraplex.platform.core.security import hash_api_key, key_prefix, new_api_key, verify_api_key
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import ApiKey, Tenant
from loraplex.platform.schemas.tenants import Quotas

QUOTA_FIELDS = tuple(Quotas.model_fields)


def create_tenant(*, session: Session, name: str, quotas: Quotas) -> Tenant:
    tenant = Tenant(name=name, disabled=False, **quotas.model_dump())
    session.add(tenant)
    session.flush()
    return tenant


def get_tenant(*, session: Session, tenant_id: str) -> Tenant | None:
    return session.get(Tenant, tenant_id)


def get_tenant_by_name(*, session: Session, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name))


def list_tenants(*, session: Session, offset: int, limit: int) -> tuple[list[Tenant], int]:
    count = session.scalar(select(func.count()).select_from(Tenant)) or 0
    rows = session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id).offset(offset).limit(limit)).all()
    return list(rows), count


def set_quotas(*, session: Session, tenant: Tenant, quotas: Quotas) -> Tenant:
    for name in QUOTA_FIELDS:
        setattr(tenant, name, getattr(quotas, name))
    session.flush()
    return tenant


def quotas_of(tenant: Tenant) -> Quotas:
    return Quotas(**{name: getattr(tenant, name) for name in QUOTA_FIELDS})


def issue_key(*, session: Session, tenant: Tenant, name: str, secret: str) -> tuple[ApiKey, str]:
    """A new key for ``tenant``; returns the row and the full key (the only time it exists in clear)."""
    key, prefix = new_api_key()
    row = ApiKey(tenant_id=tenant.id, name=name, prefix=prefix, key_hash=hash_api_key(key, secret))
    session.add(row)
    session.flush()
    return row, key


def list_keys(*, session: Session, tenant: Tenant) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.created_at)))


def get_key(*, session: Session, tenant: Tenant, key_id: str) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant.id))


def revoke_key(*, session: Session, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


def authenticate_key(*, session: Session, key: str, secret: str) -> ApiKey | None:
    """The live (not revoked) key row matching ``key``, else None."""
    prefix = key_prefix(key)
    if prefix is None:
        return None
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
    if row is None or row.revoked_at is not None or not verify_api_key(key, row.key_hash, secret):
        return None
    return row


def delete_tenant(*, session: Session, tenant: Tenant) -> None:
    """Removes the tenant row; keys, adapters, versions, aliases and usage go with it (ON DELETE CASCADE)."""
    session.execute(delete(Tenant).where(Tenant.id == tenant.id))
    session.expire_all()
