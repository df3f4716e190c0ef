"""Errors of the engine service; each carries the wire ``type`` and the HTTP status the server answers with."""
from __future__ import annotations


class EngineServiceError(Exception):
    type_: str = "engine_error"
    status_code: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(EngineServiceError, ValueError):
    """The request cannot be served as sent (bad prompt, sampling parameter, adapter reference)."""

    type_, status_code = "invalid_request", 400


class AdapterUnavailableError(EngineServiceError):
    """The request's adapter could not be fetched, verified or loaded; the message says why."""

    type_, status_code = "adapter_load_error", 422


class AdapterFetchUnavailableError(EngineServiceError):
    """The blob store holding the adapter is down or failing; the same request may succeed shortly."""

    type_, status_code = "adapter_fetch_unavailable", 503


class AdapterInUseError(EngineServiceError):
    """An eviction of an adapter that running requests use."""

    type_, status_code = "invalid_request", 409


class EngineUnavailableError(EngineServiceError):
    """The engine is not ready (still loading) or its loop died."""

    type_, status_code = "engine_unavailable", 503


def from_wire(error: dict, status_code: int | None = None) -> EngineServiceError:
    """Rebuild the exception of an ``{"message", "type"}`` error (client side of the wire)."""
    message, type_ = str(error.get("message", "engine error")), error.get("type", "engine_error")
    if status_code == 409:
        return AdapterInUseError(message)
    cls = {"invalid_request": InvalidRequestError, "adapter_load_error": AdapterUnavailableError,
           "adapter_fetch_unavailable": AdapterFetchUnavailableError,
           "engine_unavailable": EngineUnavailableError}.get(type_, EngineServiceError)
    return cls(message)
