"""Load and fault-injection fixtures: one ``LocalStack`` for the session (own PostgreSQL cluster, own Redis, moto
behind a fault proxy, two tiny-llama engine processes with LoRA, the platform in a thread), a small registered
population, and ``Background``: request loops in a thread that record every outcome while a test breaks things.
Missing binaries (redis-server, initdb) are errors, never skips."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from load_tests.population import Population, populate
from load_tests.records import Record
from load_tests.stack import LocalStack
from load_tests.streaming import one_completion, one_stream


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    s = LocalStack(str(tmp_path_factory.mktemp("stack")), engines=2)
    try:
        s.start()
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


@pytest.fixture(scope="session")
def population(stack) -> Population:
    return populate(stack.info.url, stack.info.admin_key, stack.model, tenants=6, adapters=60, burst_tenants=1,
                    burst_rpm=30)


class Background:
    """``concurrency`` loops of requests (streams, or whole completions) on ``models`` in a thread of its own,
    until ``stop()``; every outcome is a ``Record`` in ``records``."""

    def __init__(self, url: str, tenant: dict, models: list[str], *, concurrency: int = 4, stream: bool = True,
                 max_tokens: int = 24, pause_s: float = 0.0) -> None:
        self.url, self.tenant, self.models = url, tenant, models
        self.concurrency, self.stream, self.max_tokens, self.pause_s = concurrency, stream, max_tokens, pause_s
        self.records: list[Record] = []
        self._stop = threading.Event()
        self.t0 = time.time()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            await asyncio.gather(*(self._loop(http) for _ in range(self.concurrency)))

    async def _loop(self, http: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            model = random.choice(self.models)
            if self.stream:
                rec = await one_stream(http, self.tenant, model, max_tokens=self.max_tokens, t0=self.t0)
            else:
                rec = await one_completion(http, self.tenant, model, max_tokens=self.max_tokens, t0=self.t0)
            self.records.append(rec)
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    def stop(self) -> list[Record]:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "background requests did not finish within 60 s"
        return self.records

    def since(self, t: float) -> list[Record]:
        return [r for r in self.records if r.started_s + self.t0 >= t]
