"""EngineStatsPoller: reads each engine replica's stats dict and feeds ``PlatformMetrics``' engine gauges.

    poller = EngineStatsPoller(metrics, {"engine-0": inprocess_source(async_engine)})
    await poller.refresh()          # poll if the last poll is older than ``max_age_s`` (the /metrics route and the
                                    # dashboard call this, so a scrape always sees fresh gauges)
    poller.start() / await poller.stop()    # or poll every ``interval_s`` in the background (app lifespan)

A source is any callable returning the dict of ``loraplex.engine.stats.engine_stats``, sync (run in a worker
thread) or async. A source that raises or times out marks its replica down (``loraplex_engine_up`` 0).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Awaitable, Callable, Mapping, Union

from loraplex.platform.core.tasks import cancel_and_wait
from loraplex.platform.metrics.platform_metrics import PlatformMetrics

logger = logging.getLogger(__name__)

StatsSource = Callable[[], Union[dict, Awaitable[dict]]]


class EngineStatsPoller:
    """Polls every source at most once per ``max_age_s`` on demand, or every ``interval_s`` in the background."""

    def __init__(self, metrics: PlatformMetrics, sources: Mapping[str, StatsSource] | None = None, *,
                 interval_s: float = 2.0, timeout_s: float = 2.0, max_age_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0 or interval_s <= 0:
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s}, {timeout_s}")
        self.metrics = metrics
        self.sources: dict[str, StatsSource] = dict(sources or {})
        self.interval_s, self.timeout_s, self.max_age_s = interval_s, timeout_s, max_age_s
        self.clock = clock
        self._last_poll: float | None = None
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None

    def add_source(self, replica: str, source: StatsSource) -> None:
        if not callable(source):
            raise TypeError(f"the stats source of {replica!r} must be callable, got {type(source).__name__}")
        self.sources[replica] = source

    def remove_source(self, replica: str) -> None:
        self.sources.pop(replica, None)
        self.metrics.engines.pop(replica, None)

    async def _poll_one(self, replica: str, source: StatsSource) -> None:
        try:
            if inspect.iscoroutinefunction(source):
                stats = await asyncio.wait_for(source(), self.timeout_s)
            else:
                stats = await asyncio.wait_for(asyncio.to_thread(source), self.timeout_s)
                if inspect.isawaitable(stats):
                    stats = await asyncio.wait_for(stats, self.timeout_s)
            if not isinstance(stats, dict):
                raise TypeError(f"stats source returned {type(stats).__name__}, expected a dict")
        except Exception as e:  # noqa: BLE001 - one replica down must not stop the others' metrics
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            logger.warning("engine stats of %s unavailable: %s", replica, reason)
            self.metrics.mark_engine_down(replica, reason)
            return
        self.metrics.apply_engine_stats(replica, stats)

    async def poll_once(self) -> None:
        """Poll every source now (concurrently)."""
        self._last_poll = self.clock()
        await asyncio.gather(*(self._poll_one(r, s) for r, s in list(self.sources.items())))

    async def refresh(self, max_age_s: float | None = None) -> None:
        """Poll unless the last poll is younger than ``max_age_s`` (concurrent callers share one poll)."""
        max_age = self.max_age_s if max_age_s is None else max_age_s
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._last_poll is not None and self.clock() - self._last_poll < max_age:
                return
            await self.poll_once()

    async def run(self) -> None:
        """Poll every ``interval_s`` until cancelled."""
        while True:
            await self.refresh(max_age_s=0.0)
            await asyncio.sleep(self.interval_s)

    def start(self) -> asyncio.Task:
        """Start ``run()`` as a task of the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="loraplex-engine-stats")
        return self._task

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
