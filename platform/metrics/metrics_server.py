"""``MetricsServer``: the scrape of an app on a port of its own (``LORAPLEX_METRICS_PORT``), without auth, in the
app's own event loop, started and stopped by the app's lifespan (``install_metrics`` wires it). Bind it where only
Prometheus reaches it: ``LORAPLEX_METRICS_HOST`` defaults to 127.0.0.1; in a pod, 0.0.0.0 on a port that only the
chart's metrics Service (no Ingress) exposes."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    """Leaves signal handling to the API's server (this one stops with the lifespan)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class MetricsServer:
    def __init__(self, app: Any, host: str, port: int) -> None:
        from fastapi import FastAPI

        from loraplex.platform.metrics.route import metrics_router

        self.host, self.port = host, port
        scrape = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        scrape.state.metrics = app.state.metrics
        scrape.state.engine_stats_poller = app.state.engine_stats_poller
        scrape.include_router(metrics_router(protect=False))
        # log_config / log_level None: a Config otherwise re-applies uvicorn's logging setup to the process's
        # loggers (levels, handlers, access-log filters) and so would change the API server's logging
        self.server = _Server(uvicorn.Config(scrape, host=host, port=port, lifespan="off", log_config=None,
                                             log_level=None))
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        self._task = asyncio.create_task(self.server.serve(), name="loraplex-metrics-server")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.server.started:
            if self._task.done():
                self._task.result()          # raises the bind error
                raise RuntimeError(f"the metrics server on {self.host}:{self.port} stopped at start")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the metrics server on {self.host}:{self.port} did not start in {timeout_s} s")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            await self._task
