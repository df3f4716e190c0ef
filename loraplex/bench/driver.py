"""Load on an in-process engine: groups of requests, each a closed loop (C clients, each sending its next request
when its previous one ends) or an open loop (requests sent at set times whatever the engine does).

    timings, truncated = closed_loop(engine, plan, adapter_refs, concurrency=16, output_len=600)
    result = drive(engine, [LoadGroup("light", light_plan, 8, arrivals=[0.0, 0.5, 1.0], tenant="light"),
                            LoadGroup("heavy", heavy_plan, 600, concurrency=64, tenant="heavy", background=True)],
                   adapter_refs)

Every request asks for exactly its group's ``output_len`` tokens per completion (greedy, EOS ignored; ``n``
sampled completions at temperature 1 when the group's ``n`` > 1). Times are taken when ``step()`` returns (the step's tokens are on the
host then); a send that falls due during a step goes out when the step returns. ``soft_deadline``: no new request
starts after it; ``hard_deadline``: requests still running are aborted and the run is marked truncated. A
``background`` group (a competing tenant's load) runs only while some other group still has work: once every
foreground request has finished, its running requests are aborted. ``stagger_s``: client k of a closed loop sends
its first request k * stagger_s seconds after the start (with equal output lengths, clients that start together
stay in step and every wave's prompts arrive at once; a stagger of about e2e / C spreads them).

Requests carry a tenant and weight only when their group names a tenant (the fairness scenario): the other
scenarios call ``add_request`` exactly as an engine without tenant-fair scheduling takes it.

Per step the driver records the tokens each group received and how many of its requests were in flight, so a
closed loop's ``steady_tok_s`` counts only the steps during which all its C clients had a request in the engine
(not the ramp-up at the start nor the drain at the end). ``clock`` and ``sleep`` default to ``time.monotonic``
and ``time.sleep`` (the tests pass a simulated clock).
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

from loraplex.bench.stats import RequestTiming
from loraplex.bench.workload import PlannedRequest


@dataclass
class LoadGroup:
    """One group's requests: ``concurrency`` clients (closed loop) or one send time per planned request
    (``arrivals``: seconds from the start, open loop)."""

    name: str
    plan: list[PlannedRequest]
    output_len: int
    concurrency: int | None = None
    arrivals: list[float] | None = None
    stagger_s: float = 0.0
    n: int = 1
    tenant: str | None = None
    weight: float = 1.0
    background: bool = False

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.arrivals is None):
            raise ValueError(f"load group {self.name!r}: give either concurrency (closed loop) or arrivals (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.arrivals is not None and len(self.arrivals) != len(self.plan):
            raise ValueError(f"load group {self.name!r}: {len(self.arrivals)} arrival times for "
                             f"{len(self.plan)} planned requests")
        if self.output_len < 1 or self.n < 1:
            raise ValueError(f"load group {self.name!r}: output_len and n must be >= 1")


@dataclass
class DriveResult:
    timings: list[RequestTiming]
    truncated: bool
    start: float
    end: float
    steps: int = 0
    step_times: list[float] = field(default_factory=list)               # clock after each step
    step_seconds: list[float] = field(default_factory=list)             # wall time of each engine.step() call
    step_outputs: list[int] = field(default_factory=list)               # request outputs each call returned
    tokens: dict[str, list[int]] = field(default_factory=dict)          # group -> tokens received per step
    in_flight: dict[str, list[int]] = field(default_factory=dict)       # group -> its requests in flight per step

    def group_tokens(self, group: str) -> int:
        return sum(self.tokens.get(group, []))

    def steady_tok_s(self, group: str, concurrency: int) -> float | None:
        """Tokens of ``group`` per second over the steps that began with ``concurrency`` of its requests in flight
        (None if no step did)."""
        tokens, seconds, prev = 0, 0.0, self.start
        for t, n, k in zip(self.step_times, self.tokens.get(group, []), self.in_flight.get(group, [])):
            if k >= concurrency:
                tokens += n
                seconds += t - prev
            prev = t
        return tokens / seconds if seconds > 0 else None


def _tokens(out) -> tuple[int, int]:
    """(tokens new in this output, tokens so far) over every completion of the request."""
    outs = getattr(out, "outputs", None)
    if outs:
        return sum(len(c.new_token_ids) for c in outs), sum(len(c.output_token_ids) for c in outs)
    return len(getattr(out, "new_token_ids", out.output_token_ids)), len(out.output_token_ids)


def drive(engine, groups: list[LoadGroup], adapter_refs: list, *, prefix: str = "r",
          soft_deadline: float | None = None, hard_deadline: float | None = None,
          background_stop: float | None = None, on_step: Callable[[float], None] | None = None, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> DriveResult:
    """Run ``groups`` together on ``engine`` (module docstring); ``on_step(now)`` is called after every step.
    ``background_stop``: background groups' running requests are aborted then (the foreground ones go on)."""
    from loraplex.engine import SamplingParams

    if not groups:
        raise ValueError("nothing to drive: no load group")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"load group names must be distinct, got {names}")
    if all(g.background for g in groups):
        raise ValueError("every load group is background: one must be the foreground load")
    # n > 1 samples (greedy would make the n completions equal, which the engine refuses)
    params = {g.name: SamplingParams(max_tokens=g.output_len, temperature=0.0 if g.n == 1 else 1.0, ignore_eos=True,
                                     n=g.n) for g in groups}
    queues = {g.name: list(g.plan) for g in groups}
    timings: dict[str, RequestTiming] = {}
    owner: dict[str, LoadGroup] = {}
    running: dict[str, set[str]] = {g.name: set() for g in groups}
    adapters = getattr(engine, "adapters", None)
    result = DriveResult([], False, clock(), 0.0, tokens={g.name: [] for g in groups},
                         in_flight={g.name: [] for g in groups})
    start = result.start
    sends: list[tuple[float, int, str]] = []  # (due, tie-break, group): first sends of clients, open-loop arrivals
    order = 0
    for g in groups:
        due = ([start + k * g.stagger_s for k in range(min(g.concurrency, len(g.plan)))] if g.concurrency is not None
               else [start + a for a in g.arrivals])
        for t in due:
            sends.append((t, order, g.name))
            order += 1
    heapq.heapify(sends)

    def past_soft(now: float) -> bool:
        return soft_deadline is not None and now >= soft_deadline

    def submit(g: LoadGroup) -> None:
        req = queues[g.name].pop(0)
        rid = f"{prefix}{g.name}-{req.index}" if len(groups) > 1 else f"{prefix}{req.index}"
        adapter = adapter_refs[req.adapter] if req.adapter is not None else None
        cold = None
        if adapter is not None and adapters is not None:
            cold = adapters.slot_of(adapter) is None
        now = clock()
        timings[rid] = RequestTiming(rid, req.adapter, len(req.prompt), arrival=now, group=g.name, tenant=g.tenant,
                                     adapter_cold=cold)
        owner[rid] = g
        running[g.name].add(rid)
        tenant_kw = {"tenant": g.tenant, "weight": g.weight} if g.tenant is not None else {}
        engine.add_request(rid, req.prompt, params[g.name], adapter=adapter, arrival_time=now, **tenant_kw)

    def foreground_done() -> bool:
        fg = [g for g in groups if not g.background]
        return bool(fg) and len(fg) < len(groups) and all(
            not running[g.name] and not queues[g.name] for g in fg)

    by_name = {g.name: g for g in groups}
    while True:
        now = clock()
        while sends and sends[0][0] <= now:
            due, _, name = heapq.heappop(sends)
            if queues[name] and not past_soft(due):  # due before the soft deadline: sent, if a step late
                submit(by_name[name])
        if background_stop is not None and now >= background_stop:
            for g in groups:
                if g.background:
                    for rid in list(running[g.name]):
                        engine.abort(rid)
                        running[g.name].discard(rid)
                    queues[g.name].clear()
        if past_soft(now):
            sends = [x for x in sends if not past_soft(x[0])]
            heapq.heapify(sends)
        elif any(not q for q in queues.values()):  # clients due later find their group's plan taken
            sends = [s for s in sends if queues[s[2]]]
            heapq.heapify(sends)
        if foreground_done():
            for g in groups:
                if g.background:
                    for rid in list(running[g.name]):
                        engine.abort(rid)
                        running[g.name].discard(rid)
            break
        if not engine.has_unfinished_requests():
            if not sends:
                break
            sleep(max(0.0, sends[0][0] - clock()))
            continue
        flight = {g.name: len(running[g.name]) for g in groups}
        began = clock()
        outputs = engine.step()
        now = clock()
        result.steps += 1
        result.step_times.append(now)
        result.step_seconds.append(now - began)
        result.step_outputs.append(len(outputs))
        got = dict.fromkeys(running, 0)
        for out in outputs:
            t = timings[out.request_id]
            g = owner[out.request_id]
            if out.finish_reason == "error":
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            new, total = _tokens(out)
            got[g.name] += new
            if t.first_token is None and total:
                t.first_token = now
            metrics = getattr(out, "metrics", None)
            if t.scheduled is None and metrics is not None and metrics.first_scheduled_time is not None:
                t.scheduled = metrics.first_scheduled_time
            if out.finished:
                t.finish, t.output_tokens = now, total
                running[g.name].discard(out.request_id)
                if g.concurrency is not None and queues[g.name] and not past_soft(now):
                    submit(g)
        for name in running:
            result.tokens[name].append(got[name])
            result.in_flight[name].append(flight[name])
        if on_step is not None:
            on_step(now)
        if hard_deadline is not None and now >= hard_deadline and engine.has_unfinished_requests():
            for rid, t in timings.items():
                if t.finish is None:
                    engine.abort(rid)
            result.truncated = True
            break
    # planned requests of a foreground group that never started: the run stopped early
    result.truncated = result.truncated or any(queues[g.name] for g in groups if not g.background)
    result.timings = list(timings.values())
    result.end = clock()
    return result


def closed_loop(engine, plan: list[PlannedRequest], adapter_refs: list, *, concurrency: int, output_len: int,
                prefix: str = "r", soft_deadline: float | None = None, hard_deadline: float | None = None,
                stagger_s: float = 0.0, counters: dict | None = None,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> tuple[list[RequestTiming], bool]:
    """Run ``plan`` at ``concurrency`` in flight; returns (timings of every started request, truncated).
    ``counters["steps"]`` (when given) counts the engine steps taken."""
    res = drive(engine, [LoadGroup("load", plan, output_len, concurrency=concurrency, stagger_s=stagger_s)],
                adapter_refs, prefix=prefix, soft_deadline=soft_deadline, hard_deadline=hard_deadline, clock=clock,
                sleep=sleep)
    if counters is not None:
        counters["steps"] = counters.get("steps", 0) + res.steps
    return res.timings, res.truncated
