"""The closed-loop driver against a scripted engine: at most C requests in flight, every request gets its
tokens, staggered starts, deadlines."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from loraplex.bench.driver import closed_loop
from loraplex.bench.workload import request_plan


@dataclass
class _Out:
    request_id: str
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class FakeEngine:
    """One token per running request per step; records the most requests ever in flight."""

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
        time.sleep(self.step_s)
        outs = []
        for rid, (n, toks) in list(self.running.items()):
            toks.append(7)
            if rid == self.fail:
                del self.running[rid]
                outs.append(_Out(rid, list(toks), True, "error", "adapter did not load"))
                continue
            done = len(toks) == n
            outs.append(_Out(rid, list(toks), done, "length" if done else None))
            if done:
                del self.running[rid]
        return outs


def _plan(n, adapters=2):
    return request_plan(num_requests=n, num_adapters=adapters, mix="even", input_len=4, vocab=100)


def test_closed_loop_keeps_c_in_flight_and_counts_tokens():
    eng = FakeEngine()
    refs = ["A", "B"]
    timings, truncated = closed_loop(eng, _plan(10), refs, concurrency=3, output_len=4)
    assert not truncated and eng.max_in_flight == 3 and len(eng.added) == 10
    assert [a for _, a, _ in eng.added] == ["A", "B"] * 5
    assert all(t.output_tokens == 4 and t.arrival <= t.first_token <= t.finish for t in timings)


def test_stagger_spreads_the_first_requests():
    eng = FakeEngine(step_s=0.001)
    closed_loop(eng, _plan(3), ["A", "B"], concurrency=3, output_len=50, stagger_s=0.02)
    arrivals = [a for _, _, a in eng.added]
    assert arrivals[1] - arrivals[0] >= 0.019 and arrivals[2] - arrivals[1] >= 0.019


def test_hard_deadline_aborts_and_marks_truncated():
    eng = FakeEngine(step_s=0.002)
    timings, truncated = closed_loop(eng, _plan(6), ["A", "B"], concurrency=2, output_len=1000,
                                     hard_deadline=time.monotonic() + 0.05)
    assert truncated and not eng.running
    assert all(t.finish is None for t in timings)


def test_failed_request_raises_with_the_engine_error():
    eng = FakeEngine(fail="r0")
    with pytest.raises(RuntimeError, match="request r0 failed: adapter did not load"):
        closed_loop(eng, _plan(2), ["A", "B"], concurrency=2, output_len=3)
