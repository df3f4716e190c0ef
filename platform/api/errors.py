"""API errors as ``{"detail": message, "code": reason}``; the message says what to fix."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc

from loraplex.platform.uploads.errors import UploadError


logger = logging.getLogger(__name__)
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")
DATABASE_DOWN = "the registry database is unavailable; nothing was changed — retry shortly"


class ApiError(Exception):
    def __init__(self, status: int, detail: str, *, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.code, self.headers = status, detail, code, headers


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse({"detail": e.detail, "code": e.code}, status_code=e.status, headers=e.headers)

    @app.exception_handler(UploadError)
    async def _upload_error(_: Request, e: UploadError) -> JSONResponse:
        return JSONResponse({"detail": e.message, "code": e.code}, status_code=e.status)

    async def _database_down(request: Request, e: Exception) -> JSONResponse:
        """The database unreachable (connection refused or dropped, pool exhausted): 503 with a clear message,
        in the OpenAI error shape on the inference routes, instead of a bare 500."""
        logger.warning("database unavailable during %s %s: %s", request.method, request.url.path,
                       type(e).__name__)
        if request.url.path in INFERENCE_PATHS:
            body = {"error": {"message": DATABASE_DOWN, "type": "server_error", "param": None,
                              "code": "database_unavailable"}}
        else:
            body = {"detail": DATABASE_DOWN, "code": "database_unavailable"}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    for error in (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
        app.add_exception_handler(error, _database_down)
