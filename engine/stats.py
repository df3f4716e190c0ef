"""``engine_stats(llm_engine)``: one JSON-ready snapshot of an engine's load, KV cache and adapter tiers, read from
public attributes only (torch-free; safe to call from another thread: it only reads lengths, counters and the
adapter manager's locked ``residency()``). The platform's metrics poller turns it into Prometheus gauges.

    {
      "requests_running": 3, "requests_waiting": 5, "queue_length": 5, "num_preemptions": 0,
      "kv_blocks_total": 512, "kv_blocks_free": 380, "kv_blocks_used": 132, "kv_usage": 0.26,
      "kv_cached_blocks": 40, "prefix_cache_queries": 9000, "prefix_cache_hits": 4500, "prefix_cache_hit_rate": 0.5,
      "kv_cache_tokens": 8192, "kv_cache_gib": 0.19,  # the pool as sized at start-up (blocks x block_size)
      "num_cuda_graphs": 11,            # decode batch-size buckets replayed from CUDA graphs (0: eager)
      "num_mixed_cuda_graphs": 72,      # graphs of steps with prefill chunks (token bucket x LoRA step slots)
      "lora_enabled": true,
      "adapters": {"gpu": ["t/a/1"], "cpu": ["t/a/1", "t/b/2"], "disk": 7, "loading": [], "failed": 0,
                   "pinned": [], "max_loras": 4, "max_cpu_loras": 16},
      "adapter_tiers": {"gpu": 1, "cpu": 2, "disk": 7},
      "adapter_counters": {"fetches": .., "disk_hits": .., "loads": .., "activations": .., "slot_hits": .., ...},
      "adapter_cold_starts": 9,          # loads that had to go to disk or the blob store (fetches + disk hits)
      "gpu_slot_hit_rate": 0.93,         # slot_hits / (slot_hits + activations); None before any admission
      "adapter_disk_bytes": 61440, "adapter_disk_max_bytes": 21474836480,  # None: no cap
      "adapter_gpu_bytes": 9437184, "adapter_gpu_budget_bytes": 25769803776,   # the adapter pool (None: no LoRA)
      "adapter_cpu_bytes": 18874368, "adapters_copying": 0,
      "adapter_load_latency": {          # every load since start ({} without LoRA): fetch or disk -> CPU weights,
        "cpu": {"buckets": [[0.001, 0], ..., [60.0, 9]], "count": 9, "sum": 3.2},   # and CPU -> GPU copies
        "gpu": {"buckets": [[0.001, 40], ...], "count": 52, "sum": 0.06}},         # (engine/lora/latency.py)
      "scheduling_policy": "vtc", "tenants_active": 2,
      "slot_preemptions": 1, "budget_yields": 0,  # groups that gave up slots / decode entries that gave up a step's
                                                  # budget to a tenant far below (vtc_preempt_gap), since start
      "tenants": [                       # the TENANT_STATS_LIMIT tenants holding the most sequences, most first
        {"tenant": "t1", "weight": 1.0, "requests": 2, "running": 64, "waiting": 1, "swapped": 0,
         "counter": 2410.0, "lead": 2380.0,          # lead: counter - the smallest active counter (vtc only)
         "input_tokens": 90, "output_tokens": 1200}, # charged since the tenant's record was created (vtc only)
        ...],
      "tenants_other": {"tenants": 0, "requests": 0, "running": 0, "waiting": 0, "swapped": 0}, # the rest, summed
      "speculative": {                   # None unless the engine speculates (engine/spec_decode/stats.py)
        "method": "ngram", "num_speculative_tokens": 3, "verify_cuda_graphs": false,
        "proposed": 900, "accepted": 540, "verified": 400, "emitted": 930,
        "acceptance_length": 2.35, "acceptance_rate": 0.6,    # (accepted + verified) / verified; accepted / proposed
        "verify_steps": 120, "graph_steps": 0, "propose_ms": 41.0, "verify_ms": 950.0, "replay_agreement": null,
        "adapters": [{"adapter": "t/a/1", "proposed": .., "accepted": .., "verified": .., "emitted": ..,
                      "acceptance_length": .., "acceptance_rate": ..}, ...],   # the 16 adapters proposing most
        "adapters_other": {"adapters": 0, "proposed": 0, ...},               # the rest, summed
        "proposer": {...}}               # the proposer's own counters (n-gram hits, draft forwards, ...)
    }

Counters are cumulative since the engine started; the poller turns their growth into Prometheus counters.
``queue_length`` counts requests the engine holds that are not running (waiting for blocks, a slot or an adapter
load). Tenants: the scheduler's per-tenant load and, under the "vtc" policy, its virtual token counters
(engine/fairness.py); a request without a tenant is listed under ``"tenant": null``.
"""
from __future__ import annotations

from typing import Any

TENANT_STATS_LIMIT = 16  # tenants listed by name; the rest are summed into "tenants_other"
_LOADS = ("requests", "running", "waiting", "swapped")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def adapter_stats(manager: Any) -> dict:
    """The adapter part of ``engine_stats`` from an ``AdapterManager`` (or None: LoRA disabled)."""
    if manager is None:
        return {"lora_enabled": False, "adapters": {"gpu": [], "cpu": [], "disk": 0, "loading": [], "failed": 0,
                                                    "pinned": []},
                "adapter_tiers": {"gpu": 0, "cpu": 0, "disk": 0}, "adapter_counters": {},
                "adapter_cold_starts": 0, "gpu_slot_hit_rate": None,
                "adapter_disk_bytes": 0, "adapter_disk_max_bytes": None,
                "adapter_gpu_bytes": None, "adapter_gpu_budget_bytes": None, "adapter_cpu_bytes": None,
                "adapters_copying": None, "adapter_load_latency": {}}
    res = manager.residency()
    counters = dict(res.get("counters", {}))
    gpu = sorted(res.get("gpu", {}).values())
    cpu = list(res.get("cpu", []))
    disk = manager.num_disk_entries()
    slot_hits, activations = counters.get("slot_hits", 0), counters.get("activations", 0)
    return {
        "lora_enabled": True,
        "adapters": {"gpu": gpu, "cpu": cpu, "disk": disk, "loading": list(res.get("loading", [])),
                     "failed": len(res.get("failed", {})), "pinned": list(res.get("pinned", [])),
                     "max_loras": res.get("max_loras"), "max_cpu_loras": res.get("max_cpu_loras")},
        "adapter_tiers": {"gpu": len(gpu), "cpu": len(cpu), "disk": disk},
        "adapter_counters": counters,
        "adapter_cold_starts": counters.get("fetches", 0) + counters.get("disk_hits", 0),
        "gpu_slot_hit_rate": _ratio(slot_hits, slot_hits + activations),
        "adapter_disk_bytes": res.get("disk", {}).get("bytes", 0),          # the disk tier's size and LRU cap
        "adapter_disk_max_bytes": res.get("disk", {}).get("max_bytes"),     # (None: unbounded)
        "adapter_gpu_bytes": res.get("gpu_bytes", 0),                       # the adapter pool: bytes resident
        "adapter_gpu_budget_bytes": res.get("gpu_budget_bytes", 0),         # and its budget
        "adapter_cpu_bytes": res.get("cpu_bytes", 0),
        "adapters_copying": len(res.get("gpu_copying", [])),
        "adapter_load_latency": dict(res.get("load_latency", {})),          # {"cpu": histogram, "gpu": histogram}
    }


def compile_stats() -> dict:
    """Triton kernels compiled in this process since its engine started (``kernels.compile_watch``; 0 where no
    watch is installed: CPU engines): after warm-up, each one stalled every running request."""
    from loraplex.kernels import compile_watch

    watch = compile_watch.current()
    snap = watch.snapshot() if watch is not None else None
    return {"kernel_compiles": snap.compiles if snap else 0,
            "kernel_compile_seconds": round(snap.seconds, 3) if snap else 0.0}


def runner_stats(runner: Any) -> dict:
    """The KV pool size and CUDA-graph count of a ``ModelRunner`` (None: no model)."""
    if runner is None:
        return {"kv_cache_tokens": 0, "kv_cache_gib": 0.0, "num_cuda_graphs": 0, "num_mixed_cuda_graphs": 0}
    return {"kv_cache_tokens": int(getattr(runner, "kv_cache_tokens", 0)),
            "kv_cache_gib": round(getattr(runner, "kv_cache_bytes", 0) / 2**30, 3),
            "num_cuda_graphs": int(getattr(runner, "num_cuda_graphs", 0)),
            "num_mixed_cuda_graphs": int(getattr(runner, "num_mixed_cuda_graphs", 0))}


def tenant_stats(scheduler: Any, limit: int = TENANT_STATS_LIMIT) -> dict:
    """The tenant part of ``engine_stats`` from a ``Scheduler`` (module docstring)."""
    loads = scheduler.tenant_loads()
    counters = getattr(scheduler, "counters", None)
    records = {r["tenant"]: r for r in counters.snapshot()} if counters is not None else {}
    active = [r["counter"] for r in records.values() if r["active"]]
    floor = min(active) if active else 0.0
    rows = []
    for tenant, load in loads.items():
        row = {"tenant": tenant, **load}
        record = records.get(tenant)
        if record is not None:
            row.update(weight=record["weight"], counter=record["counter"], lead=record["counter"] - floor,
                       input_tokens=record["input_tokens"], output_tokens=record["output_tokens"])
        rows.append(row)
    rows.sort(key=lambda r: (-(r["running"] + r["waiting"] + r["swapped"]), -r.get("lead", 0.0), str(r["tenant"])))
    other = {"tenants": max(0, len(rows) - limit), **{k: sum(r[k] for r in rows[limit:]) for k in _LOADS}}
    return {"scheduling_policy": scheduler.config.policy, "tenants_active": len(loads),
            "slot_preemptions": getattr(scheduler, "num_slot_preemptions", 0),
            "budget_yields": getattr(scheduler, "num_budget_yields", 0), "tenants": rows[:limit],
            "tenants_other": other}


def _empty_tenants() -> dict:
    return {"scheduling_policy": None, "tenants_active": 0, "slot_preemptions": 0, "budget_yields": 0, "tenants": [],
            "tenants_other": {"tenants": 0, **{k: 0 for k in _LOADS}}}


def engine_stats(llm_engine: Any) -> dict:
    """A snapshot of ``llm_engine`` (a ``LLMEngine``; an ``AsyncEngine``'s is ``.engine``) as a plain dict."""
    scheduler, kv = llm_engine.scheduler, llm_engine.kv_cache
    running, waiting = scheduler.num_running, scheduler.num_waiting
    unfinished = llm_engine.num_unfinished_requests
    total, free = kv.num_blocks, kv.num_free_blocks
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    return {
        "requests_running": running,
        "requests_waiting": waiting,
        "queue_length": max(waiting, unfinished - running),
        "num_preemptions": getattr(scheduler, "num_preemptions", 0),
        "kv_blocks_total": total,
        "kv_blocks_free": free,
        "kv_blocks_used": total - free,
        "kv_usage": kv.usage,
        "kv_cached_blocks": kv.num_cached_blocks,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": _ratio(hits, queries),
        **runner_stats(getattr(llm_engine, "runner", None)),
        **compile_stats(),
        **adapter_stats(getattr(llm_engine, "adapters", None)),
        **tenant_stats(scheduler),
        "speculative": spec.snapshot() if (spec := getattr(llm_engine, "spec", None)) is not None else None,
    }


def empty_stats() -> dict:
    """The same keys with nothing in flight and no cache: for engines without a model (the null engine)."""
    return {"requests_running": 0, "requests_waiting": 0, "queue_length": 0, "num_preemptions": 0,
            "kv_blocks_total": 0, "kv_blocks_free": 0, "kv_blocks_used": 0, "kv_usage": 0.0, "kv_cached_blocks": 0,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": None, **runner_stats(None),
            "kernel_compiles": 0, "kernel_compile_seconds": 0.0,
            **adapter_stats(None), **_empty_tenants(), "speculative": None}
