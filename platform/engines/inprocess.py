"""InProcessEngineClient: an engine service in this process (the embedded default), and NullEngineClient.

The service is ``loraplex.engine.server.service.EngineService`` (over an ``AsyncEngine``) or the null engine: the
same objects the engine's HTTP server calls, so in-process and HTTP engines validate and answer alike.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from loraplex.platform.engines.errors import EngineUnavailableError, error_from_wire
from loraplex.platform.engines.messages import (AdapterReference, EngineChunk, EngineHealth, EngineRequest,
                                                Residency)


def _translate(e: Exception) -> Exception:
    return error_from_wire({"message": e.message, "type": e.type_}, getattr(e, "status_code", None))


class InProcessEngineClient:
    """``EngineClient`` over an engine service object living in this process."""

    def __init__(self, service: Any) -> None:
        self.service = service

    @classmethod
    def from_engine(cls, engine: Any, *, model_name: str) -> "InProcessEngineClient":
        """Wrap a running ``loraplex.engine.AsyncEngine``."""
        from loraplex.engine.server.service import EngineService

        return cls(EngineService(engine, model_name=model_name))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        from loraplex.engine.server.errors import EngineServiceError
        from loraplex.engine.server.protocol import GenerateRequest, RequestFormatError

        try:
            wire = GenerateRequest.from_dict(request.to_wire())
        except RequestFormatError as e:
            raise error_from_wire({"message": str(e), "type": "invalid_request"}) from None
        stream = self.service.generate(wire)
        try:
            async for chunk in stream:
                yield EngineChunk.from_wire(chunk)
        except EngineServiceError as e:
            raise _translate(e) from None
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        self.service.abort(request_id)

    async def _call(self, coro):
        from loraplex.engine.server.errors import EngineServiceError

        try:
            return await coro
        except EngineServiceError as e:
            raise _translate(e) from None

    def _spec(self, ref: AdapterReference):
        from loraplex.engine.server.protocol import AdapterSpec

        return AdapterSpec.from_dict(ref.to_wire())

    async def load_adapter(self, ref: AdapterReference, *, wait: bool = False) -> str:
        return (await self._call(self.service.load_adapter(self._spec(ref), wait=wait)))["state"]

    async def evict_adapter(self, adapter_id: str) -> bool:
        return await self._call(self.service.evict_adapter(adapter_id))

    async def pin_adapter(self, adapter_id: str, pinned: bool = True, ref: AdapterReference | None = None) -> None:
        await self._call(self.service.pin_adapter(adapter_id, pinned, self._spec(ref) if ref else None))

    async def residency(self) -> Residency:
        return Residency.from_wire(self.service.residency())

    async def stats(self) -> dict:
        """``engine_stats`` of the engine in this process (the null engine's ``empty_stats``)."""
        return await self.service.stats()

    async def health(self) -> EngineHealth:
        health = EngineHealth.from_wire(self.service.health())
        if not health.ready:
            raise EngineUnavailableError(health.detail or "the engine is not ready")
        return health

    async def close(self) -> None:
        await self.service.close()


class NullEngineClient(InProcessEngineClient):
    """No model: every request streams ``max_tokens`` (default ``num_tokens``) fixed tokens."""

    def __init__(self, *, num_tokens: int = 8, token_delay_s: float = 0.0, model_name: str = "null",
                 limits: dict | None = None) -> None:
        from loraplex.engine.server.null import NullEngineService

        super().__init__(NullEngineService(model_name=model_name, num_tokens=num_tokens, token_delay_s=token_delay_s,
                                           limits=limits))
