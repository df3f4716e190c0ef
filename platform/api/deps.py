"""Request dependencies as ``Annotated`` aliases. Tenant scoping lives here, in ``CurrentTenant`` and
``TenantAdapter``; handlers never filter by tenant themselves."""
from __future__ import annotations

import contextlib
import logging
from datetime import timedelta, timezone
from typing import Annotated, Iterator

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from loraplex.engine.config import ModelConfig
from loraplex.platform.api.errors import ApiError
from loraplex.platform.blobs.base import BlobStore
from loraplex.platform.core.config import Settings
from loraplex.platform.core.security import same_secret
from loraplex.platform.crud import adapters as adapters_crud
from loraplex.platform.crud import tenants as tenants_crud
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import Adapter, ApiKey, Tenant
from loraplex.platform.engines.limits import EngineLimits
from loraplex.platform.engines.notifier import EngineNotifier
from loraplex.platform.schemas.adapters import NAME_PATTERN

logger = logging.getLogger(__name__)
LAST_USED_GRANULARITY = timedelta(minutes=1)  # last_used_at is written at most this often per key
bearer = HTTPBearer(auto_error=False)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """The request's registry session. Closing it rolls back what the handler left open; when the database dropped
    the connection meanwhile that rollback fails, and the failure must neither replace the handler's own error
    (a 503 for the outage) nor hide its answer: the pool has already discarded the dead connection."""
    session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        try:
            session.close()
        except sa_exc.DBAPIError as e:
            logger.warning("closing the registry session of %s %s failed (the connection is gone): %s",
                           request.method, request.url.path, type(e.orig).__name__ if e.orig else type(e).__name__)
            with contextlib.suppress(sa_exc.SQLAlchemyError):
                session.invalidate()     # returns its connections to the pool as dead ones, without a ROLLBACK


def get_blob_store(request: Request) -> BlobStore:
    return request.app.state.blob_store


def get_notifier(request: Request) -> EngineNotifier:
    return request.app.state.notifier


def get_serving_limits(request: Request) -> EngineLimits | None:
    """The engines' serving limits (None without a running gateway or before any engine reported them)."""
    gateway = getattr(request.app.state, "gateway", None)
    return gateway.serving_limits if gateway is not None else None


def get_base_model(request: Request) -> ModelConfig:
    model = request.app.state.base_model
    if model is None:
        raise ApiError(503, "this deployment has no base model configured (LORAPLEX_BASE_MODEL_PATH); uploads are "
                            "unavailable until the operator sets it", code="no_base_model")
    return model


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
BlobStoreDep = Annotated[BlobStore, Depends(get_blob_store)]
NotifierDep = Annotated[EngineNotifier, Depends(get_notifier)]
BaseModelDep = Annotated[ModelConfig, Depends(get_base_model)]
ServingLimitsDep = Annotated[EngineLimits | None, Depends(get_serving_limits)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def _unauthorized(what: str) -> ApiError:
    return ApiError(401, f"missing or invalid {what}; send it as 'Authorization: Bearer <key>'",
                    code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def require_admin(settings: SettingsDep, credentials: Credentials) -> None:
    if credentials is None or not same_secret(credentials.credentials, settings.admin_key.get_secret_value()):
        raise _unauthorized("admin key")


def current_key(session: SessionDep, settings: SettingsDep, credentials: Credentials) -> ApiKey:
    """The caller's live API key (its tenant enabled); the key's id and name are what the history records."""
    if credentials is None:
        raise _unauthorized("API key")
    key = tenants_crud.authenticate_key(session=session, key=credentials.credentials,
                                        secret=settings.secret_key.get_secret_value())
    if key is None:
        raise _unauthorized("API key")
    if key.tenant.disabled:
        raise ApiError(403, "this tenant is disabled; contact the operator", code="tenant_disabled")
    touch_key(session, key)
    return key


def current_tenant(key: Annotated[ApiKey, Depends(current_key)]) -> Tenant:
    return key.tenant


def touch_key(session: Session, key) -> None:
    """Record that ``key`` was used (at most once per ``LAST_USED_GRANULARITY``)."""
    now, last = utcnow(), key.last_used_at
    if last is not None and last.tzinfo is None:  # SQLite hands back naive UTC
        last = last.replace(tzinfo=timezone.utc)
    if last is None or now - last > LAST_USED_GRANULARITY:
        key.last_used_at = now
        session.commit()


AdminKey = Annotated[None, Depends(require_admin)]
CurrentKey = Annotated[ApiKey, Depends(current_key)]
CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


def tenant_adapter(session: SessionDep, tenant: CurrentTenant,
                   name: Annotated[str, Path(pattern=NAME_PATTERN, examples=["support-bot"])]) -> Adapter:
    """The current tenant's adapter ``name``. Another tenant's adapter is a 404 like a missing one."""
    adapter = adapters_crud.get_adapter(session=session, tenant=tenant, name=name)
    if adapter is None:
        raise ApiError(404, f"adapter {name!r} not found", code="adapter_not_found")
    return adapter


TenantAdapter = Annotated[Adapter, Depends(tenant_adapter)]
