"""Errors an ``EngineClient`` raises. ``EngineUnavailableError`` is a ``ConnectionError``: the router fails
over to the next replica on it (refused connection, reset stream, engine not ready or dead)."""
from __future__ import annotations


class EngineError(Exception):
    """The engine could not serve the request; ``status_code`` is what the gateway should answer."""

    status_code = 500
    type_ = "engine_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EngineRequestError(EngineError, ValueError):
    """The engine refused the request as sent (prompt, sampling parameters, adapter reference)."""

    status_code, type_ = 400, "invalid_request"


class AdapterInUseError(EngineRequestError):
    status_code = 409


class AdapterLoadFailedError(EngineError):
    """The adapter could not be fetched, verified or loaded (the message says why)."""

    status_code, type_ = 422, "adapter_load_error"


class AdapterFetchUnavailableError(EngineError):
    """The blob store holding the adapter is down; the same request may succeed shortly (503 + Retry-After).
    Not a ConnectionError: the replica itself is fine, so the router does not mark it down."""

    status_code, type_ = 503, "adapter_fetch_unavailable"
    retry_after_s = 2


class EngineUnavailableError(EngineError, ConnectionError):
    """The engine cannot be reached, is not ready, or died; another replica may serve the request."""

    status_code, type_ = 503, "engine_unavailable"


def error_from_wire(error: dict, status_code: int | None = None) -> EngineError:
    """The exception for an engine's ``{"message", "type"}`` error body."""
    message = str(error.get("message") or "engine error")
    type_ = error.get("type")
    if status_code == 409:
        return AdapterInUseError(message)
    cls = {"invalid_request": EngineRequestError, "adapter_load_error": AdapterLoadFailedError,
           "adapter_fetch_unavailable": AdapterFetchUnavailableError,
           "engine_unavailable": EngineUnavailableError}.get(type_, EngineError)
    return cls(message)
