"""Usage: tokens and requests per UTC day and adapter. ``GET /v1/usage`` for the caller's tenant,
``GET /admin/usage`` across tenants (admin key). Buffered records are flushed first, so answers include every
request that has finished."""
from __future__ import annotations

from datetime import date
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from loraplex.platform.api.deps import AdminKey, CurrentTenant
from loraplex.platform.api.errors import ApiError
from loraplex.platform.usage import usage_summary
from loraplex.platform.usage.schemas import AdminUsagePublic, UsagePublic, UsageTotals

router = APIRouter(tags=["usage"])
Start = Annotated[date | None, Query(description="first UTC day, inclusive (YYYY-MM-DD)")]
End = Annotated[date | None, Query(description="last UTC day, inclusive (YYYY-MM-DD)")]


async def _rows(request: Request, tenant_id: str | None, start: date | None, end: date | None) -> list[dict]:
    if start and end and start > end:
        raise ApiError(400, f"start {start} is after end {end}; swap them", code="invalid_range")
    gw = getattr(request.app.state, "gateway", None)
    if gw is not None:
        await gw.usage.flush()
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
