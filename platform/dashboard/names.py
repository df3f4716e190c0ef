"""Names for the dashboard: the registry's tenant and adapter names and version numbers of the engine adapter ids
(``<tenant id>/<adapter>/<version id>``) that replicas report resident, and the adapter list and version history
of the "Adapters" view. Blocking: the routes call these in a worker thread."""
from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from loraplex.platform.crud import adapters as crud
from loraplex.platform.crud.history import version_history
from loraplex.platform.db.models import Adapter, AdapterVersion, Tenant

MAX_LISTED = 100


def resident_names(sessionmaker: Any, adapter_ids: list[str]) -> dict[str, dict]:
    """``{adapter id: {"tenant", "adapter", "version"}}`` for the ids whose version row exists."""
    version_ids = {a.rsplit("/", 1)[-1]: a for a in adapter_ids if a.count("/") == 2}
    if not version_ids:
        return {}
    with sessionmaker() as session:
        rows = session.execute(select(AdapterVersion.id, Tenant.name, Adapter.name, AdapterVersion.number)
                               .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
                               .join(Tenant, Tenant.id == AdapterVersion.tenant_id)
                               .where(AdapterVersion.id.in_(list(version_ids)))).all()
    return {version_ids[vid]: {"tenant": tenant, "adapter": adapter, "version": number}
            for vid, tenant, adapter, number in rows}


def adapter_list(sessionmaker: Any, *, tenant: str | None = None, limit: int = MAX_LISTED) -> list[dict]:
    """The most recently changed adapters (of one tenant by name, or all): id, tenant, name, aliases, versions."""
    with sessionmaker() as session:
        versions = (select(AdapterVersion.adapter_id, func.count().label("n"),
                           func.max(AdapterVersion.updated_at).label("changed"))
                    .group_by(AdapterVersion.adapter_id).subquery())
        query = (select(Adapter, Tenant.name, versions.c.n, versions.c.changed)
                 .join(Tenant, Tenant.id == Adapter.tenant_id)
                 .join(versions, versions.c.adapter_id == Adapter.id, isouter=True)
                 .order_by(func.coalesce(versions.c.changed, Adapter.updated_at).desc(), Adapter.name).limit(limit))
        if tenant:
            query = query.where(Tenant.name == tenant)
        out = []
        for adapter, tenant_name, n, changed in session.execute(query).all():
            aliases = crud.aliases_of(session=session, adapter=adapter)
            out.append({"id": adapter.id, "tenant": tenant_name, "adapter": adapter.name,
                        "latest_version": aliases.get(crud.LATEST), "aliases": aliases, "versions": int(n or 0),
                        "changed_at": (changed or adapter.updated_at).isoformat()})
    return out


def adapter_history(sessionmaker: Any, adapter_id: str) -> dict | None:
    """``{"tenant", **VersionHistory}`` of one adapter by row id, or None."""
    with sessionmaker() as session:
        adapter = session.get(Adapter, adapter_id)
        if adapter is None:
            return None
        tenant = session.get(Tenant, adapter.tenant_id)
        return {"tenant": tenant.name if tenant else None,
                **version_history(session=session, adapter=adapter).model_dump(mode="json")}
