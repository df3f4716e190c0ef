"""``serve``: run the engine's HTTP API with uvicorn, loading the model in the background (``/health`` answers
503 until it is loaded), and the service builders for a real model and for the null engine."""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from loraplex.engine.server.app import ServiceHolder, create_app
from loraplex.engine.server.keep_alive import keep_alive_seconds

logger = logging.getLogger(__name__)


def real_service(model: str, *, model_name: str | None = None, **engine_kwargs: Any):
    """Load ``model`` (an HF folder) into an ``AsyncEngine`` and wrap it; ``engine_kwargs`` are EngineConfig fields."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.server.service import EngineService

    engine = AsyncEngine.from_pretrained(model, **engine_kwargs)
    return EngineService(engine, model_name=model_name or os.path.basename(os.path.normpath(model)))


def null_service(*, model_name: str = "null", num_tokens: int = 8, token_delay_s: float = 0.0):
    from loraplex.engine.server.null import NullEngineService

    return NullEngineService(model_name=model_name, num_tokens=num_tokens, token_delay_s=token_delay_s)


def start_loading(holder: ServiceHolder, make_service: Callable[[], Any]) -> threading.Thread:
    """Build the service on a background thread; the holder gets it (or the error) when done."""

    def load() -> None:
        try:
            holder.service = make_service()
            logger.info("engine ready")
        except BaseException as e:  # noqa: BLE001 - reported by /health, the process stays up for operators
            logger.exception("engine failed to load")
            holder.error = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=load, name="loraplex-engine-load", daemon=True)
    thread.start()
    return thread


def serve(make_service: Callable[[], Any], *, host: str = "127.0.0.1", port: int = 8100,
          log_level: str = "info", keep_alive_s: float | None = None) -> None:
    """Serve until interrupted. ``make_service`` runs on a background thread after the port is open.
    ``keep_alive_s``: seconds an idle keep-alive connection stays open (default ``LORAPLEX_KEEP_ALIVE_S``, 75:
    ``keep_alive.py``)."""
    import uvicorn

    if keep_alive_s is None:
        try:
            keep_alive_s = keep_alive_seconds()
        except ValueError as e:   # one line, no traceback, before the port opens
            raise SystemExit(f"loraplex engine serve: error: {e}") from None
    holder = ServiceHolder()
    app = create_app(holder)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_keep_alive=keep_alive_s)
    server = uvicorn.Server(config)
    start_loading(holder, make_service)
    server.run()
