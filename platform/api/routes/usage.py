"""Usage: tokens and requests per UTC day and adapter. ``GET /v1/usage`` for the caller's tenant,
``GET /admin/usage`` across tenants (admin key); ``GET /v1/usage/export`` and ``GET /admin/usage/export`` stream
the same per (day, tenant, adapter) as CSV or JSON for billing (``usage/export.py``). Buffered records are flushed
first, so answers include every request that has finished."""
from __future__ import annotations

from datetime import date
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from loraplex.platform.api.deps import AdminKey, CurrentTenant
from loraplex.platform.api.errors import ApiError
from loraplex.platform.usage import usage_summary
from loraplex.platform.usage.export import csv_lines, json_chunks
from loraplex.platform.usage.schemas import AdminUsagePublic, UsagePublic, UsageTotals

router = APIRouter(tags=["usage"])
Start = Annotated[date | None, Query(description="first UTC day, inclusive (YYYY-MM-DD)")]
End = Annotated[date | None, Query(description="last UTC day, inclusive (YYYY-MM-DD)")]


From = Annotated[date | None, Query(alias="from", description="first UTC day, inclusive (YYYY-MM-DD)")]
To = Annotated[date | None, Query(alias="to", description="last UTC day, inclusive (YYYY-MM-DD)")]
Format = Annotated[Literal["csv", "json"], Query(description="csv (a header line, one row per day, tenant and "
                                                             "adapter) or json")]


async def _flush(request: Request) -> None:
    gw = getattr(request.app.state, "gateway", None)
    if gw is not None:
        await gw.usage.flush()


def _check_range(start: date | None, end: date | None, names: tuple[str, str] = ("start", "end")) -> None:
    if start and end and start > end:
        raise ApiError(400, f"{names[0]} {start} is after {names[1]} {end}; swap them", code="invalid_range",
                       param=names[0])


async def _rows(request: Request, tenant_id: str | None, start: date | None, end: date | None) -> list[dict]:
    _check_range(start, end)
    await _flush(request)
    sessions = request.app.state.sessionmaker

    def query() -> list[dict]:
        with sessions() as session:
            return usage_summary(session=session, tenant_id=tenant_id, start=start, end=end)
    return await run_in_threadpool(query)


@router.get("/v1/usage", response_model=UsagePublic)
async def tenant_usage(request: Request, tenant: CurrentTenant, start: Start = None, end: End = None) -> UsagePublic:
    """The caller's usage per UTC day and adapter (``adapter`` null = the base model)."""
    rows = await _rows(request, tenant.id, start, end)
    return UsagePublic(data=rows, totals=UsageTotals.of(rows))


@router.get("/admin/usage", response_model=AdminUsagePublic)
async def admin_usage(request: Request, _: AdminKey,
                      tenant_id: Annotated[str | None, Query(max_length=64, description="one tenant's id")] = None,
                      start: Start = None,
                      end: End = None) -> AdminUsagePublic:
    """Every tenant's usage per UTC day and adapter (or one tenant's with ``tenant_id``)."""
    rows = await _rows(request, tenant_id, start, end)
    return AdminUsagePublic(data=rows, totals=UsageTotals.of(rows))


async def _export(request: Request, tenant_id: str | None, fmt: str, start: date | None,
                  end: date | None) -> StreamingResponse:
    _check_range(start, end, ("from", "to"))
    await _flush(request)
    sessions = request.app.state.sessionmaker
    span = f"{start or 'start'}_{end or 'now'}"
    if fmt == "csv":
        body, media = csv_lines(sessions, tenant_id=tenant_id, start=start, end=end), "text/csv; charset=utf-8"
    else:
        body, media = json_chunks(sessions, tenant_id=tenant_id, start=start, end=end), "application/json"
    return StreamingResponse(body, media_type=media, headers={
        "Content-Disposition": f'attachment; filename="loraplex-usage-{span}.{fmt}"', "Cache-Control": "no-store"})


EXPORT = {200: {"description": "the rows, streamed", "content": {"text/csv": {"example": (
    "day,tenant_id,tenant,adapter,requests,prompt_tokens,completion_tokens,total_tokens\r\n"
    "2026-11-29,4f1c...,acme,support-bot,1200,360000,240000,600000\r\n")}, "application/json": {}}}}


@router.get("/v1/usage/export", response_class=StreamingResponse, responses=EXPORT)
async def tenant_usage_export(request: Request, tenant: CurrentTenant, format: Format = "csv", start: From = None,
                              end: To = None) -> StreamingResponse:
    """The caller's usage per UTC day and adapter as CSV or JSON, for billing (``adapter`` empty / null: the base
    model)."""
    return await _export(request, tenant.id, format, start, end)


@router.get("/admin/usage/export", response_class=StreamingResponse, responses=EXPORT)
async def admin_usage_export(request: Request, _: AdminKey, format: Format = "csv", start: From = None,
                             end: To = None,
                             tenant_id: Annotated[str | None, Query(max_length=64, description="one tenant's id")]
                             = None) -> StreamingResponse:
    """Every tenant's usage (or one tenant's) per UTC day and adapter as CSV or JSON, for billing."""
    return await _export(request, tenant_id, format, start, end)
