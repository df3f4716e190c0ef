"""The closed-loop driver against a scripted engine on a simulated clock: at most C requests in flight, every
request gets its tokens, staggered starts, deadlines. The engine's step and the driver's sleep advance the clock,
so arrival times are exact and no test depends on the machine's speed."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loraplex.bench.driver import LoadGroup, closed_loop, drive
from loraplex.bench.workload import request_plan


@dataclass
class _Out:
    request_id: str
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Clock:
    now: float = 0.0
    slept: list = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@dataclass
class FakeEngine:
    """One token per running request per step (each step takes ``step_s`` of the clock); records the most
    requests ever in flight."""

    clock: Clock = field(default_factory=Clock)
    step_s: float = 0.0
    running: dict = field(default_factory=dict)
    added: list = field(default_factory=list)
    max_in_flight: int = 0
    fail: str | None = None

    def add_request(self, rid, prompt, params, adapter=None, arrival_time=None):
        self.running[rid] = (params.max_tokens, [])
        self.added.append((rid, adapter, arrival_time))
        self.max_in_flight = max(self.max_in_flight, len(self.running))

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort(self, rid):
        return self.running.pop(rid, None) is not None

    def step(self):
        self.clock.now += self.step_s
        outs = []
        for rid, (n, toks) in list(self.running.items()):
            toks.append(7)
            if rid == self.fail:
                del self.running[rid]
                outs.append(_Out(rid, list(toks), [7], True, "error", "adapter did not load"))
                continue
            done = len(toks) == n
            outs.append(_Out(rid, list(toks), [7], done, "length" if done else None))
            if done:
                del self.running[rid]
        return outs


def _plan(n, adapters=2):
    return request_plan(num_requests=n, num_adapters=adapters, mix="even", input_len=4, vocab=100)


def run(eng, plan, **kw):
    return closed_loop(eng, plan, ["A", "B"], clock=eng.clock, sleep=eng.clock.sleep, **kw)


def test_closed_loop_keeps_c_in_flight_and_counts_tokens():
    eng = FakeEngine(step_s=1.0)
    timings, truncated = run(eng, _plan(10), concurrency=3, output_len=4)
    assert not truncated and eng.max_in_flight == 3 and len(eng.added) == 10
    assert [a for _, a, _ in eng.added] == ["A", "B"] * 5
    assert all(t.output_tokens == 4 and t.arrival < t.first_token < t.finish for t in timings)
    # closed loop: a client's next request is sent the moment its previous one finished (same step)
    assert sorted(t.finish for t in timings[:3]) == sorted(t.arrival for t in timings[3:6]) == [4.0] * 3


def test_each_step_call_is_timed_with_its_output_count():
    eng = FakeEngine(step_s=0.5)
    res = drive(eng, [LoadGroup("load", _plan(4), 3, concurrency=2)], ["A", "B"], clock=eng.clock,
                sleep=eng.clock.sleep)
    assert res.steps == len(res.step_seconds) == len(res.step_outputs) == 6
    assert res.step_seconds == [0.5] * 6                    # the engine's step time, not the driver's work around it
    assert res.step_outputs == [2, 2, 2, 2, 2, 2]           # two clients in flight, one output each per step


def test_stagger_spreads_the_first_requests_while_the_engine_runs():
    eng = FakeEngine(step_s=1.0)
    run(eng, _plan(3), concurrency=3, output_len=50, stagger_s=20.0)
    # client k's first request goes out at the first step boundary at or after k * stagger (steps of 1 s)
    assert [a for _, _, a in eng.added] == [0.0, 20.0, 40.0]
    assert eng.clock.slept == []      # the engine had work all along: no idle wait


def test_clients_that_finish_before_the_later_ones_start_take_the_remaining_requests():
    eng = FakeEngine(step_s=1.0)
    timings, truncated = run(eng, _plan(3), concurrency=3, output_len=2, stagger_s=10.0)
    # client 0's request is done after 2 steps and it sends the next one at once; clients 1 and 2, due at 10 s
    # and 20 s, find the plan taken and never start
    assert [a for _, _, a in eng.added] == [0.0, 2.0, 4.0] and not truncated
    assert [t.finish for t in timings] == [2.0, 4.0, 6.0] and eng.max_in_flight == 1


def test_soft_deadline_starts_no_new_request():
    eng = FakeEngine(step_s=1.0)
    timings, truncated = run(eng, _plan(8), concurrency=2, output_len=3, soft_deadline=5.0)
    assert truncated                                           # planned requests were left out
    assert [t.arrival for t in timings] == [0.0, 0.0, 3.0, 3.0]
    assert all(t.finish == t.arrival + 3.0 for t in timings)   # the started ones ran to the end


def test_hard_deadline_aborts_and_marks_truncated():
    eng = FakeEngine(step_s=2.0)
    timings, truncated = run(eng, _plan(6), concurrency=2, output_len=1000, hard_deadline=50.0)
    assert truncated and not eng.running
    assert all(t.finish is None for t in timings) and len(timings) == 2
    assert eng.clock.now == 50.0                               # stopped at the first step past the deadline


def test_failed_request_raises_with_the_engine_error():
    eng = FakeEngine(fail="r0")
    with pytest.raises(RuntimeError, match="request r0 failed: adapter did not load"):
        run(eng, _plan(2), concurrency=2, output_len=3)


def test_concurrency_below_one_is_refused():
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        run(FakeEngine(), _plan(2), concurrency=0, output_len=3)
