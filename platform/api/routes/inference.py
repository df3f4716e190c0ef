"""OpenAI-compatible inference: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not).

``model`` is an adapter of the caller's tenant (``name``, ``name:<version>``, ``name:<alias>``) or the base model.
Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``; 429s carry ``Retry-After`` and the
``x-ratelimit-*`` headers, which successful answers carry too. The flow is in ``platform/gateway/pipeline.py``.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loraplex.platform.api.json_body import parse_json_body_async
from loraplex.platform.gateway.metering import RequestMeter
from loraplex.platform.gateway.pipeline import Generation, admit, authenticate, prepare
from loraplex.platform.gateway.responses import SSEResponse, complete, sse_stream
from loraplex.platform.gateway.state import Gateway
from loraplex.platform.inference.errors import ErrorBody, InferenceError

router = APIRouter(prefix="/v1", tags=["inference"])

ERRORS = {
    400: {"model": ErrorBody, "description": "invalid parameter (the message names it)"},
    401: {"model": ErrorBody, "description": "missing or invalid API key"},
    413: {"model": ErrorBody, "description": "request_too_large: the body is over LORAPLEX_MAX_REQUEST_BYTES"},
    404: {"model": ErrorBody, "description": "model_not_found: no such adapter (or version/alias) for this tenant"},
    429: {"model": ErrorBody, "description": "rate limit (requests/min, tokens/min, concurrency, daily budget); "
                                             "see Retry-After and x-ratelimit-* headers"},
    503: {"model": ErrorBody, "description": "no engine replica available, or the quota store is down"},
}


def _body_doc(example: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "required": ["model"]}, "example": example}}}}


CHAT_BODY = _body_doc({"model": "support-bot:prod", "messages": [{"role": "user", "content": "Hello"}],
                       "max_tokens": 64, "temperature": 0.7, "stream": False})
COMPLETION_BODY = _body_doc({"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 32, "stream": False})


def gateway_of(request: Request) -> Gateway:
    gw = getattr(request.app.state, "gateway", None)
    if gw is None:
        raise InferenceError(503, "the inference gateway is not running (the app was started without its "
                                  "lifespan)", code="gateway_unavailable")
    return gw


def _too_large(limit: int) -> InferenceError:
    return InferenceError(413, f"the request body is larger than {limit} bytes (LORAPLEX_MAX_REQUEST_BYTES); send a "
                               "shorter prompt", code="request_too_large")


async def _body(request: Request, limit: int) -> object:
    """The JSON body, read up to ``limit`` bytes (413 past it, before anything is parsed or tokenized)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise _too_large(limit)
    return await parse_json_body_async(bytes(raw))


async def _serve(request: Request, kind: str) -> Response:
    gw = gateway_of(request)
    meter = RequestMeter(getattr(request.app.state, "metrics", None))
    try:
        return await _run(request, gw, kind, meter)
    except InferenceError as e:  # refused before admission; after it, the generation has reported (finish is once)
        meter.finish(e.status_code, error=e.code or e.type_)
        raise
    except Exception:
        meter.finish(500, error="internal_error")
        raise


async def _run(request: Request, gw: Gateway, kind: str, meter: RequestMeter) -> Response:
    tenant = await authenticate(gw, request.headers.get("authorization"))
    meter.tenant = tenant.name
    prep = await prepare(gw, tenant, await _body(request, gw.settings.max_request_bytes), kind)
    meter.resolved(prep.adapter.name if prep.adapter else None)
    decision = await admit(gw, prep, meter)
    headers = {"x-request-id": prep.request_id, **decision.headers()}
    gen = Generation(gw, prep, decision, meter)
    if not prep.body.stream:
        answer = await complete(gen)
        return Response(answer.model_dump_json(), media_type="application/json", headers=headers)
    chunks = gen.chunks()
    try:
        first = [await chunks.__anext__()]
    except StopAsyncIteration:
        first = []
    except InferenceError as e:
        e.headers = {**headers, **e.headers}
        raise
    return SSEResponse(sse_stream(gen, chunks, first), headers=headers, on_close=chunks.aclose)


@router.post("/chat/completions", responses=ERRORS, summary="Chat completion (OpenAI-compatible)",
             openapi_extra=CHAT_BODY)
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat.completions: ``messages`` rendered with the base model's chat template; ``stream`` for SSE."""
    return await _serve(request, "chat")


@router.post("/completions", responses=ERRORS, summary="Text completion (OpenAI-compatible)",
             openapi_extra=COMPLETION_BODY)
async def completions(request: Request) -> Response:
    """OpenAI's (legacy) completions: one ``prompt`` (text or token ids); ``stream`` for SSE."""
    return await _serve(request, "completion")


