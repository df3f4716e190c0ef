"""The engine's internal HTTP API (FastAPI, imported here only). Routes over an ``EngineService`` (or
``NullEngineService``) that a ``ServiceHolder`` gets once the model is loaded:

    GET  /health               200 {"ready": true, "model", "limits": {max_lora_rank, targets, dtypes, ...}, ...}
                               | 503 {"ready": false, "detail"} while loading (``protocol.limits_dict``)
    POST /v1/generate          GenerateRequest JSON -> NDJSON chunks (application/x-ndjson); errors before the
                               first token are plain JSON with status 400 / 422 / 503; a client that disconnects
                               aborts its request (its KV blocks are freed)
    POST /v1/abort             {"request_id"}
    GET  /v1/adapters          residency (GPU slots, CPU tier, loading, failed, pinned, counters)
    POST /v1/adapters/load     {"adapter": AdapterSpec, "wait": false, "timeout_s": null} -> {"adapter_id", "state"}
    POST /v1/adapters/evict    {"adapter_id"} -> {"evicted": bool}; 409 while running requests use it
    POST /v1/adapters/pin      {"adapter_id", "pinned": true, "adapter": AdapterSpec?} -> {"adapter_id", "pinned"}
    GET  /v1/stats             ``loraplex.engine.stats.engine_stats`` JSON (what the platform's metrics poller reads)
    GET  /metrics              the same as Prometheus text (``metrics.py``; 503 while the model loads)
Every error body is {"error": {"message", "type"}}.
"""

import json
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from loraplex.engine.server.errors import EngineServiceError, EngineUnavailableError, InvalidRequestError
from loraplex.engine.server.protocol import AdapterSpec, GenerateRequest, RequestFormatError, error_dict

logger = logging.getLogger(__name__)


@dataclass
class ServiceHolder:
    """Where the app finds its service; ``service`` stays None until the model is loaded (``error`` if that failed)."""

    service: Any = None
    error: str | None = None


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def create_app(holder: ServiceHolder):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        yield
        if holder.service is not None:
            await holder.service.close()

    app = FastAPI(title="loraplex engine", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(EngineServiceError)
    async def service_error(request, exc: EngineServiceError):
        return JSONResponse(error_dict(exc.message, exc.type_), status_code=exc.status_code)

    def service():
        if holder.service is None:
            detail = f"the model failed to load: {holder.error}" if holder.error else "the model is still loading"
            raise EngineUnavailableError(detail)
        return holder.service

    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError:
            raise InvalidRequestError("the request body must be JSON") from None
        except RecursionError:
            raise InvalidRequestError("the request body is nested too deeply; flatten its JSON") from None
        if not isinstance(data, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        return data

    @app.get("/health")
    async def health():
        try:
            state = service().health()
        except EngineUnavailableError as e:
            return JSONResponse({"ready": False, "detail": e.message}, status_code=503)
        return JSONResponse(state, status_code=200 if state["ready"] else 503)

    @app.post("/v1/generate")
    async def generate(request: Request):
        svc = service()
        try:
            req = GenerateRequest.from_dict(await body(request))
        except RequestFormatError as e:
            raise InvalidRequestError(str(e)) from None
        stream = svc.generate(req)
        try:  # errors before the first token are a status code, not a stream
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await stream.aclose()
            raise

        async def lines():
            try:
                if first is not None:
                    yield _line(first)
                async for chunk in stream:
                    yield _line(chunk)
            except EngineServiceError as e:
                yield _line({"request_id": req.request_id, "finished": True, **error_dict(e.message, e.type_)})
            finally:
                await stream.aclose()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/abort")
    async def abort(request: Request):
        data = await body(request)
        request_id = data.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("'request_id' must be a non-empty string")
        service().abort(request_id)
        return {"aborted": request_id}

    @app.get("/v1/stats")
    async def stats():
        return await service().stats()

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        from loraplex.engine.server.metrics import content_type, render_metrics

        svc = service()
        return Response(render_metrics(await svc.stats(), model=svc.model_name), media_type=content_type())

    @app.get("/v1/adapters")
    async def residency():
        return service().residency()

    def spec_of(data: dict, key: str = "adapter", required: bool = True) -> AdapterSpec | None:
        if data.get(key) is None and not required:
            return None
        try:
            return AdapterSpec.from_dict(data.get(key))
        except RequestFormatError as e:
            raise InvalidRequestError(str(e)) from None

    @app.post("/v1/adapters/load")
    async def load(request: Request):
        data = await body(request)
        wait, timeout = data.get("wait", False), data.get("timeout_s")
        if not isinstance(wait, bool):
            raise InvalidRequestError(f"'wait' must be true or false, got {wait!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout <= threading.TIMEOUT_MAX):
            raise InvalidRequestError(f"'timeout_s' must be null or a number of seconds in [0, "
                                      f"{threading.TIMEOUT_MAX:g}], got {timeout!r}")
        return await service().load_adapter(spec_of(data), wait=wait,
                                            timeout_s=float(timeout) if timeout is not None else None)

    def adapter_id_of(data: dict) -> str:
        adapter_id = data.get("adapter_id")
        if not isinstance(adapter_id, str) or not adapter_id:
            raise InvalidRequestError("'adapter_id' must be a non-empty string")
        return adapter_id

    @app.post("/v1/adapters/evict")
    async def evict(request: Request):
        return {"evicted": await service().evict_adapter(adapter_id_of(await body(request)))}

    @app.post("/v1/adapters/pin")
    async def pin(request: Request):
        data = await body(request)
        pinned = data.get("pinned", True)
        if not isinstance(pinned, bool):
            raise InvalidRequestError(f"'pinned' must be true or false, got {pinned!r}")
        return await service().pin_adapter(adapter_id_of(data), pinned, spec_of(data, required=False))

    return app
