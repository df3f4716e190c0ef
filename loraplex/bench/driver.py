"""Closed-loop load on an in-process engine: C clients, each sends its next request when its previous one ends.

    timings, truncated = closed_loop(engine, plan, adapter_refs, concurrency=16, output_len=600)

Every request asks for exactly ``output_len`` tokens (greedy, EOS ignored). Times are taken when ``step()``
returns (the step's tokens are on the host then). ``soft_deadline``: no new request starts after it;
``hard_deadline``: requests still running are aborted and the run is marked truncated. ``stagger_s``: client k
sends its first request k * stagger_s seconds after the start (with equal output lengths, clients that start
together stay in step and every wave's prompts arrive at once; a stagger of about e2e / C spreads them).
``clock`` and ``sleep`` default to ``time.monotonic`` and ``time.sleep`` (the tests pass a simulated clock).
"""
from __future__ import annotations

import time

from typing import Callable

from loraplex.bench.stats import RequestTiming
from loraplex.bench.workload import PlannedRequest


def closed_loop(engine, plan: list[PlannedRequest], adapter_refs: list, *, concurrency: int, output_len: int,
                prefix: str = "r", soft_deadline: float | None = None, hard_deadline: float | None = None,
                stagger_s: float = 0.0, counters: dict | None = None,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> tuple[list[RequestTiming], bool]:
    """Run ``plan`` at ``concurrency`` in flight; returns (timings of every started request, truncated).
    ``counters["steps"]`` (when given) counts the engine steps taken."""
    from loraplex.engine import SamplingParams

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    timings: dict[str, RequestTiming] = {}
    queue = list(plan)
    truncated = False

    def submit() -> None:
        req = queue.pop(0)
        rid = f"{prefix}{req.index}"
        adapter = adapter_refs[req.adapter] if req.adapter is not None else None
        now = clock()
        timings[rid] = RequestTiming(rid, req.adapter, len(req.prompt), arrival=now)
        engine.add_request(rid, req.prompt, params, adapter=adapter, arrival_time=now)

    start = clock()
    first_sends = [start + k * stagger_s for k in range(min(concurrency, len(queue)))]  # one per client
    while first_sends and first_sends[0] <= start:
        first_sends.pop(0)
        submit()
    while engine.has_unfinished_requests() or first_sends:
        if not engine.has_unfinished_requests():
            sleep(max(0.0, first_sends[0] - clock()))
        while first_sends and first_sends[0] <= clock() and queue:
            first_sends.pop(0)
            submit()
        if not queue or (soft_deadline is not None and clock() >= soft_deadline):
            first_sends.clear()  # finished clients took the remaining requests
        if not engine.has_unfinished_requests():
            continue
        outputs = engine.step()
        now = clock()
        if counters is not None:
            counters["steps"] = counters.get("steps", 0) + 1
        for out in outputs:
            t = timings[out.request_id]
            if out.finish_reason == "error":
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if t.first_token is None and out.output_token_ids:
                t.first_token = now
            if out.finished:
                t.finish, t.output_tokens = now, len(out.output_token_ids)
                if queue and (soft_deadline is None or now < soft_deadline):
                    submit()
        if hard_deadline is not None and now >= hard_deadline and engine.has_unfinished_requests():
            for rid, t in timings.items():
                if t.finish is None:
                    engine.abort(rid)
            truncated = True
            break
    truncated = truncated or bool(queue)
    return list(timings.values()), truncated
