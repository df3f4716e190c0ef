"""Ready-made engine stats sources for ``EngineStatsPoller``.

    inprocess_source(async_engine)       the embedded engine: ``engine_stats(async_engine.engine)``
    http_source("http://engine-0:8001")  a ``loraplex engine serve`` process: GET <url>/v1/stats (JSON)
    client_source(replica.client)        the gateway's engine client's ``stats()`` (in-process: the engine
                                         service's; HTTP: the engine's GET /v1/stats on the client's pool)
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable


def inprocess_source(engine: Any) -> Callable[[], dict]:
    """A source for an in-process ``LLMEngine`` or ``AsyncEngine`` (its ``.engine``)."""
    from loraplex.engine.stats import engine_stats

    llm = getattr(engine, "engine", engine)
    return lambda: engine_stats(llm)


def http_source(base_url: str, *, path: str = "/v1/stats", timeout_s: float = 2.0,
                client: Any = None) -> Callable[[], Awaitable[dict]]:
    """A source reading an engine server's stats route. ``client``: an ``httpx.AsyncClient`` to reuse."""
    import httpx

    url = base_url.rstrip("/") + path

    async def fetch() -> dict:
        if client is not None:
            r = await client.get(url, timeout=timeout_s)
        else:
            async with httpx.AsyncClient(timeout=timeout_s) as c:
                r = await c.get(url)
        r.raise_for_status()
        return r.json()
    return fetch


def client_source(client: Any) -> Callable[[], Any] | None:
    """The stats source of one of the gateway's engine clients: its ``stats()`` (``EngineClient``: the embedded
    engine's ``engine_stats``, the null engine's ``empty_stats``, an engine server's ``/v1/stats`` on the client's
    pool); None for a client without it (a test double), which then has no engine gauges."""
    stats = getattr(client, "stats", None)
    return stats if callable(stats) else None
