"""Router: adapter-affinity over engine replicas.

    order = HRW rank of the adapter id over the replicas that are up
    cap   = ceil((1 + epsilon) * (total in-flight + 1) / replicas up)      (bounded load)
    pick  = first replica in ``order`` that holds the adapter and is under cap,
            else the first replica in ``order`` under cap
    base-model requests (no adapter) go to the least-loaded replica up

A connection error marks the replica down. With ``probe_interval_s`` set (the gateway: its residency poller
probes every replica that often) it stays out of the rotation until a probe that began after the failure
succeeds (``mark_up(..., failures_seen=...)``): requests never test a dead replica. Without it, it is down for
``cooldown_s`` (doubling per consecutive failure, up to ``max_cooldown_s``), then tried again and one success
marks it up. ``stream`` and ``call`` retry the next replica in order when the chosen one is unreachable before
anything was produced.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Iterable, Iterator, TypeVar

from loraplex.platform.routing.rendezvous import hrw_rank
from loraplex.platform.routing.replica import Replica

logger = logging.getLogger(__name__)
T = TypeVar("T")


class NoReplicaAvailableError(ConnectionError):
    """Every replica is down (or failed this request); ``retry_after_s`` is when the first comes back."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class RouterConfig:
    load_epsilon: float = 0.25        # a replica above (1 + epsilon) x mean in-flight is skipped
    cooldown_s: float = 5.0           # first cool-down after a connection error
    max_cooldown_s: float = 60.0
    max_attempts: int = 3             # replicas tried per request by stream()/call()
    probe_interval_s: float | None = None   # set: a down replica returns only when a health probe succeeds

    def __post_init__(self) -> None:
        if self.probe_interval_s is not None and not self.probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0 (or None), got {self.probe_interval_s}")
        if not self.load_epsilon > 0:
            raise ValueError(f"load_epsilon must be > 0, got {self.load_epsilon}")
        if not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ValueError(f"need 0 < cooldown_s <= max_cooldown_s, got {self.cooldown_s}, {self.max_cooldown_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


class Router:
    """Chooses a replica per request. Single event loop: no locking (counters change between awaits only)."""

    def __init__(self, replicas: Iterable[Replica], config: RouterConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 retry_on: tuple[type[BaseException], ...] = (ConnectionError,)) -> None:
        self.config = config or RouterConfig()
        self.replicas: dict[str, Replica] = {}
        for r in replicas:
            if r.replica_id in self.replicas:
                raise ValueError(f"duplicate replica id {r.replica_id!r}")
            self.replicas[r.replica_id] = r
        if not self.replicas:
            raise ValueError("a router needs at least one replica")
        self._clock = clock
        self.retry_on = retry_on

    # ---- state ----------------------------------------------------------------------------------------------
    def update_residency(self, replica_id: str, adapter_ids: Iterable[str]) -> None:
        """Replace what ``replica_id`` reports resident (from its ``residency()``: GPU slots and CPU tier)."""
        self.replicas[replica_id].resident = frozenset(adapter_ids)

    def mark_down(self, replica_id: str) -> None:
        """Takes ``replica_id`` out of the rotation: until a health probe succeeds (``probe_interval_s`` set), else
        for its cool-down."""
        r = self.replicas[replica_id]
        r.consecutive_failures += 1
        r.failures += 1
        if self.config.probe_interval_s is not None:
            if not r.awaiting_probe:
                logger.warning("replica %s marked down until a health probe answers", replica_id)
            r.awaiting_probe = True
            return
        cooldown = min(self.config.cooldown_s * 2 ** (r.consecutive_failures - 1), self.config.max_cooldown_s)
        r.down_until = self._clock() + cooldown
        logger.warning("replica %s marked down for %.1f s (%d consecutive failures)", replica_id, cooldown,
                       r.consecutive_failures)

    def mark_up(self, replica_id: str, *, failures_seen: int | None = None) -> bool:
        """Puts ``replica_id`` back in the rotation. ``failures_seen``: its ``failures`` when the probe that proves
        it healthy began; a failure marked since then wins (the probe's answer predates it). True if marked up."""
        r = self.replicas[replica_id]
        if failures_seen is not None and r.failures != failures_seen:
            return False
        if r.consecutive_failures or r.awaiting_probe:
            logger.info("replica %s is up again", replica_id)
        r.consecutive_failures = 0
        r.down_until = 0.0
        r.awaiting_probe = False
        return True

    def _succeeded(self, replica_id: str) -> None:
        # A request's success proves health only under cool-downs; with probes, a replica marked down while this
        # request ran (another request failed) waits for its probe.
        if self.config.probe_interval_s is None:
            self.mark_up(replica_id)

    # ---- choice ---------------------------------------------------------------------------------------------
    def candidates(self, adapter_id: str | None, exclude: Iterable[str] = ()) -> list[Replica]:
        """Replicas up, in the order they should be tried for ``adapter_id`` (the first is the choice)."""
        now = self._clock()
        skip = set(exclude)
        up = [r for r in self.replicas.values() if r.is_up(now) and r.replica_id not in skip]
        if not up:
            return []
        cap = math.ceil((1 + self.config.load_epsilon) * (sum(r.in_flight for r in up) + 1) / len(up))
        if adapter_id is None:
            return sorted(up, key=lambda r: (r.in_flight, r.replica_id))
        by_id = {r.replica_id: r for r in up}
        order = [by_id[i] for i in hrw_rank(adapter_id, by_id)]
        under = [r for r in order if r.in_flight < cap]
        over = [r for r in order if r.in_flight >= cap]
        resident = [r for r in under if adapter_id in r.resident]
        rest = [r for r in under if adapter_id not in r.resident]
        return resident + rest + over

    def choose(self, adapter_id: str | None, exclude: Iterable[str] = ()) -> Replica:
        """The replica for one request; raises ``NoReplicaAvailableError`` when every one is down."""
        order = self.candidates(adapter_id, exclude)
        if not order:
            now = self._clock()
            waits = [self.config.probe_interval_s if r.awaiting_probe else r.down_until - now
                     for r in self.replicas.values() if r.replica_id not in set(exclude)]
            retry = max(0.0, min(waits)) if waits else None
            raise NoReplicaAvailableError("no engine replica is available; retry shortly", retry)
        return order[0]

    @contextmanager
    def track(self, replica: Replica, adapter_id: str | None = None) -> Iterator[Replica]:
        """Count one in-flight request on ``replica`` for the duration; remember it now holds ``adapter_id``."""
        replica.in_flight += 1
        if adapter_id is not None and adapter_id not in replica.resident:
            replica.resident = replica.resident | {adapter_id}  # it loads it now; reports will confirm
        try:
            yield replica
        finally:
            replica.in_flight -= 1

    # ---- calls with failover ----------------------------------------------------------------------------------
    async def call(self, adapter_id: str | None, fn: Callable[[Replica], Awaitable[T]]) -> T:
        """``await fn(replica)`` on the chosen replica, failing over on ``retry_on`` errors."""
        tried: list[str] = []
        last: BaseException | None = None
        for _ in range(self.config.max_attempts):
            try:
                replica = self.choose(adapter_id, exclude=tried)
            except NoReplicaAvailableError:
                break
            tried.append(replica.replica_id)
            with self.track(replica, adapter_id):
                try:
                    result = await fn(replica)
                except self.retry_on as e:
                    self.mark_down(replica.replica_id)
                    last = e
                    continue
            self._succeeded(replica.replica_id)
            return result
        raise NoReplicaAvailableError(f"no engine replica could take the request (tried {len(tried)})") from last

    async def stream(self, adapter_id: str | None, open_stream: Callable[[Replica], AsyncIterator[T]],
                     exclude: Iterable[str] = ()) -> AsyncIterator[T]:
        """Items of ``open_stream(replica)``; fails over while the stream has produced nothing yet. Once the first
        item is out, an error propagates (tokens were sent; a retry would repeat them) and a ``retry_on`` error marks
        the replica down. ``exclude``: replicas not to try (e.g. the one a caller's earlier attempt died on)."""
        skip = list(exclude)
        tried: list[str] = []
        last: BaseException | None = None
        for _ in range(self.config.max_attempts):
            try:
                replica = self.choose(adapter_id, exclude=skip + tried)
            except NoReplicaAvailableError:
                break
            tried.append(replica.replica_id)
            with self.track(replica, adapter_id):
                it = open_stream(replica)
                try:
                    first = await it.__anext__()
                except StopAsyncIteration:
                    self._succeeded(replica.replica_id)
                    return
                except self.retry_on as e:
                    self.mark_down(replica.replica_id)
                    last = e
                    await _aclose(it)
                    continue
                self._succeeded(replica.replica_id)
                try:
                    yield first
                    async for item in it:
                        yield item
                except self.retry_on:
                    self.mark_down(replica.replica_id)
                    raise
                finally:
                    await _aclose(it)
                return
        raise NoReplicaAvailableError(f"no engine replica could take the request (tried {len(tried)})") from last


async def _aclose(it) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()
