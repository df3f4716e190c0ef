"""Router: stable assignment, spread, bounded load, residency preference, failover with cool-down."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from loraplex.platform.routing import NoReplicaAvailableError, Replica, Router, RouterConfig, hrw_rank


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make_router(n=4, clock=None, **cfg):
    return Router([Replica(f"r{i}") for i in range(n)], RouterConfig(**cfg), clock=clock or Clock())


def test_assignment_is_stable_and_moves_minimally():
    router = make_router(4)
    adapters = [f"tenant/adapter-{i}/1" for i in range(400)]
    first = {a: router.choose(a).replica_id for a in adapters}
    again = {a: make_router(4).choose(a).replica_id for a in adapters}  # another process, same answer
    assert first == again
    # removing r3 moves only r3's adapters
    three = Router([Replica(f"r{i}") for i in range(3)])
    moved = [a for a in adapters if three.choose(a).replica_id != first[a]]
    assert set(moved) == {a for a in adapters if first[a] == "r3"}


def test_spread_over_replicas():
    router = make_router(4)
    counts = Counter(router.choose(f"t/a{i}/1").replica_id for i in range(2000))
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert all(400 <= c <= 600 for c in counts.values()), counts


def test_bounded_load_skips_a_hot_replica():
    router = make_router(4, load_epsilon=0.25)
    hot = "t/hot/1"
    owner = router.choose(hot)
    picks = []
    for _ in range(40):  # one adapter, 40 concurrent requests: the owner takes its bounded share only
        r = router.choose(hot)
        r.in_flight += 1
        picks.append(r.replica_id)
    loads = {r.replica_id: r.in_flight for r in router.replicas.values()}
    assert loads[owner.replica_id] == max(loads.values())
    assert max(loads.values()) <= 13  # ceil(1.25 * 40 / 4) = 13
    assert picks[0] == owner.replica_id and len(set(picks)) == 4


def test_residency_wins_over_hash_order_but_not_over_load():
    router = make_router(3)
    adapter = "t/res/1"
    order = hrw_rank(adapter, ["r0", "r1", "r2"])
    holder = order[-1]
    router.update_residency(holder, [adapter, "t/other/1"])
    assert router.choose(adapter).replica_id == holder
    router.replicas[holder].in_flight = 10  # far above the mean: skipped despite residency
    assert router.choose(adapter).replica_id == order[0]
    assert router.choose(None).replica_id != holder  # base model: least loaded


def test_track_counts_in_flight_and_learns_residency():
    router = make_router(2)
    r = router.choose("t/x/1")
    with router.track(r, "t/x/1"):
        assert r.in_flight == 1
    assert r.in_flight == 0 and "t/x/1" in r.resident


def test_failover_cooldown_and_recovery():
    clock = Clock()
    router = make_router(3, clock=clock, cooldown_s=5.0, max_cooldown_s=20.0)
    adapter = "t/fo/1"
    first, second, _ = hrw_rank(adapter, ["r0", "r1", "r2"])
    calls = []

    async def fn(replica):
        calls.append(replica.replica_id)
        if replica.replica_id == first:
            raise ConnectionError("refused")
        return replica.replica_id

    assert asyncio.run(router.call(adapter, fn)) == second
    assert calls == [first, second]
    calls.clear()
    assert asyncio.run(router.call(adapter, fn)) == second and calls == [second]  # cooling down: skipped
    clock.t += 5.1
    assert asyncio.run(router.call(adapter, fn)) == second and calls == [second, first, second]
    assert router.replicas[first].down_until == pytest.approx(clock.t + 10.0)  # doubled
    clock.t += 10.1

    async def healthy(replica):
        return replica.replica_id

    assert asyncio.run(router.call(adapter, healthy)) == first
    assert router.replicas[first].consecutive_failures == 0


def test_with_probes_a_failed_replica_waits_for_a_probe_not_a_request():
    clock = Clock()
    router = make_router(3, clock=clock, cooldown_s=1.0, probe_interval_s=2.0)
    adapter = "t/probe/1"
    first, second, _ = hrw_rank(adapter, ["r0", "r1", "r2"])
    calls = []
    broken = {first}

    async def fn(replica):
        calls.append(replica.replica_id)
        if replica.replica_id in broken:
            raise ConnectionError("refused")
        return replica.replica_id

    assert asyncio.run(router.call(adapter, fn)) == second and calls == [first, second]
    broken.clear()                                      # alive again, but no probe has said so
    clock.t += 3600
    calls.clear()
    for _ in range(3):
        assert asyncio.run(router.call(adapter, fn)) == second
    assert calls == [second] * 3                        # never retried by a request, cool-down long past
    seen = router.replicas[first].failures
    router.mark_down(first)                             # a failure while that probe was in flight
    assert router.mark_up(first, failures_seen=seen) is False
    assert not router.replicas[first].is_up(clock.t)
    assert router.mark_up(first, failures_seen=router.replicas[first].failures) is True
    assert asyncio.run(router.call(adapter, fn)) == first and router.replicas[first].consecutive_failures == 0


def test_with_probes_a_request_success_does_not_undo_a_concurrent_failure():
    router = make_router(1, probe_interval_s=2.0)
    replica = router.replicas["r0"]

    async def scenario():
        started, release = asyncio.Event(), asyncio.Event()

        async def slow_ok(r):
            started.set()
            await release.wait()
            return "ok"

        task = asyncio.create_task(router.call(None, slow_ok))
        await started.wait()
        router.mark_down("r0")                          # another request to it died meanwhile
        release.set()
        assert await task == "ok"
        assert not replica.is_up(0.0)
        with pytest.raises(NoReplicaAvailableError) as e:
            router.choose(None)
        assert e.value.retry_after_s == pytest.approx(2.0)   # the next probe, not a cool-down

    asyncio.run(scenario())


def test_all_down_raises_with_retry_after():
    clock = Clock()
    router = make_router(2, clock=clock, cooldown_s=3.0)

    async def dead(replica):
        raise ConnectionError("refused")

    with pytest.raises(NoReplicaAvailableError, match="no engine replica could take the request"):
        asyncio.run(router.call("t/a/1", dead))
    with pytest.raises(NoReplicaAvailableError, match="no engine replica is available") as e:
        router.choose("t/a/1")
    assert e.value.retry_after_s == pytest.approx(3.0)
    assert all(r.in_flight == 0 for r in router.replicas.values())


def test_stream_fails_over_before_the_first_item_only():
    router = make_router(2)
    adapter = "t/s/1"
    first, second = hrw_rank(adapter, ["r0", "r1"])

    async def open_stream(replica):
        if replica.replica_id == first:
            raise ConnectionError("refused")
        for i in range(3):
            yield f"{replica.replica_id}:{i}"

    async def collect(opener):
        return [x async for x in router.stream(adapter, opener)]

    assert asyncio.run(collect(open_stream)) == [f"{second}:0", f"{second}:1", f"{second}:2"]

    async def dies_midway(replica):
        yield "token"
        raise ConnectionError("reset")

    router2 = make_router(2)

    async def collect2():
        return [x async for x in router2.stream(adapter, dies_midway)]

    with pytest.raises(ConnectionError, match="reset"):
        asyncio.run(collect2())
    chosen = router2.replicas[hrw_rank(adapter, ["r0", "r1"])[0]]
    assert chosen.consecutive_failures == 1 and chosen.in_flight == 0  # not retried: a token was already out


def test_config_validation():
    with pytest.raises(ValueError, match="load_epsilon must be > 0"):
        RouterConfig(load_epsilon=0)
    with pytest.raises(ValueError, match="probe_interval_s must be > 0"):
        RouterConfig(probe_interval_s=0)
    with pytest.raises(ValueError, match="duplicate replica id 'a'"):
        Router([Replica("a"), Replica("a")])
    with pytest.raises(ValueError, match="at least one replica"):
        Router([])
