"""``render_metrics(stats, model=...)``: the engine process's own ``GET /metrics`` (Prometheus text 0.0.4), built
from one ``loraplex.engine.stats.engine_stats`` dict on a fresh ``CollectorRegistry`` per scrape (never the global
one). prometheus-client is imported here only, and only when a scrape comes.

Names start with ``loraplex_engine_server_`` so that they never collide with the platform's ``loraplex_engine_*``
gauges (the same numbers, polled by the platform and labelled ``replica``): a Prometheus that scrapes both (Helm
``metrics.serviceMonitor.scrapeEngines``) does not count an engine twice. Prometheus adds ``instance``/``pod``.

    loraplex_engine_server_info{model}                      1
    loraplex_engine_server_requests_running / _waiting / _queue_length
    loraplex_engine_server_kv_blocks_total / _used / _free / _cached, _kv_usage_ratio
    loraplex_engine_server_prefix_cache_hit_rate, _gpu_slot_hit_rate     (absent before the first lookup/admission)
    loraplex_engine_server_adapters_resident{tier}          gpu / cpu / disk
    loraplex_engine_server_adapter_disk_bytes / _max_bytes  the disk cache's size and its cap (absent: no cap)
    loraplex_engine_server_adapters_loading / _failed / _pinned / _copying
    loraplex_engine_server_adapter_gpu_bytes / _gpu_budget_bytes   the adapter pool's bytes resident and its budget
    loraplex_engine_server_adapter_cpu_bytes                the CPU tier's bytes          (these three: LoRA engines)
    loraplex_engine_server_adapter_load_seconds{stage}      histogram of loads since start: stage "cpu" (fetch or
                                                            disk -> CPU weights), "gpu" (CPU -> GPU copy)
    loraplex_engine_server_prefix_cache_queries_total / _hits_total, _preemptions_total, _adapter_cold_starts_total
    loraplex_engine_server_kernel_compiles_total / _kernel_compile_seconds_total   Triton compiles in the process
                                                            (a rise after warm-up is a stall of every request)
    loraplex_engine_server_adapter_events_total{event}      the adapter manager's counters (fetches, loads,
                                                            activations = GPU loads, evictions = GPU evictions,
                                                            disk_evictions, ...)
    loraplex_engine_server_tenants_active                   tenants with an unfinished request
    loraplex_engine_server_tenant_sequences{tenant,state}   running / waiting / swapped sequences per tenant
    loraplex_engine_server_tenant_weight{tenant}            the tenant's scheduling weight ("vtc")
    loraplex_engine_server_tenant_counter_lead{tenant}      its virtual token counter minus the smallest active one
    loraplex_engine_server_spec_proposed_tokens_total{adapter}   speculative drafts verified (engines that speculate)
    loraplex_engine_server_spec_accepted_tokens_total{adapter}   of those, accepted
    loraplex_engine_server_spec_verifications_total{adapter}     sequence verifications (one per sequence and step)
    loraplex_engine_server_spec_emitted_tokens_total{adapter}    tokens the verifications appended
    loraplex_engine_server_spec_acceptance_length{adapter}       tokens per verification since start
    loraplex_engine_server_spec_verify_steps_total               engine steps that verified drafts

With ``LORAPLEX_ENGINE_VLLM_METRICS=1`` the scrape also carries the names the Kubernetes Gateway API Inference
Extension's endpoint picker reads from vLLM (its model-server protocol), labelled ``model_name``:

    vllm:num_requests_waiting      requests held, not running (queue_length)
    vllm:num_requests_running      requests running
    vllm:kv_cache_usage_perc       fraction of KV blocks in use, 0-1 (also as vllm:gpu_cache_usage_perc, the older name)
    vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}   the scrape's Unix time
                                   (adapter ids in GPU slots / being loaded, comma-separated; LoRA engines only)

Off by default: the adapter lists are label values, so every change of residency starts a new series.

Adapter-pool metrics are engine-wide (no adapter label: their series do not grow with the adapters served).
Tenant labels are bounded: the ``TENANT_STATS_LIMIT`` tenants holding the most sequences keep their id, the rest
are summed under ``tenant="_other"``; a request without a tenant counts under ``tenant="_none"``. Idle tenants
leave the exposition, so the label values of one scrape are at most ``TENANT_STATS_LIMIT + 1``. Speculative
decoding's ``adapter`` label is bounded the same way: the 16 adapters proposing the most keep their id, the rest are
summed under ``adapter="_other"``, base-model requests count under ``adapter="_base"``.
"""
from __future__ import annotations

import os
import time

PREFIX = "loraplex_engine_server"
VLLM_METRICS_ENV = "LORAPLEX_ENGINE_VLLM_METRICS"
TIERS = ("gpu", "cpu", "disk")
TENANT_STATES = ("running", "waiting", "swapped")
OTHER_TENANTS, NO_TENANT = "_other", "_none"  # tenant ids start with [A-Za-z0-9]: never one of these
OTHER_ADAPTERS, BASE_MODEL = "_other", "_base"
SPEC_COUNTERS = (("proposed", "spec_proposed_tokens", "Speculative draft tokens verified"),
                 ("accepted", "spec_accepted_tokens", "Speculative draft tokens accepted"),
                 ("verified", "spec_verifications", "Speculative verifications (one per sequence and step)"),
                 ("emitted", "spec_emitted_tokens", "Tokens appended by speculative verifications"))
GAUGES = (  # (stats key, metric suffix, help)
    ("requests_running", "requests_running", "Requests running (scheduled this step)"),
    ("requests_waiting", "requests_waiting", "Requests waiting for admission"),
    ("queue_length", "queue_length", "Requests held by the engine, not running"),
    ("kv_blocks_total", "kv_blocks_total", "KV cache blocks in the pool"),
    ("kv_blocks_used", "kv_blocks_used", "KV cache blocks referenced"),
    ("kv_blocks_free", "kv_blocks_free", "KV cache blocks free (cached or not)"),
    ("kv_cached_blocks", "kv_blocks_cached", "KV cache blocks findable through the prefix-cache index"),
    ("kv_usage", "kv_usage_ratio", "Fraction of KV blocks referenced"),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens since start"),
    ("gpu_slot_hit_rate", "gpu_slot_hit_rate", "Admissions whose adapter was already in a GPU slot, since start"),
    ("adapter_disk_bytes", "adapter_disk_bytes", "Bytes of the adapter disk cache"),
    ("adapter_disk_max_bytes", "adapter_disk_max_bytes", "Size cap of the adapter disk cache (absent: none)"),
    ("adapter_gpu_bytes", "adapter_gpu_bytes", "GPU bytes of the adapters resident in the adapter pool"),
    ("adapter_gpu_budget_bytes", "adapter_gpu_budget_bytes", "GPU byte budget of the adapter pool"),
    ("adapter_cpu_bytes", "adapter_cpu_bytes", "Bytes of the adapters held in CPU memory"),
    ("adapters_copying", "adapters_copying", "Adapters whose CPU -> GPU copy is in flight"),
    ("kv_cache_tokens", "kv_cache_tokens", "Tokens the KV cache pool holds"),
    ("kv_cache_gib", "kv_cache_gib", "GiB of the KV cache pool"),
    ("num_cuda_graphs", "cuda_graphs", "Decode batch sizes captured as CUDA graphs"),
    ("num_mixed_cuda_graphs", "mixed_cuda_graphs",
     "CUDA graphs of steps with prefill chunks (token bucket x LoRA step slots)"),
)
COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    ("num_preemptions", "preemptions", "Sequences preempted"),
    ("slot_preemptions", "slot_preemptions", "Sequence groups preempted to give their slots to a tenant far below"),
    ("budget_yields", "budget_yields", "Decode entries that gave a step's budget to a tenant far below"),
    ("adapter_cold_starts", "adapter_cold_starts", "Adapter loads from disk or the blob store"),
    ("kernel_compiles", "kernel_compiles", "Triton kernels compiled (or loaded from the disk cache) since start; "
     "after warm-up each one stalled every running request"),
    ("kernel_compile_seconds", "kernel_compile_seconds", "Seconds spent compiling Triton kernels since start"),
)


class _StatsCollector:
    """A custom collector over one stats snapshot (values are read as they are: the engine's counters are already
    cumulative since it started)."""

    def __init__(self, stats: dict, model: str, vllm_names: bool = False) -> None:
        self.stats, self.model, self.vllm_names = stats, model, vllm_names

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats
        info = GaugeMetricFamily(f"{PREFIX}_info", "The engine process (always 1)", labels=["model"])
        info.add_metric([self.model], 1)
        yield info
        for key, name, doc in GAUGES:
            value = s.get(key)
            if value is not None:  # a ratio with no denominator yet is absent, not 0
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        tiers = GaugeMetricFamily(f"{PREFIX}_adapters_resident", "Adapters resident per tier", labels=["tier"])
        for tier in TIERS:
            tiers.add_metric([tier], float(s.get("adapter_tiers", {}).get(tier, 0)))
        yield tiers
        adapters = s.get("adapters", {})
        for key, doc in (("loading", "Adapters being fetched or loaded"), ("failed", "Adapters whose load failed"),
                         ("pinned", "Adapters pinned (never evicted)")):
            value = adapters.get(key, 0)
            yield GaugeMetricFamily(f"{PREFIX}_adapters_{key}", doc,
                                    value=float(len(value) if isinstance(value, (list, dict)) else value))
        for key, name, doc in COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(s.get(key, 0)))
        if s.get("adapter_load_latency"):
            yield self._load_latency(s["adapter_load_latency"])
        events = CounterMetricFamily(f"{PREFIX}_adapter_events", "Adapter manager counters since start",
                                     labels=["event"])
        for event, value in sorted(s.get("adapter_counters", {}).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                events.add_metric([event], float(value))
        yield events
        yield from self._tenants(s)
        if self.vllm_names:
            yield from self._vllm(s)
        if s.get("speculative"):
            yield from self._speculative(s["speculative"])

    @staticmethod
    def _load_latency(stages: dict):
        from prometheus_client.core import HistogramMetricFamily

        family = HistogramMetricFamily(f"{PREFIX}_adapter_load_seconds", "Adapter loads since start: stage cpu = "
                                       "fetch or disk -> CPU weights, gpu = CPU -> GPU copy", labels=["stage"])
        for stage in ("cpu", "gpu"):
            h = stages.get(stage)
            if h:
                buckets = [(repr(float(le)), float(n)) for le, n in h["buckets"]] + [("+Inf", float(h["count"]))]
                family.add_metric([stage], buckets, float(h["sum"]))
        return family

    def _vllm(self, s: dict):
        """The vLLM-compatible names of the Inference Extension's model-server protocol (module docstring)."""
        from prometheus_client.core import GaugeMetricFamily

        for name, value, doc in (
                ("vllm:num_requests_waiting", s.get("queue_length", 0), "Requests held by the engine, not running"),
                ("vllm:num_requests_running", s.get("requests_running", 0), "Requests running"),
                ("vllm:kv_cache_usage_perc", s.get("kv_usage", 0.0), "Fraction of KV cache blocks in use (0-1)"),
                ("vllm:gpu_cache_usage_perc", s.get("kv_usage", 0.0), "Fraction of KV cache blocks in use (0-1)")):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model], float(value or 0.0))
            yield family
        if s.get("lora_enabled"):
            adapters = s.get("adapters", {})
            info = GaugeMetricFamily("vllm:lora_requests_info", "Adapters in GPU slots and being loaded; the value is "
                                     "the scrape's Unix time", labels=["max_lora", "running_lora_adapters",
                                                                       "waiting_lora_adapters"])
            info.add_metric([str(adapters.get("max_loras") or 0), ",".join(adapters.get("gpu", [])),
                             ",".join(adapters.get("loading", []))], time.time())
            yield info


    def _speculative(self, spec: dict):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rows = [(BASE_MODEL if r.get("adapter") is None else str(r["adapter"]), r) for r in spec.get("adapters", [])]
        other = spec.get("adapters_other") or {}
        if other.get("adapters") or other.get("verified"):
            rows.append((OTHER_ADAPTERS, other))
        for key, name, doc in SPEC_COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["adapter"])
            for label, row in rows:
                family.add_metric([label], float(row.get(key, 0)))
            yield family
        length = GaugeMetricFamily(f"{PREFIX}_spec_acceptance_length", "Tokens per speculative verification since "
                                   "start (accepted drafts + 1)", labels=["adapter"])
        for label, row in rows:
            if row.get("acceptance_length") is not None:
                length.add_metric([label], float(row["acceptance_length"]))
        yield length
        yield CounterMetricFamily(f"{PREFIX}_spec_verify_steps", "Engine steps that verified speculative drafts",
                                  value=float(spec.get("verify_steps", 0)))

    def _tenants(self, s: dict):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(f"{PREFIX}_tenants_active", "Tenants with an unfinished request",
                                value=float(s.get("tenants_active", 0)))
        seqs = GaugeMetricFamily(f"{PREFIX}_tenant_sequences", "Sequences per tenant and state (top tenants; the "
                                 "rest under tenant=\"_other\")", labels=["tenant", "state"])
        weight = GaugeMetricFamily(f"{PREFIX}_tenant_weight", "Scheduling weight of the tenant", labels=["tenant"])
        lead = GaugeMetricFamily(f"{PREFIX}_tenant_counter_lead", "Virtual token counter minus the smallest active "
                                 "tenant's (weighted tokens per unit of weight)", labels=["tenant"])
        for row in s.get("tenants", []):
            name = NO_TENANT if row.get("tenant") is None else str(row["tenant"])
            for state in TENANT_STATES:
                seqs.add_metric([name, state], float(row.get(state, 0)))
            if row.get("weight") is not None:
                weight.add_metric([name], float(row["weight"]))
                lead.add_metric([name], float(row["lead"]))
        other = s.get("tenants_other") or {}
        if other.get("tenants"):
            for state in TENANT_STATES:
                seqs.add_metric([OTHER_TENANTS, state], float(other.get(state, 0)))
        yield seqs
        yield weight
        yield lead


def render_metrics(stats: dict, *, model: str, vllm_names: bool | None = None) -> bytes:
    """Prometheus text (0.0.4) of one ``engine_stats`` dict; ``model`` goes to the ``_info`` metric.
    ``vllm_names``: add the Inference Extension's vLLM names (default: ``LORAPLEX_ENGINE_VLLM_METRICS`` is 1/true)."""
    from prometheus_client import CollectorRegistry, generate_latest

    if vllm_names is None:
        vllm_names = os.environ.get(VLLM_METRICS_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model, vllm_names))
    return generate_latest(registry)


def content_type() -> str:
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

    return CONTENT_TYPE_PLAIN_0_0_4
