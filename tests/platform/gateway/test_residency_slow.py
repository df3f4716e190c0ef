"""A replica that is slow to answer its residency poll (busy, not gone) stays in the rotation until
``slow_polls_down`` polls in a row time out; a refused connection still marks it down at once."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from loraplex.platform.gateway.residency import ResidencyPoller
from loraplex.platform.routing import Replica, Router, RouterConfig


class Client:
    def __init__(self) -> None:
        self.delay_s, self.refuse = 0.0, False

    async def residency(self):
        if self.refuse:
            raise ConnectionRefusedError("connection refused")
        await asyncio.sleep(self.delay_s)
        return SimpleNamespace(resident_ids=["t/a/1"])


def test_slow_replica_is_marked_down_only_after_consecutive_timeouts():
    slow, refusing = Client(), Client()
    router = Router([Replica("slow", slow), Replica("refusing", refusing)])
    poller = ResidencyPoller(router, interval_s=0.05, slow_polls_down=3)

    async def scenario():
        await poller.poll_once()
        assert router.replicas["slow"].resident == frozenset({"t/a/1"})
        slow.delay_s, refusing.refuse = 0.2, True
        for _ in range(2):
            await poller.poll_once()
            assert router.replicas["slow"].is_up(router._clock()), "a busy replica was marked down"
        assert not router.replicas["refusing"].is_up(router._clock())     # refused: down at once
        await poller.poll_once()                                          # third timeout in a row
        assert not router.replicas["slow"].is_up(router._clock())
        slow.delay_s = 0.0
        await poller.poll_once()                                          # answers again: back up
        assert router.replicas["slow"].is_up(router._clock())
        slow.delay_s = 0.2
        await poller.poll_once()                                          # the count restarted
        assert router.replicas["slow"].is_up(router._clock())

    asyncio.run(scenario())


def test_a_replica_a_request_marked_down_returns_only_on_a_poll_begun_after_the_failure():
    client = Client()
    router = Router([Replica("one", client)], RouterConfig(probe_interval_s=0.05))
    poller = ResidencyPoller(router, interval_s=0.05)
    replica = router.replicas["one"]

    async def scenario():
        asked, answer = asyncio.Event(), asyncio.Event()

        async def held_residency():
            asked.set()
            await answer.wait()
            return SimpleNamespace(resident_ids=["t/a/1"])

        client.residency = held_residency
        poll = asyncio.create_task(poller.poll_once())
        await asyncio.wait_for(asked.wait(), 10)             # the poll has asked while the replica is up
        router.mark_down("one")                              # a request to it fails meanwhile
        answer.set()
        await poll
        del client.residency
        assert not replica.is_up(router._clock()), "a poll older than the failure brought the replica back"
        await poller.poll_once()
        assert replica.is_up(router._clock()) and replica.resident == frozenset({"t/a/1"})

    asyncio.run(scenario())
