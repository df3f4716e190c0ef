"""Admin API: tenants and their quotas."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from sqlalchemy.exc import IntegrityError

from loraplex.platform.api.deps import AdminKey, BlobStoreDep, NotifierDep, SessionDep
from loraplex.platform.api.errors import ApiError
from loraplex.platform.crud import tenants as crud
from loraplex.platform.db.models import Tenant
from loraplex.platform.gateway.auth import forget_cached_keys
from loraplex.platform.schemas.tenants import Quotas, TenantCreate, TenantPublic, TenantsPublic
from loraplex.platform.schemas.types import Limit, Offset, RowId
from loraplex.platform.uploads.deletion import delete_tenant as delete_tenant_and_blobs

router = APIRouter(prefix="/admin/tenants", tags=["admin: tenants"])


def admin_tenant(session: SessionDep, _: AdminKey, tenant_id: RowId) -> Tenant:
    tenant = crud.get_tenant(session=session, tenant_id=tenant_id)
    if tenant is None:
        raise ApiError(404, f"tenant {tenant_id!r} not found", code="tenant_not_found")
    return tenant


AdminTenant = Annotated[Tenant, Depends(admin_tenant)]


def tenant_public(tenant: Tenant) -> TenantPublic:
    return TenantPublic(id=tenant.id, name=tenant.name, disabled=tenant.disabled, created_at=tenant.created_at,
                        quotas=crud.quotas_of(tenant))


@router.post("", status_code=201, response_model=TenantPublic)
def create_tenant(session: SessionDep, _: AdminKey, body: TenantCreate) -> TenantPublic:
    if crud.get_tenant_by_name(session=session, name=body.name):
        raise ApiError(409, f"a tenant named {body.name!r} exists; choose another name", code="tenant_exists")
    try:
        tenant = crud.create_tenant(session=session, name=body.name, quotas=body.quotas)
        session.commit()
    except IntegrityError:
        raise ApiError(409, f"a tenant named {body.name!r} exists; choose another name", code="tenant_exists") from None
    return tenant_public(tenant)


@router.get("", response_model=TenantsPublic)
def list_tenants(session: SessionDep, _: AdminKey, offset: Offset = 0, limit: Limit = 50) -> TenantsPublic:
    rows, count = crud.list_tenants(session=session, offset=offset, limit=limit)
    return TenantsPublic(data=[tenant_public(t) for t in rows], count=count)


@router.get("/{tenant_id}", response_model=TenantPublic)
def read_tenant(tenant: AdminTenant) -> TenantPublic:
    return tenant_public(tenant)


@router.post("/{tenant_id}/disable", response_model=TenantPublic)
def disable_tenant(request: Request, session: SessionDep, tenant: AdminTenant) -> TenantPublic:
    """A disabled tenant's keys stop working (403) until it is enabled again."""
    tenant.disabled = True
    session.commit()
    forget_cached_keys(request.app)
    return tenant_public(tenant)


@router.post("/{tenant_id}/enable", response_model=TenantPublic)
def enable_tenant(request: Request, session: SessionDep, tenant: AdminTenant) -> TenantPublic:
    tenant.disabled = False
    session.commit()
    forget_cached_keys(request.app)
    return tenant_public(tenant)


@router.put("/{tenant_id}/quotas", response_model=TenantPublic)
def set_quotas(request: Request, session: SessionDep, tenant: AdminTenant, body: Quotas) -> TenantPublic:
    """Replaces the tenant's quotas; a null field falls back to the deployment default."""
    crud.set_quotas(session=session, tenant=tenant, quotas=body)
    session.commit()
    forget_cached_keys(request.app)
    return tenant_public(tenant)


@router.delete("/{tenant_id}", status_code=204)
def delete_tenant(request: Request, session: SessionDep, tenant: AdminTenant, store: BlobStoreDep,
                  notifier: NotifierDep) -> None:
    """Deletes the tenant with its keys, adapters, versions and usage: its keys stop working at once, engines evict
    its adapters, and every blob of every version (recorded or intended) is removed. Store down: 503, the tenant
    stays disabled; repeat the DELETE to finish."""
    try:
        delete_tenant_and_blobs(session=session, store=store, notifier=notifier, tenant=tenant)
    finally:
        forget_cached_keys(request.app)
