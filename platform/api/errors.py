"""Every error answer of the API, on every route, in OpenAI's shape:

    {"error": {"message": "what is wrong and what to do", "type": "invalid_request_error", "param": "offset",
               "code": "invalid_value"}}

with the ``x-request-id`` header (``request_id.py``). Sources: ``ApiError`` (tenant, admin and dashboard routes),
``UploadError`` (uploads), ``InferenceError`` (inference), request validation (path, query, header and body
fields: 400 naming the ``param``), unknown routes (404 ``not_found``), wrong methods (405
``method_not_allowed``), bodies over the cap (413 ``request_too_large``, ``body_limit.py``), the registry
database down (503 ``database_unavailable``) and, should one slip through, an unhandled exception (500
``internal_error``: the traceback goes to the log with the request id, never to the client). The ``code``
strings are stable; docs/platform.md lists them.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.platform.api.request_id import request_id_of
from loraplex.platform.inference.errors import ERROR_TYPES, InferenceError
from loraplex.platform.uploads.errors import UploadError

logger = logging.getLogger(__name__)
DATABASE_DOWN = "the registry database is unavailable; nothing was changed — retry shortly"
_LOCATIONS = ("body", "query", "path", "header", "cookie")


class ApiError(Exception):
    """An error answer: HTTP ``status``, a ``detail`` message saying what to fix, a stable machine ``code``, the
    offending ``param`` (if one) and extra ``headers``."""

    def __init__(self, status: int, detail: str, *, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.code, self.param, self.headers = status, detail, code, param, headers

    @property
    def message(self) -> str:
        return self.detail


class ErrorJSONResponse(JSONResponse):
    """JSON rendered ASCII-only: a message quoting a tenant's text (even a lone surrogate) always renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None,
               type_: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": code}}


def error_response(request_id: str | None, status: int, message: str, *, code: str | None = None,
                   param: str | None = None, type_: str | None = None,
                   headers: dict[str, str] | None = None) -> ErrorJSONResponse:
    extra = {**(headers or {})}
    if request_id and "x-request-id" not in {k.lower() for k in extra}:
        extra["x-request-id"] = request_id
    return ErrorJSONResponse(error_body(status, message, code=code, param=param, type_=type_), status_code=status,
                             headers=extra)


def _validation_error(request: Request, e: RequestValidationError) -> ErrorJSONResponse:
    errors = e.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in first.get("loc", ())]
    where = loc[0] if loc and loc[0] in _LOCATIONS else None
    path = loc[1:] if where else loc
    param = ".".join(path) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return error_response(request_id_of(request), 400, "the request body is not valid JSON; send a JSON object",
                              code="invalid_json")
    if kind == "missing":
        message, code = f"missing required {where or 'parameter'} '{param}'", "missing_required_parameter"
    else:
        reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        message, code = f"invalid value for {where or 'parameter'} '{param}': {reason}", "invalid_value"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(request_id_of(request), 400, message, code=code, param=param)


def _http_error(request: Request, e: StarletteHTTPException) -> ErrorJSONResponse:
    rid = request_id_of(request)
    if e.status_code == 404 and e.detail == "Not Found":
        return error_response(rid, 404, f"no route {request.method} {request.url.path!r}; see /docs for the API",
                              code="not_found", headers=e.headers)
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow")
        return error_response(rid, 405, f"{request.method} is not allowed on {request.url.path!r}"
                              + (f"; use {allowed}" if allowed else ""), code="method_not_allowed", headers=e.headers)
    if e.status_code == 400 and e.detail == "There was an error parsing the body":
        return error_response(rid, 400, "the request body could not be parsed; send a JSON object (UTF-8, at "
                              "most a few levels deep)", code="invalid_json")
    detail = e.detail if isinstance(e.detail, str) else "request refused"
    code = {401: "unauthorized", 403: "forbidden", 404: "not_found", 413: "request_too_large"}.get(e.status_code)
    return error_response(rid, e.status_code, detail, code=code, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> ErrorJSONResponse:
        return error_response(request_id_of(request), e.status, e.detail, code=e.code, param=e.param,
                              headers=e.headers)

    @app.exception_handler(UploadError)
    async def _upload_error(request: Request, e: UploadError) -> ErrorJSONResponse:
        return error_response(request_id_of(request), e.status, e.message, code=e.code,
                              param=getattr(e, "param", None))

    @app.exception_handler(InferenceError)
    async def _inference_error(request: Request, e: InferenceError) -> ErrorJSONResponse:
        return error_response(request_id_of(request), e.status_code, e.message, code=e.code, param=e.param,
                              type_=e.type_, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> ErrorJSONResponse:
        return _validation_error(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> ErrorJSONResponse:
        return _http_error(request, e)

    async def _database_down(request: Request, e: Exception) -> ErrorJSONResponse:
        """The database unreachable (connection refused or dropped, pool exhausted): 503 with a clear message
        instead of a bare 500."""
        logger.warning("database unavailable during %s %s (request %s): %s", request.method, request.url.path,
                       request_id_of(request), type(e).__name__)
        return error_response(request_id_of(request), 503, DATABASE_DOWN, code="database_unavailable",
                              headers={"Retry-After": "1"})

    for error in (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
        app.add_exception_handler(error, _database_down)

    @app.exception_handler(sa_exc.DataError)
    async def _out_of_range(request: Request, e: sa_exc.DataError) -> ErrorJSONResponse:
        """A value the registry cannot store (a number past its column's range): the request's fault, not the
        database's. Inputs are bounded before they reach SQL; this is the last line."""
        logger.warning("registry refused a value during %s %s (request %s): %s", request.method, request.url.path,
                       request_id_of(request), type(e.orig).__name__ if e.orig is not None else "DataError")
        return error_response(request_id_of(request), 400, "a value in the request is out of the range the registry "
                              "stores (numbers up to 2147483647); send a smaller value", code="invalid_value")

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, e: Exception) -> ErrorJSONResponse:
        rid = request_id_of(request)
        logger.error("unhandled error in %s %s (request %s)", request.method, request.url.path, rid, exc_info=e)
        return error_response(rid, 500, f"internal error; report request id {rid} to the operator (the details "
                              "are in the log under it)", code="internal_error")
