"""Tenant API: upload, list, read, alias and delete adapters. Every route is scoped to the caller's tenant."""
from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Callable

import anyio

from fastapi import APIRouter, Header, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from loraplex.platform.api.deps import (BaseModelDep, BlobStoreDep, CurrentTenant, NotifierDep, ServingLimitsDep,
                                        SessionDep, SettingsDep, TenantAdapter)
from loraplex.platform.api.errors import ApiError
from loraplex.platform.crud import adapters as crud
from loraplex.platform.db.models import Adapter, AdapterStatus, AdapterVersion
from loraplex.platform.schemas.adapters import (ALIAS_PATTERN, NAME_PATTERN, AdapterPublic, AdaptersPublic,
                                                AdapterSummary, AdapterVersionPublic, AliasPublic, AliasUpdate)
from loraplex.platform.schemas.types import Limit, Offset, VersionNumber
from loraplex.platform.uploads.deletion import delete_versions, delete_whole_adapter
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.intake import spool_multipart
from loraplex.platform.uploads.service import find_idempotent, register_upload
from loraplex.platform.uploads.spool import spool_of
from loraplex.platform.uploads.validate import peft_files, validate_adapter

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])

UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["name", "files"], "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN, "example": "support-bot"},
        "files": {"type": "array", "items": {"type": "string", "format": "binary"},
                  "description": "adapter_config.json and adapter_model.safetensors as PEFT's save_pretrained "
                                 "wrote them, or one .tar.gz / .zip of that folder"}}},
    "encoding": {"files": {"contentType": "application/octet-stream"}}}}}}
ERRORS = {
    200: {"model": AdapterVersionPublic, "description": "a repeated request with the same Idempotency-Key: the "
                                                         "version the first one made (Idempotent-Replayed: true)"},
    400: {"description": "malformed upload or archive (path traversal, links, corrupt)"},
    401: {"description": "missing or invalid API key"},
    409: {"description": "an upload with this Idempotency-Key is in progress"},
    413: {"description": "over the size cap, or an archive that expands past it"},
    415: {"description": "not multipart/form-data"},
    422: {"description": "the adapter does not fit this deployment; the detail says what to fix",
          "content": {"application/json": {"example": {"error": {
              "message": "r: rank 128 exceeds this deployment's limit of 16; retrain with r <= 16",
              "type": "invalid_request_error", "param": None, "code": "rank_too_high"}}}}},
    503: {"description": "blob store or registry unavailable; nothing was stored, retry"},
}


async def off_loop(request: Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` in a worker thread of the upload pool: at most ``UPLOAD_VALIDATION_THREADS`` validations (archive
    unpacking, header and pattern checks, the NaN/Inf scan) at once, apart from the threads other routes use."""
    limiter = getattr(request.app.state, "upload_limiter", None)
    if limiter is None:
        limiter = request.app.state.upload_limiter = anyio.CapacityLimiter(
            request.app.state.settings.upload_validation_threads)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=limiter)


def version_public(adapter: Adapter, version: AdapterVersion) -> AdapterVersionPublic:
    return AdapterVersionPublic.model_validate({**{c: getattr(version, c) for c in AdapterVersionPublic.model_fields
                                                  if c != "adapter"}, "adapter": adapter.name})


@router.post("", status_code=201, response_model=AdapterVersionPublic, openapi_extra=UPLOAD_BODY, responses=ERRORS)
async def upload_adapter(request: Request, response: Response, session: SessionDep, settings: SettingsDep,
                         tenant: CurrentTenant, store: BlobStoreDep, model: BaseModelDep, limits: ServingLimitsDep,
                         idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> AdapterVersionPublic:
    """Uploads a new version of adapter ``name`` (created on first upload). It is validated before anything is
    stored; on success it is ``ready`` and the ``latest`` alias names it. With ``Idempotency-Key``, a repeated
    request returns the version the first one made (200, header ``Idempotent-Replayed: true``)."""
    with spool_of(request.app).upload_dir() as work:
        form = await spool_multipart(request.stream(), request.headers.get("content-type"),
                                     request.headers.get("content-length"), dest_dir=work,
                                     max_bytes=settings.max_upload_bytes)
        name = form.fields.get("name", "").strip()
        if not re.match(NAME_PATTERN, name):
            raise UploadError(422, f"form field 'name' must be 1-64 characters of a-z, 0-9, '.', '_', '-' starting "
                                   f"with a letter or digit (got {name!r})", code="bad_name")
        previous = await run_in_threadpool(find_idempotent, session=session, tenant=tenant, name=name,
                                           key=idempotency_key)
        if previous is not None:
            response.status_code = 200
            response.headers["Idempotent-Replayed"] = "true"
            return version_public(previous.adapter, previous)
        config_path, weights_path = await off_loop(request, peft_files, form, work, settings)
        validated = await off_loop(request, validate_adapter, config_path, weights_path, settings=settings,
                                   model=model, limits=limits)
        version = await run_in_threadpool(register_upload, session=session, store=store, tenant=tenant, name=name,
                                          adapter=validated, idempotency_key=idempotency_key,
                                          heartbeat_s=settings.upload_heartbeat_s)
    return version_public(version.adapter, version)


@router.get("", response_model=AdaptersPublic)
def list_adapters(session: SessionDep, tenant: CurrentTenant, offset: Offset = 0, limit: Limit = 50) -> AdaptersPublic:
    rows, count = crud.list_adapters(session=session, tenant=tenant, offset=offset, limit=limit)
    data = []
    for a in rows:
        aliases = crud.aliases_of(session=session, adapter=a)
        data.append(AdapterSummary(name=a.name, created_at=a.created_at, latest_version=aliases.get(crud.LATEST),
                                   aliases=aliases))
    return AdaptersPublic(data=data, count=count)


@router.get("/{name}", response_model=AdapterPublic)
def read_adapter(session: SessionDep, adapter: TenantAdapter) -> AdapterPublic:
    return AdapterPublic(name=adapter.name, created_at=adapter.created_at,
                         aliases=crud.aliases_of(session=session, adapter=adapter),
                         versions=[version_public(adapter, v) for v in adapter.versions])


@router.put("/{name}/aliases/{alias}", response_model=AliasPublic)
def set_alias(session: SessionDep, adapter: TenantAdapter, alias: Annotated[str, Path(pattern=ALIAS_PATTERN)],
              body: AliasUpdate) -> AliasPublic:
    """Points ``alias`` (e.g. ``prod``) at a ready version, atomically. ``latest`` follows uploads and cannot be set."""
    if alias == crud.LATEST:
        raise ApiError(422, "alias 'latest' always names the newest upload; choose another alias name",
                       code="reserved_alias")
    version = crud.get_version(session=session, adapter=adapter, number=body.version)
    if version is None:
        raise ApiError(404, f"adapter {adapter.name!r} has no version {body.version}", code="version_not_found")
    if version.status != AdapterStatus.ready:
        raise ApiError(409, f"version {body.version} is {version.status.value}; only ready versions can be aliased",
                       code="version_not_ready")
    crud.set_alias(session=session, adapter=adapter, alias=alias, version=version)
    session.commit()
    return AliasPublic(adapter=adapter.name, alias=alias, version=version.number)


@router.delete("/{name}", status_code=204)
def delete_adapter(session: SessionDep, adapter: TenantAdapter, store: BlobStoreDep, notifier: NotifierDep) -> None:
    """Deletes every version and the name; engines evict it and the blobs are removed."""
    delete_whole_adapter(session=session, store=store, notifier=notifier, adapter=adapter)


@router.delete("/{name}/versions/{number}", status_code=204)
def delete_version(session: SessionDep, adapter: TenantAdapter, store: BlobStoreDep, notifier: NotifierDep,
                   number: VersionNumber) -> None:
    """Deletes one version (its aliases go; ``latest`` moves to the newest ready version)."""
    version = crud.get_version(session=session, adapter=adapter, number=number)
    if version is None:
        raise ApiError(404, f"adapter {adapter.name!r} has no version {number}", code="version_not_found")
    delete_versions(session=session, store=store, notifier=notifier, adapter=adapter, versions=[version])
