"""Usage read back: tokens and requests per (tenant, UTC day, adapter), for a tenant or across tenants."""
from __future__ import annotations

from datetime import date

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import Tenant, UsageRecord


def usage_query(tenant_id: str | None, start: date | None, end: date | None) -> Select:
    """Requests and token sums per (tenant, day, adapter), as rows ``(tenant_id, tenant name, day, adapter, requests,
    prompt tokens, completion tokens)`` ordered by day, tenant name and adapter; ``tenant_id`` None = every tenant,
    ``start``/``end`` inclusive UTC days."""
    query = (select(UsageRecord.tenant_id, Tenant.name, UsageRecord.day, UsageRecord.adapter_name,
                    func.count(), func.sum(UsageRecord.prompt_tokens), func.sum(UsageRecord.completion_tokens))
             .join(Tenant, Tenant.id == UsageRecord.tenant_id)
             .group_by(UsageRecord.tenant_id, Tenant.name, UsageRecord.day, UsageRecord.adapter_name)
             .order_by(UsageRecord.day, Tenant.name, UsageRecord.adapter_name))
    if tenant_id is not None:
        query = query.where(UsageRecord.tenant_id == tenant_id)
    if start is not None:
        query = query.where(UsageRecord.day >= start)
    if end is not None:
        query = query.where(UsageRecord.day <= end)
    return query


def usage_summary(*, session: Session, tenant_id: str | None, start: date | None = None,
                  end: date | None = None) -> list[dict]:
    """Rows ``{tenant_id, tenant, day, adapter, requests, prompt_tokens, completion_tokens, total_tokens}``
    ordered by day, tenant and adapter (``adapter`` None = the base model). ``tenant_id`` None = every tenant;
    ``start``/``end`` are inclusive UTC days."""
    return [{"tenant_id": tid, "tenant": name, "day": day, "adapter": adapter, "requests": int(n),
             "prompt_tokens": int(p or 0), "completion_tokens": int(c or 0), "total_tokens": int((p or 0) + (c or 0))}
            for tid, name, day, adapter, n, p, c in session.execute(usage_query(tenant_id, start, end))]
