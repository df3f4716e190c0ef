"""API errors as ``{"detail": message, "code": reason}``; the message says what to fix."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loraplex.platform.uploads.errors import UploadError


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
