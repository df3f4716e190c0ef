"""One measured run of a scenario (``Measurement``: its load groups, warm-up and time cap) and its report row.

    m = Measurement("bf16 base-only C=64", [LoadGroup("load", plan, 600, concurrency=64)], primary="load",
                    concurrency=64, input_len=1600, output_len=600, variant="base-only", warmup_requests=64)
    row = summarize_run(m, result, peak_memory_gib=None, engine_figures={...})

The row is a ``ScenarioSummary`` of the primary group's requests; ``extra`` adds the level and variant, the
requests per adapter, every group's own figures (a fairness run's heavy tenant), the wait for admission split by
whether the request's adapter was resident when it was sent, and what the engine reported (graph steps, KV usage
peak, resident adapters, adapter load latency).
"""
from __future__ import annotations

import resource
from dataclasses import dataclass, field

from loraplex.bench.driver import DriveResult, LoadGroup
from loraplex.bench.stats import RequestTiming, ScenarioSummary, p50_p99, summarize


@dataclass
class Measurement:
    name: str
    groups: list[LoadGroup]
    primary: str                       # the group whose requests the row describes
    concurrency: int                   # the level (closed loop) or the primary group's mean in flight (open loop)
    input_len: int
    output_len: int
    variant: str | None = None         # what the sweep's plot draws as one line: "base-only", "32 adapters r32"
    warmup_requests: int = 0           # warm-up before the run (0: none)
    warmup_adapters: int = 0           # adapters the warm-up cycles through (each loaded once)
    time_s: float | None = None        # no new request after this many seconds
    hard_s: float | None = None        # running requests aborted after this many (default: twice time_s)
    background_s: float | None = None  # background groups' running requests aborted after this many
    phase: str | None = None           # the engine phase (report["engine"] key)
    extra: dict = field(default_factory=dict)

    def group(self, name: str) -> LoadGroup:
        return next(g for g in self.groups if g.name == name)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _group_figures(timings: list[RequestTiming], tokens: int, seconds: float) -> dict:
    done = [t for t in timings if t.finish is not None and t.first_token is not None]
    ttft = p50_p99([t.ttft for t in done], 1e3)
    return {"requests_started": len(timings), "requests_completed": len(done), "output_tokens": tokens,
            "output_tok_s": tokens / seconds if seconds > 0 else None,
            "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
            "per_request_output_tok_s": (sum(t.output_tokens / t.e2e for t in done) / len(done)) if done else None}


def adapter_waits(timings: list[RequestTiming]) -> dict | None:
    """Arrival -> admission (ms) of requests whose adapter was resident when sent (``warm``) and not (``cold``);
    None when the engine reported no admission times."""
    waits = [t for t in timings if t.queue_wait is not None and t.adapter is not None]
    if not waits:
        return None
    return {"cold": p50_p99([t.queue_wait for t in waits if t.adapter_cold], 1e3),
            "warm": p50_p99([t.queue_wait for t in waits if t.adapter_cold is False], 1e3)}


def summarize_run(m: Measurement, res: DriveResult, *, peak_memory_gib: float | None,
                  engine_figures: dict | None = None, extra: dict | None = None) -> ScenarioSummary:
    """The row of ``m`` from its ``drive`` (or end-to-end) result."""
    seconds = res.end - res.start
    primary = [t for t in res.timings if t.group == m.primary]
    per_adapter: dict[str, int] = {}
    for t in primary:
        if t.finish is not None:
            per_adapter[str(t.adapter)] = per_adapter.get(str(t.adapter), 0) + 1
    g = m.group(m.primary)
    steady = res.steady_tok_s(m.primary, g.concurrency) if g.concurrency is not None else None
    groups = {name: _group_figures([t for t in res.timings if t.group == name], res.group_tokens(name), seconds)
              for name in (x.name for x in m.groups)}
    planned = len(g.plan)
    info = dict(m.extra)
    info.update(variant=m.variant, level=m.concurrency, phase=m.phase, planned_requests=planned,
                requests_per_adapter=per_adapter, engine_steps=res.steps, adapter_wait_ms=adapter_waits(primary))
    if len(m.groups) > 1 or any(x.tenant is not None for x in m.groups):
        info["groups"] = groups
    if engine_figures is not None:
        info.update(engine_figures)
        info["eager_steps"] = res.steps - (engine_figures.get("graph_steps") or 0)
    info.update(extra or {})
    return summarize(m.name, primary, concurrency=m.concurrency, input_len=m.input_len, output_len=m.output_len,
                     start=res.start, end=res.end, peak_memory_gib=peak_memory_gib, peak_rss_gib=peak_rss_gib(),
                     truncated=res.truncated, steady_output_tok_s=steady, extra=info)


def auto_ramp(previous: dict | None, output_len: int, cap: float | None) -> float:
    """Seconds to spread a level's first requests over: an estimate of one request's e2e from the previous level
    (its TTFT p50 + output_len x its TPOT p50; the next level decodes a larger batch, so this errs short and the
    engine is full before the first request ends); 0 without a previous level; at most ``cap``."""
    if not previous:
        return 0.0
    tpot = previous.get("tpot_p50_ms")
    if tpot is None or tpot != tpot:  # nan: one-token outputs
        return 0.0
    est = (previous.get("ttft_p50_ms") or 0.0) / 1e3 + output_len * tpot / 1e3
    return min(est, cap) if cap is not None else est

