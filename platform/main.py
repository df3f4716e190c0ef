"""The platform's FastAPI app. Only wiring: settings, state (registry, blobs, engine notifier, base model), the
inference gateway (engine replicas, router, quotas, usage writer; started and stopped by the lifespan), routers,
error handlers (OpenAI's error shape everywhere), x-request-id and body-size middleware, Prometheus metrics (``GET /metrics``; each engine replica becomes a stats source of the poller
when the gateway starts) and the admin dashboard (``/admin/dashboard``).

    uvicorn --factory loraplex.platform.main:create_app      # or: loraplex serve
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loraplex.engine.config import ModelConfig
from loraplex.platform.api.header_limit import HeaderLimitMiddleware
from loraplex.platform.api.body_limit import BodyLimitMiddleware
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.openapi import install_openapi
from loraplex.platform.api.request_id import RequestIdMiddleware
from loraplex.platform.api.router import api_router
from loraplex.platform.blobs import BlobStore, make_blob_store
from loraplex.platform.core.config import Settings, get_settings
from loraplex.platform.dashboard import install_dashboard
from loraplex.platform.db.session import make_sessionmaker
from loraplex.platform.engines.notifier import EngineNotifier, NoopNotifier
from loraplex.platform.metrics import client_source, install_metrics
from loraplex.platform.quotas import QuotaStore
from loraplex.platform.routing import Replica
from loraplex.platform.uploads.janitor import install_janitor

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, blob_store: BlobStore | None = None,
               notifier: EngineNotifier | None = None, replicas: list[Replica] | None = None,
               quota_store: QuotaStore | None = None) -> FastAPI:
    """The app. ``replicas``/``quota_store`` override what the settings would build (tests, benchmarks)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from loraplex.platform.gateway.state import CompositeNotifier, Gateway

        gateway = await asyncio.to_thread(Gateway.build, settings, app.state.sessionmaker, replicas=replicas,
                                          quotas=quota_store)
        await gateway.start()
        app.state.gateway = gateway
        own = app.state.notifier
        if gateway.notifier is not None:
            app.state.notifier = gateway.notifier if isinstance(own, NoopNotifier) else \
                CompositeNotifier(own, gateway.notifier)
        poller = app.state.engine_stats_poller
        replica_ids = []
        for replica in (gateway.router.replicas.values() if gateway.router is not None else ()):
            source = client_source(replica.client)
            if source is not None:
                poller.add_source(replica.replica_id, source)
                replica_ids.append(replica.replica_id)
        if replica_ids:
            poller.start()   # background polls: adapter load latencies are seen at the poll interval
        try:
            yield
        finally:
            await poller.stop()
            for replica_id in replica_ids:
                poller.remove_source(replica_id)
            app.state.notifier = own
            await gateway.stop()
            app.state.gateway = None

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan,
                  description="Tenants, API keys and LoRA adapters of one shared base model, and an "
                              "OpenAI-compatible inference API over them.")
    app.state.settings = settings
    app.state.sessionmaker = make_sessionmaker(settings)
    app.state.blob_store = blob_store or make_blob_store(settings)
    app.state.notifier = notifier or NoopNotifier()
    app.state.base_model = ModelConfig.from_pretrained(settings.base_model_path) if settings.base_model_path else None
    app.state.gateway = None
    app.include_router(api_router)
    install_error_handlers(app)  # every error in OpenAI's shape, with x-request-id
    install_metrics(app)       # app.state.metrics, app.state.engine_stats_poller, GET /metrics, upload counts
    install_dashboard(app)     # /admin/dashboard (admin key), reads app.state.metrics
    install_janitor(app)       # spool heartbeat + janitor passes (interrupted uploads, orphans) in the lifespan
    install_openapi(app)       # the schema documents the error shape (400, not FastAPI's 422)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(HeaderLimitMiddleware)
    app.add_middleware(RequestIdMiddleware)   # outermost: every answer has x-request-id
    return app
