"""Dashboard fixtures: a small app with metrics, the dashboard and the admin API's error handlers."""
from __future__ import annotations

import pytest

ADMIN_KEY = "dashboard-admin-key-0123456789"


def make_app(quotas: dict | None = None, clock=None):
    from fastapi import FastAPI

    from loraplex.platform.api.errors import install_error_handlers
    from loraplex.platform.core.config import Settings
    from loraplex.platform.dashboard import install_dashboard
    from loraplex.platform.metrics import PlatformMetrics, install_metrics

    app = FastAPI()
    app.state.settings = Settings(environment="test", admin_key=ADMIN_KEY, secret_key="secret-" * 4)
    install_error_handlers(app)
    install_metrics(app, metrics=PlatformMetrics(clock=clock) if clock else None)
    install_dashboard(app, quota_source=lambda: dict(quotas or {}))
    return app


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def app(clock):
    return make_app({"acme": {"requests_per_minute": 60, "tokens_per_minute": 1000}}, clock=clock)
