"""``metrics_router()``: ``GET /metrics`` in Prometheus' text format, from ``app.state.metrics``. Each scrape first
refreshes the engine gauges through ``app.state.engine_stats_poller`` (at most once per ``max_age_s``).

The samples name tenants and adapters, so on the API port the route is protected: ``Authorization: Bearer`` with the
admin key or ``LORAPLEX_METRICS_TOKEN`` (401 otherwise). ``metrics_server.py`` serves the same scrape without auth on
``LORAPLEX_METRICS_PORT``, bound to ``LORAPLEX_METRICS_HOST`` (default 127.0.0.1; the chart binds a pod port that only
its metrics Service exposes)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

_bearer = HTTPBearer(auto_error=False)


def require_scrape_token(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """The admin key or the metrics token as a bearer token; 401 otherwise."""
    from loraplex.platform.api.errors import ApiError
    from loraplex.platform.core.security import same_secret

    settings = request.app.state.settings
    given = credentials.credentials if credentials is not None else ""
    accepted = [settings.admin_key.get_secret_value()]
    if settings.metrics_token is not None:
        accepted.append(settings.metrics_token.get_secret_value())
    if not given or not any(same_secret(given, secret) for secret in accepted if secret):
        raise ApiError(401, "missing or invalid admin key or metrics token; send it as 'Authorization: Bearer "
                            "<key>' (LORAPLEX_METRICS_TOKEN), or scrape the metrics port (LORAPLEX_METRICS_PORT)",
                       code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def metrics_router(path: str = "/metrics", *, protect: bool = False) -> APIRouter:
    """The scrape route. ``protect``: require the admin key or the metrics token (``Authorization: Bearer``)."""
    router = APIRouter(tags=["metrics"], dependencies=[Depends(require_scrape_token)] if protect else [])

    @router.get(path, include_in_schema=False)
    async def scrape(request: Request) -> Response:
        poller = getattr(request.app.state, "engine_stats_poller", None)
        if poller is not None:
            await poller.refresh()
        return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    return router
