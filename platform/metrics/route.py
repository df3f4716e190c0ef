"""``metrics_router()``: ``GET /metrics`` in Prometheus' text format, from ``app.state.metrics``. Each scrape first
refreshes the engine gauges through ``app.state.engine_stats_poller`` (at most once per ``max_age_s``)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4


def metrics_router(path: str = "/metrics", *, protect: bool = False) -> APIRouter:
    """The scrape route. ``protect``: require the admin key (``Authorization: Bearer``) on scrapes; off by default,
    for a Prometheus inside the cluster (keep the port off the public ingress)."""
    dependencies = []
    if protect:
        from loraplex.platform.api.deps import require_admin

        dependencies.append(Depends(require_admin))
    router = APIRouter(tags=["metrics"], dependencies=dependencies)

    @router.get(path, include_in_schema=False)
    async def scrape(request: Request) -> Response:
        poller = getattr(request.app.state, "engine_stats_poller", None)
        if poller is not None:
            await poller.refresh()
        return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    return router
