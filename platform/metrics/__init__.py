"""Prometheus metrics of the control plane and its engines, on a registry of their own.

    label_limiter.py     LabelLimiter: top-K adapters by traffic keep their name, the rest are "_other"
    config.py            MetricsConfig: label caps, buckets, dashboard window
    platform_metrics.py  PlatformMetrics: the metrics + observe_request / observe_quota_rejection / observe_upload
    window.py            RecentWindow: the last minutes per second, for the dashboard
    uploads.py           UploadTracker: uploads in flight (bytes, stage) and the last finished ones
    middleware.py        UploadMetricsMiddleware: counts POST /v1/adapters outcomes and progress by itself
    poller.py            EngineStatsPoller: engine stats dicts -> engine gauges
    sources.py           inprocess_source / http_source for the poller
    route.py             metrics_router(): GET /metrics (bearer admin key or metrics token on the API port)
    metrics_server.py    MetricsServer: the same scrape without auth on LORAPLEX_METRICS_PORT

One call wires it into an app: ``install_metrics(app, engine_sources={"engine-0": inprocess_source(engine)})``.
"""
from __future__ import annotations

from typing import Any, Mapping

from loraplex.platform.metrics.config import MetricsConfig
from loraplex.platform.metrics.label_limiter import OTHER, LabelLimiter
from loraplex.platform.metrics.middleware import UploadMetricsMiddleware
from loraplex.platform.metrics.platform_metrics import BASE, UNRESOLVED, PlatformMetrics
from loraplex.platform.metrics.poller import EngineStatsPoller, StatsSource
from loraplex.platform.metrics.route import metrics_router
from loraplex.platform.metrics.sources import client_source, http_source, inprocess_source

__all__ = ["BASE", "OTHER", "UNRESOLVED", "EngineStatsPoller", "LabelLimiter", "MetricsConfig", "PlatformMetrics",
           "StatsSource", "UploadMetricsMiddleware", "client_source", "http_source", "inprocess_source",
           "install_metrics", "metrics_router"]


def install_metrics(app: Any, *, config: MetricsConfig | None = None, metrics: PlatformMetrics | None = None,
                    engine_sources: Mapping[str, StatsSource] | None = None, path: str = "/metrics",
                    protect: bool | None = None, upload_path: str = "/v1/adapters") -> PlatformMetrics:
    """Wire metrics into a FastAPI ``app`` (before it starts): ``app.state.metrics`` (a ``PlatformMetrics``),
    ``app.state.engine_stats_poller`` (an ``EngineStatsPoller`` over ``engine_sources``; add more later with
    ``add_source``), the scrape route at ``path`` and the upload middleware. Returns the metrics (``metrics``, if
    given, instead of a new ``PlatformMetrics(config)``).

    ``protect`` (default: when the app has ``state.settings``, as the platform app always does): the scrape needs
    the admin key or ``LORAPLEX_METRICS_TOKEN``. With ``settings.metrics_port`` the app's lifespan also serves the
    scrape without auth on ``settings.metrics_host:metrics_port``."""
    if metrics is None:
        metrics = PlatformMetrics(config)
    elif config is not None:
        raise ValueError("pass either config or metrics (whose config is fixed), not both")
    settings = getattr(app.state, "settings", None)
    app.state.metrics = metrics
    app.state.engine_stats_poller = EngineStatsPoller(metrics, engine_sources)
    app.include_router(metrics_router(path, protect=settings is not None if protect is None else protect))
    app.add_middleware(UploadMetricsMiddleware, metrics=metrics, path=upload_path)
    if settings is not None and settings.metrics_port:
        _serve_metrics_port(app, settings.metrics_host, settings.metrics_port)
    return metrics


def _serve_metrics_port(app: Any, host: str, port: int) -> None:
    import contextlib

    from loraplex.platform.metrics.metrics_server import MetricsServer

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        server = MetricsServer(a, host, port)
        await server.start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            await server.stop()

    app.router.lifespan_context = lifespan
