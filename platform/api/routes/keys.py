"""API keys: the admin API's ``/admin/tenants/{id}/keys`` and the tenant's own ``/v1/keys`` (self-service with a
live key of the tenant). The key itself is shown once, at issue."""
from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.platform.api.deps import CurrentTenant, SessionDep, SettingsDep
from loraplex.platform.api.errors import ApiError
from loraplex.platform.api.routes.tenants import AdminTenant
from loraplex.platform.crud import tenants as crud
from loraplex.platform.gateway.auth import forget_cached_keys
from loraplex.platform.schemas.tenants import ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, ApiKeysPublic
from loraplex.platform.schemas.types import RowId

router = APIRouter(prefix="/admin/tenants/{tenant_id}/keys", tags=["admin: keys"])


@router.post("", status_code=201, response_model=ApiKeyCreated)
def issue_key(session: SessionDep, settings: SettingsDep, tenant: AdminTenant, body: ApiKeyCreate) -> ApiKeyCreated:
    row, key = crud.issue_key(session=session, tenant=tenant, name=body.name,
                              secret=settings.secret_key.get_secret_value())
    session.commit()
    return ApiKeyCreated(**ApiKeyPublic.model_validate(row).model_dump(), key=key)


@router.get("", response_model=ApiKeysPublic)
def list_keys(session: SessionDep, tenant: AdminTenant) -> ApiKeysPublic:
    rows = crud.list_keys(session=session, tenant=tenant)
    return ApiKeysPublic(data=[ApiKeyPublic.model_validate(r) for r in rows], count=len(rows))


@router.delete("/{key_id}", response_model=ApiKeyPublic)
def revoke_key(request: Request, session: SessionDep, tenant: AdminTenant, key_id: RowId) -> ApiKeyPublic:
    row = crud.get_key(session=session, tenant=tenant, key_id=key_id)
    if row is None:
        raise ApiError(404, f"key {key_id!r} not found for this tenant", code="key_not_found")
    crud.revoke_key(session=session, key=row)
    session.commit()
    forget_cached_keys(request.app)   # the revoked key stops working at once, inference included
    return ApiKeyPublic.model_validate(row)


# ---- tenant self-service: the caller's own tenant's keys ----------------------------------------------------------
tenant_router = APIRouter(prefix="/v1/keys", tags=["keys"])


@tenant_router.post("", status_code=201, response_model=ApiKeyCreated)
def issue_own_key(session: SessionDep, settings: SettingsDep, tenant: CurrentTenant,
                  body: ApiKeyCreate) -> ApiKeyCreated:
    """A new API key of the caller's tenant (e.g. one per CI system, so each can be revoked alone); the ``key`` is
    in this answer only."""
    return issue_key(session, settings, tenant, body)


@tenant_router.get("", response_model=ApiKeysPublic)
def list_own_keys(session: SessionDep, tenant: CurrentTenant) -> ApiKeysPublic:
    """The caller's tenant's keys: names, prefixes, created/last used/revoked times; never a key."""
    return list_keys(session, tenant)


@tenant_router.delete("/{key_id}", response_model=ApiKeyPublic)
def revoke_own_key(request: Request, session: SessionDep, tenant: CurrentTenant, key_id: RowId) -> ApiKeyPublic:
    """Revokes one of the caller's tenant's keys (the caller's own too); it stops working at once."""
    return revoke_key(request, session, tenant, key_id)
