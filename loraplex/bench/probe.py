"""What the in-process engine did during one measured run, read from its public stats.

    probe = EngineProbe(engine)          # before the run: counters and timing lists as they are now
    drive(..., on_step=probe.on_step)    # KV usage every step; the engine_stats snapshot every ``every_s``
    figures = probe.finish(result)       # {"kv_usage_peak": .., "adapters_resident_peak": .., "graph_steps": ..,
                                         #  "adapter_loads": {"disk_to_cpu_ms": {"n", "p50", "p99"}, ...},
                                         #  "step_ms": {"graph": {"n", "p50", "mean"}, "eager": {...}}, ...}

Graph steps: decode steps served by the padded static-buffer path that replays CUDA graphs (counted only when
graphs were captured); mixed graph steps: steps with a prompt chunk that replayed the mixed-step graphs (in the
step times they are "eager" calls: not decode replays). Adapter load latency: the adapter manager's per-load times when the engine reports them
(``residency()["load_seconds"]``: ``cpu`` = fetch or disk -> CPU weights, ``gpu`` = CPU -> GPU copy); the loads of
this run are the newest entries, as many as its ``loads`` / ``activations`` counters grew (``since_start``: all
of them, warm-ups included: with a CPU tier that holds every adapter, disk -> CPU loads happen at first use).
Step times: the wall time of each ``engine.step()`` call of the run (the driver's ``step_seconds``), split into
calls that launched a graph replay (with overlapped scheduling such a call waits for the previous decode step, so
its time is about one decode step) and eager calls that returned outputs (prefill chunks mixed with decodes, e.g.
an arrival's step, which runs synchronously); calls that returned nothing (waits on an adapter load) are left out.
"""
from __future__ import annotations

import time
from typing import Callable

from loraplex.bench.stats import p50_p99


def _newest(values: list[float] | None, count: int) -> list[float] | None:
    if values is None:
        return None
    return list(values)[-count:] if count > 0 else []


def split_step_times(step_seconds: list[float], step_outputs: list[int], graph_calls: list[bool]) -> dict:
    """{"graph": {"n", "p50", "mean"}, "eager": {...}} in ms: the calls that launched a graph replay, and the other
    calls that returned outputs (module docstring); the three lists run in step order."""
    kinds: dict[str, list[float]] = {"graph": [], "eager": []}
    for secs, outputs, replay in zip(step_seconds, step_outputs, graph_calls, strict=True):
        if replay:
            kinds["graph"].append(secs)
        elif outputs:
            kinds["eager"].append(secs)
    return {k: {"n": len(v), "p50": p50_p99(v, 1e3)["p50"], "mean": 1e3 * sum(v) / len(v) if v else None}
            for k, v in kinds.items()}


class EngineProbe:
    def __init__(self, engine, *, every_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        from loraplex.engine.stats import engine_stats

        self.engine, self.every_s, self.clock = engine, every_s, clock
        self._stats = engine_stats
        graphs = engine.runner.decode_graphs
        self._graphs = graphs if engine.runner.num_cuda_graphs else None
        self._graph_steps0 = self._graphs.num_steps if self._graphs is not None else None
        self._graph_seen, self._graph_calls = self._graph_steps0, []
        self._early0 = getattr(engine, "num_early_launched_steps", 0)
        self._mixed = engine.runner.mixed_graphs if getattr(engine.runner, "num_mixed_cuda_graphs", 0) else None
        self._mixed0 = self._mixed.num_steps if self._mixed is not None else 0
        first = engine_stats(engine)
        self._counters0 = dict(first.get("adapter_counters") or {})
        self.kv_usage_peak = first["kv_usage"]
        self.running_peak = first["requests_running"]
        self.adapters_peak = first["adapter_tiers"]["gpu"]
        self._next = clock() + every_s

    def _snapshot(self) -> dict:
        s = self._stats(self.engine)
        self.running_peak = max(self.running_peak, s["requests_running"])
        self.adapters_peak = max(self.adapters_peak, s["adapter_tiers"]["gpu"])
        self.kv_usage_peak = max(self.kv_usage_peak, s["kv_usage"])
        return s

    def on_step(self, now: float) -> None:
        self.kv_usage_peak = max(self.kv_usage_peak, self.engine.kv_cache.usage)
        if self._graphs is not None:  # whether this call launched a graph replay
            self._graph_calls.append(self._graphs.num_steps != self._graph_seen)
            self._graph_seen = self._graphs.num_steps
        if now >= self._next:
            self._next = now + self.every_s
            self._snapshot()

    def step_ms(self, step_seconds: list[float], step_outputs: list[int]) -> dict:
        """``split_step_times`` of the run's step() calls; without captured graphs no call is a replay."""
        graph = self._graph_calls if self._graphs is not None else [False] * len(step_seconds)
        return split_step_times(step_seconds, step_outputs, graph)

    def finish(self, result=None) -> dict:
        """The run's figures; ``result`` (the ``DriveResult``) adds the step times."""
        last = self._snapshot()
        counters = dict(last.get("adapter_counters") or {})
        grew = {k: counters.get(k, 0) - self._counters0.get(k, 0) for k in counters}
        out = {"kv_usage_peak": self.kv_usage_peak, "requests_running_peak": self.running_peak,
               "adapters_resident_peak": self.adapters_peak, "adapters_resident_end": last["adapter_tiers"]["gpu"],
               "adapter_counters": grew,
               "graph_steps": (self._graphs.num_steps - self._graph_steps0) if self._graphs is not None else 0,
               # eager steps enqueued before the decode step in flight was read back (engine/step_pipeline.py)
               "early_launched_steps": getattr(self.engine, "num_early_launched_steps", 0) - self._early0,
               "mixed_graph_steps": (self._mixed.num_steps - self._mixed0) if self._mixed is not None else 0}
        if result is not None:
            out["step_ms"] = self.step_ms(result.step_seconds, result.step_outputs)
        manager = getattr(self.engine, "adapters", None)
        timings = manager.residency().get("load_seconds") if manager is not None else None
        if timings is not None:
            cpu = _newest(timings.get("cpu"), grew.get("loads", 0))
            gpu = _newest(timings.get("gpu"), grew.get("activations", 0))
            out["adapter_loads"] = {"disk_to_cpu_ms": p50_p99(cpu or [], 1e3),
                                    "cpu_to_gpu_ms": p50_p99(gpu or [], 1e3),
                                    # every load since the engine started (its warm-ups included)
                                    "since_start": {"disk_to_cpu_ms": p50_p99(list(timings.get("cpu") or []), 1e3),
                                                    "cpu_to_gpu_ms": p50_p99(list(timings.get("gpu") or []), 1e3)}}
        else:
            out["adapter_loads"] = None  # this engine does not report per-load times
        return out
