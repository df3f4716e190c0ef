"""The admin dashboard: one page with live charts (Chart.js, shipped in ``static/vendor``; no CDN), polling
``/admin/dashboard/data``. Sign in once with the admin key (the login form) or a one-time link; an HttpOnly cookie
with a server-side session follows (``auth.py``, ``sessions.py``). Installing it also redacts credential-like query
parameters from uvicorn's access log (``core/access_log.py``).

    install_metrics(app)       # loraplex.platform.metrics, first: the dashboard reads app.state.metrics
    install_dashboard(app)
"""
from __future__ import annotations

from importlib import resources
from typing import Any

from loraplex.platform.dashboard.data import dashboard_data
from loraplex.platform.dashboard.quotas import QuotaSource, registry_quota_source

__all__ = ["dashboard_data", "install_dashboard", "registry_quota_source", "QuotaSource"]


def install_dashboard(app: Any, *, quota_source: QuotaSource | None = None) -> None:
    """Mount the dashboard on ``app`` (after ``install_metrics``). ``quota_source``: tenant limits for the usage
    chart; default: the tenants table through ``app.state.sessionmaker`` and ``app.state.settings``."""
    from fastapi.staticfiles import StaticFiles

    from loraplex.platform.dashboard.routes import PAGE, router

    if getattr(app.state, "metrics", None) is None:
        raise RuntimeError("install_dashboard needs app.state.metrics: call "
                           "loraplex.platform.metrics.install_metrics(app) first")
    if quota_source is None and getattr(app.state, "sessionmaker", None) is not None:
        quota_source = registry_quota_source(app.state.sessionmaker, app.state.settings)
    app.state.dashboard_quota_source = quota_source
    from loraplex.platform.core import access_log

    access_log.install()
    static = str(resources.files("loraplex.platform.dashboard").joinpath("static"))
    app.include_router(router)
    app.mount(f"{PAGE}/static", StaticFiles(directory=static), name="dashboard-static")
