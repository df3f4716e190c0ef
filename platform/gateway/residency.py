"""ResidencyPoller: every ``interval_s`` asks each replica what it holds and tells the router (affinity); it is
also the router's health probe: a replica marked down (by a failed request or a failed poll) comes back into the
rotation only when a poll that began after its last failure succeeds (the gateway's router runs with
``RouterConfig(probe_interval_s=interval_s)``), so requests are never the ones to test a dead replica.

A replica that refuses the connection or errors is marked down at once. One that is merely slow to answer (a
busy CPU engine, a long step) is marked down only after ``slow_polls_down`` consecutive timed-out polls: marking
a busy but healthy replica down sent every request to the others and, with all of them busy, answered 503
``engine_unavailable`` (found by the load tests)."""
from __future__ import annotations

import asyncio
import logging

from loraplex.platform.core.tasks import cancel_and_wait
from loraplex.platform.engines.errors import EngineError
from loraplex.platform.routing import Router

logger = logging.getLogger(__name__)


class ResidencyPoller:
    def __init__(self, router: Router, *, interval_s: float, slow_polls_down: int = 3) -> None:
        if slow_polls_down < 1:
            raise ValueError(f"slow_polls_down must be >= 1, got {slow_polls_down}")
        self.router, self.interval_s, self.slow_polls_down = router, interval_s, slow_polls_down
        self._task: asyncio.Task | None = None
        self._slow: dict[str, int] = {}     # replica id -> consecutive timed-out polls
        self.polls = 0

    async def poll_once(self) -> None:
        """One round over every replica (concurrently); a failing replica is marked down."""
        async def one(replica) -> None:
            failures_seen = replica.failures
            try:
                residency = await asyncio.wait_for(replica.client.residency(), timeout=self.interval_s)
            except (EngineError, ConnectionError, asyncio.TimeoutError, OSError) as e:
                if isinstance(e, asyncio.TimeoutError):
                    slow = self._slow[replica.replica_id] = self._slow.get(replica.replica_id, 0) + 1
                    if slow < self.slow_polls_down:
                        return      # busy, not gone: keep its last residency and its place in the rotation
                    e = TimeoutError(f"no answer within {self.interval_s} s, {slow} polls in a row")
                if replica.is_up(self.router._clock()):
                    logger.warning("residency of replica %s unavailable: %s", replica.replica_id, e)
                    self.router.mark_down(replica.replica_id)
                return
            self._slow.pop(replica.replica_id, None)
            self.router.update_residency(replica.replica_id, residency.resident_ids)
            if replica.consecutive_failures or replica.awaiting_probe:
                self.router.mark_up(replica.replica_id, failures_seen=failures_seen)

        await asyncio.gather(*(one(r) for r in self.router.replicas.values()))
        self.polls += 1

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad round
                logger.exception("residency poll failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loraplex-residency-poller")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
