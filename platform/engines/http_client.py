"""HttpEngineClient: a separate ``loraplex engine serve`` process over its internal HTTP API (httpx, NDJSON).

Connection refused / reset, a stream cut before its last chunk, and 503 (not ready) raise
``EngineUnavailableError`` (a ConnectionError), on which the router fails over. Leaving ``generate`` early closes
the HTTP stream; the engine sees the disconnect and aborts the request.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from loraplex.platform.engines.errors import EngineError, EngineUnavailableError, error_from_wire
from loraplex.platform.engines.messages import (AdapterReference, EngineChunk, EngineHealth, EngineRequest,
                                                Residency)


def _error_of(status_code: int, body: bytes) -> EngineError:
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    if not error:
        error = {"message": f"engine answered HTTP {status_code}: {body[:200]!r}",
                 "type": "engine_unavailable" if status_code in (502, 503, 504) else "engine_error"}
    return error_from_wire(error, status_code)


class HttpEngineClient:
    """``EngineClient`` for one engine replica at ``base_url`` (e.g. ``http://10.0.0.5:8101``)."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 2.0, timeout_s: float = 30.0,
                 stream_read_timeout_s: float | None = None, max_connections: int = 256,
                 transport=None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self._httpx = httpx
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        # a generation may wait long between chunks (queueing, adapter fetch): no read timeout by default
        self._stream_timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, read=stream_read_timeout_s)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout, transport=transport,
                                         limits=httpx.Limits(max_connections=max_connections,
                                                             max_keepalive_connections=max_connections))

    def _unavailable(self, e: Exception) -> EngineUnavailableError:
        return EngineUnavailableError(f"engine at {self.base_url} is unreachable: {type(e).__name__}: {e}")

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        finished = False
        try:
            async with self._client.stream("POST", "/v1/generate", json=request.to_wire(),
                                           timeout=self._stream_timeout) as resp:
                if resp.status_code != 200:
                    raise _error_of(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    data = json.loads(line)
                    if "error" in data:
                        raise error_from_wire(data["error"])
                    chunk = EngineChunk.from_wire(data)
                    finished = chunk.finished
                    yield chunk
                    if finished:
                        return
        except self._httpx.TransportError as e:
            raise self._unavailable(e) from e
        if not finished:
            raise EngineUnavailableError(f"engine at {self.base_url} ended the stream of {request.request_id} "
                                         "before its last chunk")

    async def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            resp = await self._client.request(method, path, json=body)
        except self._httpx.TransportError as e:
            raise self._unavailable(e) from e
        if resp.status_code != 200:
            raise _error_of(resp.status_code, resp.content)
        return resp.json()

    async def abort(self, request_id: str) -> None:
        await self._request("POST", "/v1/abort", {"request_id": request_id})

    async def load_adapter(self, ref: AdapterReference, *, wait: bool = False) -> str:
        return (await self._request("POST", "/v1/adapters/load", {"adapter": ref.to_wire(), "wait": wait}))["state"]

    async def evict_adapter(self, adapter_id: str) -> bool:
        return bool((await self._request("POST", "/v1/adapters/evict", {"adapter_id": adapter_id}))["evicted"])

    async def pin_adapter(self, adapter_id: str, pinned: bool = True, ref: AdapterReference | None = None) -> None:
        await self._request("POST", "/v1/adapters/pin", {"adapter_id": adapter_id, "pinned": pinned,
                                                          "adapter": ref.to_wire() if ref else None})

    async def residency(self) -> Residency:
        return Residency.from_wire(await self._request("GET", "/v1/adapters"))

    async def stats(self) -> dict:
        """The engine's ``GET /v1/stats`` (``loraplex.engine.stats.engine_stats``: load, KV cache, adapters,
        ``speculative``)."""
        return await self._request("GET", "/v1/stats")

    async def health(self) -> EngineHealth:
        try:
            resp = await self._client.get("/health")
        except self._httpx.TransportError as e:
            raise self._unavailable(e) from e
        data = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        if resp.status_code != 200 or not data.get("ready"):
            raise EngineUnavailableError(f"engine at {self.base_url} is not ready: "
                                         f"{data.get('detail') or resp.status_code}")
        return EngineHealth.from_wire(data)

    async def close(self) -> None:
        await self._client.aclose()
