"""Per-tenant limits for the dashboard's "usage against quota" chart: the tenants' own limits from the registry,
else the deployment defaults (``LORAPLEX_DEFAULT_*``), cached for a few seconds."""
from __future__ import annotations

import time
from typing import Any, Callable

from sqlalchemy import select

from loraplex.platform.db.models import Tenant

QuotaSource = Callable[[], dict[str, dict[str, int | None]]]
MAX_TENANTS = 500


def registry_quota_source(sessionmaker: Any, settings: Any, *, ttl_s: float = 5.0,
                          clock: Callable[[], float] = time.monotonic) -> QuotaSource:
    """``{tenant name: {"requests_per_minute", "tokens_per_minute"}}`` (None = unlimited) from the tenants table."""
    cache: dict[str, Any] = {"at": None, "value": {}}

    def load() -> dict[str, dict[str, int | None]]:
        now = clock()
        if cache["at"] is not None and now - cache["at"] < ttl_s:
            return cache["value"]
        stmt = (select(Tenant.name, Tenant.requests_per_minute, Tenant.tokens_per_minute)
                .order_by(Tenant.name).limit(MAX_TENANTS))
        with sessionmaker() as session:
            rows = session.execute(stmt).all()
        value = {name: {"requests_per_minute": rpm if rpm is not None else settings.default_requests_per_minute,
                        "tokens_per_minute": tpm if tpm is not None else settings.default_tokens_per_minute}
                 for name, rpm, tpm in rows}
        cache["at"], cache["value"] = now, value
        return value
    return load
