"""Load groups on a scripted engine and a simulated clock: open-loop arrivals at their set times, a tenant and
weight on the fairness scenario's requests only, a background tenant stopped when the foreground one is done (or at
its own deadline), steady throughput over the steps with all C clients in flight; arrival schedules; the auto
ramp. The engine's step and the driver's sleep advance the clock, so times are exact."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loraplex.bench.arrivals import arrival_times
from loraplex.bench.driver import DriveResult, LoadGroup, drive
from loraplex.bench.measure import auto_ramp
from loraplex.bench.workload import request_plan


@dataclass
class _Metrics:
    first_scheduled_time: float | None


@dataclass
class _Out:
    request_id: str
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    metrics: _Metrics
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@dataclass
class SeatEngine:
    """``seats`` requests run at once (one token each per step of ``step_s``), the rest wait in arrival order;
    records what ``add_request`` got. ``tenants=False``: an engine without tenant-fair scheduling, whose
    add_request has no tenant/weight parameters."""

    clock: Clock = field(default_factory=Clock)
    step_s: float = 1.0
    seats: int = 100
    tenants: bool = True
    waiting: list = field(default_factory=list)
    running: dict = field(default_factory=dict)
    added: list = field(default_factory=list)
    aborted: list = field(default_factory=list)

    def add_request(self, rid, prompt, params, adapter=None, arrival_time=None, **tenant):
        if tenant and not self.tenants:
            raise TypeError("add_request() got an unexpected keyword argument 'tenant'")
        self.added.append(dict(rid=rid, at=arrival_time, n=params.n, **tenant))
        self.waiting.append((rid, params.max_tokens * params.n))

    def has_unfinished_requests(self):
        return bool(self.running or self.waiting)

    def abort(self, rid):
        self.aborted.append(rid)
        self.waiting = [w for w in self.waiting if w[0] != rid]
        return self.running.pop(rid, None) is not None

    def step(self):
        while self.waiting and len(self.running) < self.seats:
            rid, n = self.waiting.pop(0)
            self.running[rid] = [n, 0, self.clock.now]
        self.clock.now += self.step_s
        outs = []
        for rid, st in list(self.running.items()):
            st[1] += 1
            done = st[1] == st[0]
            outs.append(_Out(rid, [7] * st[1], [7], done, _Metrics(st[2]), "length" if done else None))
            if done:
                del self.running[rid]
        return outs


def _plan(n, adapters=0):
    return request_plan(num_requests=n, num_adapters=adapters, mix="even", input_len=4, vocab=100)


def run(eng, groups, **kw) -> DriveResult:
    return drive(eng, groups, ["A", "B"], clock=eng.clock, sleep=eng.clock.sleep, **kw)


def test_open_loop_sends_at_its_times_and_waits_idle_between_them():
    eng = SeatEngine(step_s=1.0)
    res = run(eng, [LoadGroup("light", _plan(3), 2, arrivals=[0.0, 5.0, 6.5], tenant="light", weight=2.0)])
    # sent at the set time when the engine is idle (it sleeps until then), at the next step boundary otherwise
    assert [a["at"] for a in eng.added] == [0.0, 5.0, 7.0]
    assert all(a["tenant"] == "light" and a["weight"] == 2.0 for a in eng.added)
    assert [t.first_token - t.arrival for t in res.timings] == [1.0, 1.0, 1.0]
    assert not res.truncated and [t.output_tokens for t in res.timings] == [2, 2, 2]


def test_closed_loops_send_no_tenant_so_an_engine_without_tenants_takes_them():
    eng = SeatEngine(tenants=False)
    res = run(eng, [LoadGroup("load", _plan(4), 3, concurrency=2)])
    assert len(res.timings) == 4 and all("tenant" not in a for a in eng.added)
    with pytest.raises(TypeError, match="tenant"):  # the fairness scenario needs an engine that takes tenants
        run(SeatEngine(tenants=False), [LoadGroup("light", _plan(1), 1, arrivals=[0.0], tenant="light")])


def test_a_background_tenant_stops_when_the_light_one_is_done():
    eng = SeatEngine(step_s=1.0, seats=4)
    light = LoadGroup("light", _plan(2), 2, arrivals=[0.0, 10.0], tenant="light")
    heavy = LoadGroup("heavy", _plan(50), 30, concurrency=3, tenant="heavy", weight=0.5, background=True)
    res = run(eng, [light, heavy])
    lights = [t for t in res.timings if t.group == "light"]
    assert all(t.finish is not None for t in lights) and not res.truncated
    # light's second request arrives at 10 and is done at 12; the heavy requests running then are aborted
    assert eng.clock.now == 12.0 and not eng.has_unfinished_requests()
    heavy_ids = {t.request_id for t in res.timings if t.group == "heavy"}
    assert set(eng.aborted) == heavy_ids and len(heavy_ids) == 3
    assert res.group_tokens("heavy") == 3 * 12 and res.group_tokens("light") == 4
    assert {a["tenant"] for a in eng.added} == {"light", "heavy"}


def test_admission_waits_come_from_the_engine_and_a_starved_tenant_still_reports():
    # one seat: light's request waits behind heavy's; heavy is stopped at its own deadline so light finishes
    eng = SeatEngine(step_s=1.0, seats=1)
    heavy = LoadGroup("heavy", _plan(5), 20, concurrency=1, tenant="heavy", background=True)
    light = LoadGroup("light", _plan(1), 2, arrivals=[1.0], tenant="light")
    res = run(eng, [light, heavy], background_stop=6.0)
    (t,) = [t for t in res.timings if t.group == "light"]
    assert t.arrival == 1.0 and t.scheduled == 6.0 and t.queue_wait == 5.0 and t.finish == 8.0


def test_n_counts_every_completion():
    eng = SeatEngine()
    res = run(eng, [LoadGroup("heavy", _plan(1), 3, concurrency=1, n=4)])
    assert eng.added[0]["n"] == 4 and res.timings[0].output_tokens == 12


def test_steady_throughput_counts_only_steps_with_all_clients_in_flight():
    eng = SeatEngine(step_s=1.0)
    # clients start 2 s apart: 1 in flight during [0, 2), both from 2 on; each request is 4 tokens, 4 requests
    res = run(eng, [LoadGroup("load", _plan(4), 4, concurrency=2, stagger_s=2.0)])
    assert res.steady_tok_s("load", 2) == pytest.approx(2.0)   # two tokens per 1 s step while both run
    assert res.group_tokens("load") / (res.end - res.start) < 2.0  # ramp and drain lower the wall-time figure
    assert res.steady_tok_s("load", 3) is None


def test_load_groups_are_checked():
    with pytest.raises(ValueError, match="either concurrency"):
        LoadGroup("x", _plan(1), 1)
    with pytest.raises(ValueError, match="2 arrival times for 1 planned"):
        LoadGroup("x", _plan(1), 1, arrivals=[0.0, 1.0])
    with pytest.raises(ValueError, match="every load group is background"):
        run(SeatEngine(), [LoadGroup("x", _plan(1), 1, concurrency=1, background=True)])


def test_arrival_schedules():
    assert arrival_times(rate=2.0, duration=2.0, kind="fixed") == [0.0, 0.5, 1.0, 1.5]
    a = arrival_times(rate=4.0, duration=500.0, seed=3)
    assert a == arrival_times(rate=4.0, duration=500.0, seed=3) and a == sorted(a)
    assert 1900 < len(a) < 2100                                  # ~rate x duration
    assert arrival_times(rate=0.01, duration=1.0) == [0.0]       # a short window still sends one
    assert len(arrival_times(rate=10.0, duration=10.0, kind="fixed", limit=7)) == 7
    with pytest.raises(ValueError, match="choose poisson or fixed"):
        arrival_times(rate=1.0, duration=1.0, kind="bursty")


def test_auto_ramp_is_the_previous_levels_e2e_estimate():
    assert auto_ramp(None, 600, None) == 0.0
    prev = {"ttft_p50_ms": 50.0, "tpot_p50_ms": 10.0}
    assert auto_ramp(prev, 600, None) == pytest.approx(6.05)
    assert auto_ramp(prev, 600, 4.0) == 4.0
    assert auto_ramp({"ttft_p50_ms": 5.0, "tpot_p50_ms": float("nan")}, 600, None) == 0.0
