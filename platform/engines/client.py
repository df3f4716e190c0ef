"""``EngineClient``: the one interface the platform talks to engines through.

    InProcessEngineClient   the embedded default: an engine (or the null engine) in this process
    HttpEngineClient        a separate ``loraplex engine serve`` process (NDJSON over HTTP, httpx)
    NullEngineClient        in-process null engine: fixed tokens, no model (gateway overhead benchmarks)

    async for chunk in client.generate(EngineRequest(...)):   # EngineChunk; stop iterating = abort
        ...
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from loraplex.platform.engines.errors import (AdapterInUseError, AdapterLoadFailedError, EngineError,
                                              EngineRequestError, EngineUnavailableError)
from loraplex.platform.engines.messages import AdapterReference, EngineChunk, EngineHealth, EngineRequest, Residency

__all__ = ["EngineClient", "EngineRequest", "EngineChunk", "AdapterReference", "Residency", "EngineHealth",
           "EngineError", "EngineRequestError", "AdapterLoadFailedError", "AdapterInUseError",
           "EngineUnavailableError"]


@runtime_checkable
class EngineClient(Protocol):
    """One engine replica. Errors: ``EngineRequestError`` (400), ``AdapterLoadFailedError`` (422),
    ``EngineUnavailableError`` (a ConnectionError: try another replica), ``EngineError``."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream the request's chunks; the last has ``finished=True``. Closing the iterator early aborts the
        request in the engine (KV blocks freed)."""

    async def abort(self, request_id: str) -> None:
        """Stop a request (no-op if unknown or finished)."""

    async def load_adapter(self, ref: AdapterReference, *, wait: bool = False) -> str:
        """Preload into the CPU tier; returns "ready", "loading" or "failed"."""

    async def evict_adapter(self, adapter_id: str) -> bool:
        """Drop from GPU and CPU; False if it was not there. ``AdapterInUseError`` while requests use it."""

    async def pin_adapter(self, adapter_id: str, pinned: bool = True, ref: AdapterReference | None = None) -> None:
        """Pin (never evicted) or unpin. Pass ``ref`` if the engine may not have seen the adapter yet."""

    async def residency(self) -> Residency:
        ...

    async def stats(self) -> dict:
        """``loraplex.engine.stats.engine_stats`` of the engine (what the metrics poller and the dashboard read)."""

    async def health(self) -> EngineHealth:
        """``ready`` only once the model is loaded; unreachable → ``EngineUnavailableError``."""

    async def close(self) -> None:
        ...
