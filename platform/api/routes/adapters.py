"""Tenant API: upload, list, read, alias, roll back and delete adapters, and read their history. Every route is
scoped to the caller's tenant (``TenantAdapter``); the API key that acts is recorded in the history."""
from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Callable

import anyio

from fastapi import APIRouter, Header, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from loraplex.platform.api.deps import (BaseModelDep, BlobStoreDep, CurrentKey, CurrentTenant, NotifierDep,
                                        ServingLimitsDep, SessionDep, SettingsDep, TenantAdapter)
from loraplex.platform.api.errors import ApiError
from loraplex.platform.crud import adapters as crud
from loraplex.platform.crud.history import version_history
from loraplex.platform.db.models import Adapter, AdapterStatus, AdapterVersion, ApiKey
from loraplex.platform.engines.notifier import Promotion, promote
from loraplex.platform.metrics.middleware import note_upload
from loraplex.platform.schemas.adapters import (ALIAS_PATTERN, NAME_PATTERN, AdapterPublic, AdaptersPublic,
                                                AdapterSummary, AdapterVersionPublic, AliasPublic, AliasUpdate,
                                                RollbackRequest, VersionHistory)
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
                                                         "version the first one made (Idempotent-Replayed: true); or "
                                                         "the same weights and config as a ready version of this "
                                                         "adapter: that version (Loraplex-Deduplicated: true)"},
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


DEDUPLICATED = "Loraplex-Deduplicated"
AliasName = Annotated[str, Path(pattern=ALIAS_PATTERN, examples=["prod"])]


def version_public(adapter: Adapter, version: AdapterVersion) -> AdapterVersionPublic:
    return AdapterVersionPublic.model_validate({**{c: getattr(version, c) for c in AdapterVersionPublic.model_fields
                                                  if c != "adapter"}, "adapter": adapter.name})


@router.post("", status_code=201, response_model=AdapterVersionPublic, openapi_extra=UPLOAD_BODY, responses=ERRORS)
async def upload_adapter(request: Request, response: Response, session: SessionDep, settings: SettingsDep,
                         key: CurrentKey, store: BlobStoreDep, model: BaseModelDep, limits: ServingLimitsDep,
                         idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> AdapterVersionPublic:
    """Uploads a new version of adapter ``name`` (created on first upload). It is validated before anything is
    stored; on success it is ``ready`` and the ``latest`` alias names it. With ``Idempotency-Key``, a repeated
    request returns the version the first one made (200, header ``Idempotent-Replayed: true``). The same weights
    and config as a ready version of the adapter answer that version (200, ``Loraplex-Deduplicated: true``;
    nothing is stored and no alias moves)."""
    tenant = key.tenant
    note_upload(request, tenant=tenant.name)
    with spool_of(request.app).upload_dir() as work:
        form = await spool_multipart(request.stream(), request.headers.get("content-type"),
                                     request.headers.get("content-length"), dest_dir=work,
                                     max_bytes=settings.max_upload_bytes)
        name = form.fields.get("name", "").strip()
        if not re.match(NAME_PATTERN, name):
            raise UploadError(422, f"form field 'name' must be 1-64 characters of a-z, 0-9, '.', '_', '-' starting "
                                   f"with a letter or digit (got {name!r})", code="bad_name")
        note_upload(request, adapter=name)
        previous = await run_in_threadpool(find_idempotent, session=session, tenant=tenant, name=name,
                                           key=idempotency_key)
        if previous is not None:
            note_upload(request, version=previous.number)
            response.status_code = 200
            response.headers["Idempotent-Replayed"] = "true"
            return version_public(previous.adapter, previous)
        config_path, weights_path = await off_loop(request, peft_files, form, work, settings)
        validated = await off_loop(request, validate_adapter, config_path, weights_path, settings=settings,
                                   model=model, limits=limits)
        result = await run_in_threadpool(register_upload, session=session, store=store, tenant=tenant, name=name,
                                         adapter=validated, idempotency_key=idempotency_key,
                                         heartbeat_s=settings.upload_heartbeat_s, created_by_key_id=key.id)
    note_upload(request, version=result.version.number)
    if result.deduplicated:
        response.status_code = 200
        response.headers[DEDUPLICATED] = "true"
    return version_public(result.version.adapter, result.version)


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


@router.get("/{name}/versions", response_model=VersionHistory)
def read_versions(session: SessionDep, adapter: TenantAdapter) -> VersionHistory:
    """Every version of the adapter, newest first: number, status, sha256, size, when and by which API key it was
    uploaded (or imported, with its source) and deleted, and the aliases naming it now; then each alias with when
    and by which key it last moved."""
    return version_history(session=session, adapter=adapter)


def _ready_version(session, adapter: Adapter, number: int, what: str) -> AdapterVersion:
    version = crud.get_version(session=session, adapter=adapter, number=number)
    if version is None:
        raise ApiError(404, f"adapter {adapter.name!r} has no version {number}", code="version_not_found",
                       param="version")
    if version.status != AdapterStatus.ready:
        raise ApiError(409, f"version {number} is {version.status.value}; only ready versions can {what}",
                       code="version_not_ready", param="version")
    return version


def _move_alias(session, notifier, adapter: Adapter, alias: str, version: AdapterVersion, key: ApiKey) -> AliasPublic:
    """Points ``alias`` at ``version`` (one upsert, committed), then lets engines warm the new target."""
    previous = crud.alias_version(session=session, adapter=adapter, alias=alias)
    crud.set_alias(session=session, adapter=adapter, alias=alias, version=version, by_key_id=key.id)
    session.commit()
    if previous is None or previous.id != version.id:
        promote(notifier, [Promotion(tenant_id=adapter.tenant_id, adapter_name=adapter.name, alias=alias,
                                     version_id=version.id,
                                     previous_version_id=previous.id if previous is not None else None)])
    return AliasPublic(adapter=adapter.name, alias=alias, version=version.number,
                       previous_version=previous.number if previous is not None else None)


@router.put("/{name}/aliases/{alias}", response_model=AliasPublic)
def set_alias(session: SessionDep, adapter: TenantAdapter, key: CurrentKey, notifier: NotifierDep, alias: AliasName,
              body: AliasUpdate) -> AliasPublic:
    """Points ``alias`` (e.g. ``prod``) at a ready version, atomically: requests naming ``name:<alias>`` get the
    new version from the next one on. ``latest`` may be set too (that is a rollback: the bare name serves it);
    the next upload moves ``latest`` to itself again."""
    version = _ready_version(session, adapter, body.version, "be aliased")
    return _move_alias(session, notifier, adapter, alias, version, key)


@router.delete("/{name}/aliases/{alias}", status_code=204)
def delete_alias(session: SessionDep, adapter: TenantAdapter, alias: AliasName) -> None:
    """Removes an alias; requests naming ``name:<alias>`` answer 404 from then on. ``latest`` cannot be removed
    (the bare name serves it): point it at another version, or delete the adapter."""
    if alias == crud.LATEST:
        raise ApiError(422, "alias 'latest' cannot be removed: the bare adapter name serves it; point it at another "
                            "version (PUT .../aliases/latest or POST .../rollback) or delete the adapter",
                       code="reserved_alias")
    if not crud.delete_alias(session=session, adapter=adapter, alias=alias):
        raise ApiError(404, f"adapter {adapter.name!r} has no alias {alias!r}", code="alias_not_found")
    session.commit()


@router.post("/{name}/rollback", response_model=AliasPublic)
def rollback(session: SessionDep, adapter: TenantAdapter, key: CurrentKey, notifier: NotifierDep,
             body: RollbackRequest) -> AliasPublic:
    """Points ``latest`` (and so the bare adapter name) at an earlier (or any) ready version; the same as
    ``PUT /v1/adapters/{name}/aliases/latest``. Newer versions stay and can be promoted back."""
    version = _ready_version(session, adapter, body.version, "be rolled back to")
    return _move_alias(session, notifier, adapter, crud.LATEST, version, key)


@router.delete("/{name}", status_code=204)
def delete_adapter(session: SessionDep, adapter: TenantAdapter, key: CurrentKey, store: BlobStoreDep,
                   notifier: NotifierDep) -> None:
    """Deletes every version, every alias and the name; engines evict it and every blob any version recorded or
    intended is removed. Store down: 503, the versions stay deleted; repeat to finish."""
    delete_whole_adapter(session=session, store=store, notifier=notifier, adapter=adapter, by_key_id=key.id)


@router.delete("/{name}/versions/{number}", status_code=204)
def delete_version(session: SessionDep, adapter: TenantAdapter, key: CurrentKey, store: BlobStoreDep,
                   notifier: NotifierDep, number: VersionNumber,
                   keep_adapter: Annotated[bool, Query(description="keep the adapter (its history, its numbering) "
                                                                   "when this was its last version")] = False) -> None:
    """Deletes one version (its aliases go; ``latest`` moves to the newest ready version). When it was the last
    ready version the adapter goes with it (the name is freed and numbering starts again) unless
    ``keep_adapter=true``, which keeps it listed, with ``latest_version: null``, until the next upload."""
    version = crud.get_version(session=session, adapter=adapter, number=number)
    if version is None:
        raise ApiError(404, f"adapter {adapter.name!r} has no version {number}", code="version_not_found")
    delete_versions(session=session, store=store, notifier=notifier, adapter=adapter, versions=[version],
                    by_key_id=key.id, keep_adapter=keep_adapter)
