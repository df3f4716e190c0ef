"""The control plane's FastAPI app. Only wiring: settings, state (registry, blobs, engine notifier, base model),
routers and error handlers.

    uvicorn --factory loraplex.platform.main:create_app      # or: loraplex serve
"""
from __future__ import annotations

from fastapi import FastAPI

from loraplex.engine.config import ModelConfig
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.router import api_router
from loraplex.platform.blobs import BlobStore, make_blob_store
from loraplex.platform.core.config import Settings, get_settings
from loraplex.platform.db.session import make_sessionmaker
from loraplex.platform.engines.notifier import EngineNotifier, NoopNotifier


def create_app(settings: Settings | None = None, *, blob_store: BlobStore | None = None,
               notifier: EngineNotifier | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="loraplex control plane", version="0.1.0",
                  description="Tenants, API keys and LoRA adapters of one shared base model.")
    app.state.settings = settings
    app.state.sessionmaker = make_sessionmaker(settings)
    app.state.blob_store = blob_store or make_blob_store(settings)
    app.state.notifier = notifier or NoopNotifier()
    app.state.base_model = ModelConfig.from_pretrained(settings.base_model_path) if settings.base_model_path else None
    app.include_router(api_router)
    install_error_handlers(app)
    return app
