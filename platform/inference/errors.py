"""OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` and the exception the gateway raises
to answer with it."""
from __future__ import annotations

from pydantic import BaseModel

# status -> OpenAI error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_exceeded", 500: "server_error", 502: "server_error",
               503: "service_unavailable", 504: "server_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class InferenceError(Exception):
    """An answer of the OpenAI-compatible API that is an error: ``status_code``, a message saying what is wrong
    and what to do, the offending ``param`` and a machine ``code`` (e.g. "model_not_found"), extra ``headers``."""

    def __init__(self, status_code: int, message: str, *, code: str | None = None, param: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.type_ = type_ or ERROR_TYPES.get(status_code, "server_error" if status_code >= 500
                                              else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type_, param=self.param, code=self.code))


def model_not_found(model: str) -> InferenceError:
    """OpenAI's answer for an unknown model (also for another tenant's adapter: 404, never 403)."""
    shown = model if len(model) <= 100 else model[:97] + "..."
    return InferenceError(404, f"The model `{shown}` does not exist or you do not have access to it.",
                          code="model_not_found", param="model")
