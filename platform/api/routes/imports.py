"""Tenant API: imports by reference (``uploads/imports.py``, ``uploads/sources.py``).

    POST /v1/adapters/import     {"name", "source": "s3://bucket/prefix/" | "https://host/path/", "credentials"?}
                                 201 done (the version), 200 replayed or identical, 202 still running (Location)
    GET  /v1/imports/{id}        one import (poll until "succeeded" or "failed")
    GET  /v1/imports             the tenant's last imports, newest first
"""
from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from loraplex.platform.api.deps import BaseModelDep, CurrentKey, CurrentTenant, ServingLimitsDep, SessionDep
from loraplex.platform.api.errors import ApiError
from loraplex.platform.api.routes.adapters import version_public
from loraplex.platform.db.models import AdapterImport, ImportStatus
from loraplex.platform.schemas.imports import ImportError_, ImportPublic, ImportRequest, ImportsPublic
from loraplex.platform.schemas.types import RowId
from loraplex.platform.uploads import imports as jobs
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.sources import Credentials, check_http, check_s3, parse_source

router = APIRouter(tags=["adapters"])
ERRORS = {
    200: {"model": ImportPublic, "description": "a repeated request with the same Idempotency-Key (its import), or "
                                                "an adapter identical to a ready version (that version)"},
    202: {"model": ImportPublic, "description": "still running: poll the Location (GET /v1/imports/{id})"},
    400: {"description": "a source that is not s3:// or https://, or holds credentials"},
    403: {"description": "a host, bucket or endpoint the operator does not allow, a non-public address, or the "
                         "source refused the credentials"},
    413: {"description": "a file at the source over the size cap"},
    422: {"description": "the files are missing at the source, or the adapter does not fit this deployment"},
    503: {"description": "the source or the blob store is unavailable; nothing was stored, retry"},
}


def import_public(row: AdapterImport) -> ImportPublic:
    version = row.version
    return ImportPublic(
        id=row.id, adapter=row.adapter_name, source=row.source, status=row.status.value,
        bytes_received=row.bytes_received or 0,
        version=version_public(version.adapter, version) if version is not None else None,
        deduplicated=bool(row.deduplicated),
        error=ImportError_(message=row.error, code=row.error_code, status=row.error_status) if row.error else None,
        created_at=row.created_at, updated_at=row.updated_at)


def _answer(row: AdapterImport, response: Response, created: bool) -> ImportPublic:
    """201 / 200 for a finished import, the error for a failed one, 202 while it runs."""
    response.headers["Location"] = f"/v1/imports/{row.id}"
    if row.status == ImportStatus.failed:
        headers = {"Location": response.headers["Location"]}
        if row.error_status == 503:
            headers["Retry-After"] = "5"
        raise ApiError(row.error_status or 500, row.error or "the import failed", code=row.error_code or "import_failed",
                       headers=headers)
    if row.status == ImportStatus.running:
        response.status_code = 202
    else:
        response.status_code = 201 if created and not row.deduplicated else 200
    return import_public(row)


@router.post("/v1/adapters/import", status_code=201, response_model=ImportPublic, responses=ERRORS)
async def import_adapter(request: Request, response: Response, session: SessionDep, key: CurrentKey,
                         model: BaseModelDep, limits: ServingLimitsDep, body: ImportRequest,
                         idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> ImportPublic:
    """Fetches a Hub-layout folder (``adapter_config.json`` + ``adapter_model.safetensors``) from ``source`` and
    stores it as a new version of ``name``, through the upload's checks, size caps, crash safety and dedupe.
    Answers the result if it is done within ``IMPORT_WAIT_S`` (201), else 202 with the import to poll."""
    settings = request.app.state.settings
    tenant = key.tenant
    source = parse_source(body.source)
    creds = Credentials(**body.credentials.model_dump()) if body.credentials else None
    if source.scheme == "s3":
        check_s3(source, settings, creds)
    else:
        if creds is not None and (creds.aws_access_key_id or creds.endpoint_url):
            raise UploadError(400, "S3 credentials were sent for an HTTPS source; send bearer_token only",
                              code="bad_source")
        check_http(source, settings)
    if idempotency_key:
        previous = await run_in_threadpool(jobs.find_by_key, session=session, tenant_id=tenant.id,
                                           key=idempotency_key)
        if previous is not None:
            if previous.adapter_name != body.name or previous.source != source.uri:
                raise UploadError(422, f"Idempotency-Key {idempotency_key!r} was already used for another import; "
                                       "use a new key", code="idempotency_key_reused")
            await run_in_threadpool(jobs.expire_stale, session=session, row=previous,
                                    stale_after_s=settings.upload_stale_after_s)
            if previous.status != ImportStatus.failed:
                response.headers["Idempotent-Replayed"] = "true"
                return _answer(previous, response, created=False)
            previous.idempotency_key = None            # a failed import may be retried under the same key
            await run_in_threadpool(session.commit)
    row = await run_in_threadpool(jobs.create_import, session=session, tenant=tenant, key_id=key.id, name=body.name,
                                  source=source, idempotency_key=idempotency_key)
    task = jobs.start_import(request.app, import_id=row.id, tenant_id=tenant.id, key_id=key.id, name=body.name,
                             source=source, credentials=creds, limits=limits)
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout=settings.import_wait_s)
    except asyncio.TimeoutError:
        pass
    await run_in_threadpool(session.refresh, row)
    return _answer(row, response, created=True)


@router.get("/v1/imports/{import_id}", response_model=ImportPublic)
def read_import(request: Request, session: SessionDep, tenant: CurrentTenant, import_id: RowId) -> ImportPublic:
    """One import of the caller's tenant: ``running`` (with ``bytes_received``), ``succeeded`` (with its
    ``version``) or ``failed`` (with its ``error``)."""
    row = jobs.get_import(session=session, tenant_id=tenant.id, import_id=import_id,
                          stale_after_s=request.app.state.settings.upload_stale_after_s)
    if row is None:
        raise ApiError(404, f"import {import_id!r} not found", code="import_not_found")
    return import_public(row)


@router.get("/v1/imports", response_model=ImportsPublic)
def list_imports(request: Request, session: SessionDep, tenant: CurrentTenant,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ImportsPublic:
    rows = jobs.list_imports(session=session, tenant_id=tenant.id, limit=limit,
                             stale_after_s=request.app.state.settings.upload_stale_after_s)
    return ImportsPublic(data=[import_public(r) for r in rows])
