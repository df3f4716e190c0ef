"""EngineFanoutNotifier: deleted adapter versions are evicted from every engine replica; when an alias moves
(rollback, promotion), every replica holding the version it named starts loading the new one, so the first
request for the alias after the move does not wait for a cold load (requests resolve aliases in the registry on
every call, so they reach the new version at once either way).

``evict`` is called by the (synchronous) delete routes in a worker thread: it schedules the evictions on the
gateway's event loop and waits up to ``wait_s``. An engine still running requests with the adapter answers 409;
those evictions are retried a few times in the background. Unreachable engines are skipped (they restart empty,
and a deleted version can no longer be resolved, so no request names it again).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Callable

from loraplex.platform.engines.errors import AdapterInUseError, EngineError
from loraplex.platform.engines.messages import AdapterReference
from loraplex.platform.engines.notifier import Eviction, Promotion
from loraplex.platform.gateway.adapters import engine_adapter_id
from loraplex.platform.routing import Router

logger = logging.getLogger(__name__)


class EngineFanoutNotifier:
    """``EngineNotifier`` over every replica of ``router``; ``on_evict`` also sees each eviction (cache cleanup)."""

    def __init__(self, router: Router, loop: asyncio.AbstractEventLoop, *, wait_s: float = 5.0,
                 retries: int = 5, retry_delay_s: float = 1.0,
                 on_evict: Callable[[Eviction], None] | None = None,
                 reference_of: Callable[[str, str], AdapterReference | None] | None = None) -> None:
        self.router, self.loop = router, loop
        self.wait_s, self.retries, self.retry_delay_s = wait_s, retries, retry_delay_s
        self.on_evict = on_evict
        self.reference_of = reference_of           # (tenant id, version id) -> the engines' reference (blocking)
        self.evicted: list[tuple[str, str]] = []   # (replica id, adapter id) evictions that took effect
        self.warmed: list[tuple[str, str]] = []    # (replica id, adapter id) loads started by promotions
        self._tasks: set[asyncio.Future] = set()

    def promote(self, promotions: list[Promotion]) -> None:
        """Schedules the warm-up loads on the gateway's loop and returns at once."""
        if self.reference_of is None or not promotions:
            return
        coro = self._warm_all(promotions)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        future = self.loop.create_task(coro) if running is self.loop else \
            asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)

    async def _warm_all(self, promotions: list[Promotion]) -> None:
        for p in promotions:
            if p.previous_version_id is None:
                continue
            old = engine_adapter_id(p.tenant_id, p.adapter_name, p.previous_version_id)
            holders = [r for r in list(self.router.replicas.values()) if old in r.resident]
            if not holders:
                continue
            try:
                ref = await asyncio.to_thread(self.reference_of, p.tenant_id, p.version_id)
            except Exception:  # noqa: BLE001 - best effort: the first request loads it instead
                logger.exception("reference of promoted version %s unavailable", p.version_id)
                continue
            if ref is None:
                continue
            await asyncio.gather(*(self._warm(r, ref) for r in holders))

    async def _warm(self, replica, ref: AdapterReference) -> None:
        try:
            await replica.client.load_adapter(ref)
            self.warmed.append((replica.replica_id, ref.adapter_id))
        except (EngineError, ConnectionError, OSError) as e:
            logger.info("replica %s could not preload %s: %s", replica.replica_id, ref.adapter_id, e)

    def evict(self, evictions: list[Eviction]) -> None:
        for e in evictions:
            if self.on_evict is not None:
                self.on_evict(e)
        coro = self._evict_all([engine_adapter_id(e.tenant_id, e.adapter_name, e.version_id) for e in evictions])
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.loop.create_task(coro)   # called on the loop itself: cannot block it
            return
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            future.result(timeout=self.wait_s)
        except concurrent.futures.TimeoutError:
            logger.warning("evictions of %d adapter versions still running after %.1f s", len(evictions), self.wait_s)
        except Exception:  # noqa: BLE001 - best effort: never fail the DELETE
            logger.exception("evicting deleted adapter versions failed")

    async def _evict_all(self, adapter_ids: list[str]) -> None:
        await asyncio.gather(*(self._evict(r, a) for r in list(self.router.replicas.values()) for a in adapter_ids))

    async def _evict(self, replica, adapter_id: str) -> None:
        for attempt in range(self.retries):
            try:
                if await replica.client.evict_adapter(adapter_id):
                    self.evicted.append((replica.replica_id, adapter_id))
                replica.resident = replica.resident - {adapter_id}
                return
            except AdapterInUseError:
                await asyncio.sleep(self.retry_delay_s * (attempt + 1))
            except (EngineError, ConnectionError, OSError) as e:
                logger.info("replica %s could not evict %s: %s", replica.replica_id, adapter_id, e)
                return
        logger.warning("replica %s still uses %s after %d attempts; it stays until its LRU drops it",
                       replica.replica_id, adapter_id, self.retries)
