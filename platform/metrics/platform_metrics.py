"""PlatformMetrics: every Prometheus metric of the control plane on its own ``CollectorRegistry`` (never the
global one: tests and several apps in one process do not collide), plus the in-memory window the dashboard reads.

The gateway calls, once per finished request (status = the HTTP status it answered):

    metrics.observe_request(tenant, adapter, status, ttft, tpot, e2e, prompt_tokens, completion_tokens,
                            version="3")                   # the version number that served it
    metrics.observe_quota_rejection(tenant, kind)          # kind: QuotaDecision.reason
    metrics.observe_upload(outcome, reason, tenant)        # the upload middleware does this by itself

and the engine poller calls ``apply_engine_stats(replica, stats)`` with ``loraplex.engine.stats.engine_stats``'s
dict. ``tenant`` is the tenant's name (readable in Grafana); ``adapter`` the adapter's name, None/"" for the base
model (label ``_base``), ``UNRESOLVED`` for a request refused before its model was known (label ``_unresolved``);
``version`` the number of the version that served it (``name``, ``name:2`` and ``name:prod`` resolve to a number),
"" for the base model, unresolved requests and adapters past the label cap. Labels are bounded: the limiter keeps
(tenant, adapter, version) triples, the rest count as ``adapter="_other", version=""`` (see ``LabelLimiter``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loraplex.platform.metrics.config import MetricsConfig
from loraplex.platform.metrics.label_limiter import OTHER, LabelLimiter
from loraplex.platform.metrics.uploads import UploadTracker
from loraplex.platform.metrics.window import RecentWindow

logger = logging.getLogger(__name__)

BASE = "_base"  # the adapter label of base-model requests
UNRESOLVED = "_unresolved"  # the adapter label of requests refused before their model was resolved (401, 400, 404)
TIERS = ("gpu", "cpu", "disk")


class PlatformMetrics:
    """The control plane's metrics. Thread-safe; one instance per app (``app.state.metrics``)."""

    def __init__(self, config: MetricsConfig | None = None, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config = config or MetricsConfig()
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.clock = clock
        self.started = clock()
        self.window = RecentWindow(config.window_horizon_s, clock=clock)
        self.uploads = UploadTracker(config.max_recent_uploads, clock=clock)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], set[str]] = {}  # (tenant, adapter) -> statuses emitted
        self.tenants = LabelLimiter(config.max_tenant_labels, promote_ratio=float("inf"))
        self.adapters = LabelLimiter(config.max_adapter_labels, on_evict=self._drop_adapter_series)
        self.upload_counts: dict[tuple[str, str], int] = {}
        self.quota_counts: dict[tuple[str, str], int] = {}
        self.engines: dict[str, dict] = {}                   # replica -> {"up", "time", "stats", "error"}
        self._engine_prev: dict[str, dict] = {}              # replica -> last cumulative counters
        self._loading_since: dict[str, dict[str, float]] = {}  # replica -> {adapter_id: first seen loading}
        self.totals = {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0}
        self._build(config.namespace)

    # ---- definitions ------------------------------------------------------------------------------------------
    def _build(self, ns: str) -> None:
        r, c = self.registry, self.config
        ta, tas = ["tenant", "adapter", "version"], ["tenant", "adapter", "version", "status"]
        self.requests = Counter(f"{ns}_requests", "Inference requests finished, by HTTP status", tas, registry=r)
        self.errors = Counter(f"{ns}_request_errors", "Inference requests that failed (status >= 400)", tas,
                              registry=r)
        self.ttft = Histogram(f"{ns}_time_to_first_token_seconds", "Time from request to first token", ta,
                              buckets=c.ttft_buckets_s, registry=r)
        self.tpot = Histogram(f"{ns}_time_per_output_token_seconds", "Mean time between output tokens after the "
                              "first", ta, buckets=c.tpot_buckets_s, registry=r)
        self.e2e = Histogram(f"{ns}_e2e_request_latency_seconds", "Time from request to last token", ta,
                             buckets=c.e2e_buckets_s, registry=r)
        self.prompt_tokens = Counter(f"{ns}_prompt_tokens", "Prompt tokens processed", ta, registry=r)
        self.completion_tokens = Counter(f"{ns}_completion_tokens", "Completion tokens generated", ta, registry=r)
        self.quota_rejections = Counter(f"{ns}_quota_rejections", "Requests refused by a quota", ["tenant", "kind"],
                                        registry=r)
        self.upload_total = Counter(f"{ns}_uploads", "Adapter uploads finished, by tenant, outcome and reason",
                                    ["tenant", "outcome", "reason"], registry=r)
        self.adapter_label_evictions = Counter(f"{ns}_adapter_label_evictions", "Adapters that lost their own label "
                                               "to a heavier one (their series were dropped)", registry=r)
        # engines (fed by the poller), one series per replica
        g = "replica"
        self.engine_up = Gauge(f"{ns}_engine_up", "1 if the last stats poll of the replica succeeded", [g], registry=r)
        self.queue_length = Gauge(f"{ns}_engine_queue_length", "Requests held by the engine, not running", [g],
                                  registry=r)
        self.running = Gauge(f"{ns}_engine_requests_running", "Requests running", [g], registry=r)
        self.waiting = Gauge(f"{ns}_engine_requests_waiting", "Requests waiting for admission", [g], registry=r)
        self.kv_used = Gauge(f"{ns}_engine_kv_blocks_used", "KV cache blocks referenced", [g], registry=r)
        self.kv_free = Gauge(f"{ns}_engine_kv_blocks_free", "KV cache blocks free (cached or not)", [g], registry=r)
        self.kv_usage = Gauge(f"{ns}_engine_kv_usage_ratio", "Fraction of KV blocks referenced", [g], registry=r)
        self.prefix_hit_rate = Gauge(f"{ns}_engine_prefix_cache_hit_rate", "Prefix-cache hit tokens / queried "
                                     "tokens since start", [g], registry=r)
        self.prefix_queries = Counter(f"{ns}_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", [g], registry=r)
        self.prefix_hits = Counter(f"{ns}_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache", [g],
                                   registry=r)
        self.preemptions = Counter(f"{ns}_engine_preemptions", "Sequences preempted by recompute", [g], registry=r)
        self.residency = Gauge(f"{ns}_engine_adapters_resident", "Adapters resident per tier", [g, "tier"],
                               registry=r)
        self.adapter_load = Histogram(f"{ns}_engine_adapter_load_seconds", "Adapter load time (fetch or disk, "
                                      "checks, CPU weights), as seen by the poller", [g],
                                      buckets=c.adapter_load_buckets_s, registry=r)
        self.cold_starts = Counter(f"{ns}_engine_adapter_cold_starts", "Adapter loads from disk or the blob store",
                                   [g], registry=r)
        self.slot_hit_rate = Gauge(f"{ns}_engine_gpu_slot_hit_rate", "Admissions whose adapter was already in a GPU "
                                   "slot, since start", [g], registry=r)
        self.adapter_gpu_bytes = Gauge(f"{ns}_engine_adapter_gpu_bytes", "GPU bytes of the adapters resident in the "
                                       "replica's adapter pool", [g], registry=r)
        self.adapter_gpu_budget = Gauge(f"{ns}_engine_adapter_gpu_budget_bytes", "GPU byte budget of the replica's "
                                        "adapter pool", [g], registry=r)
        self.adapter_gpu_loads = Counter(f"{ns}_engine_adapter_gpu_loads", "Adapter copies from CPU to the GPU",
                                         [g], registry=r)
        self.adapter_gpu_evictions = Counter(f"{ns}_engine_adapter_gpu_evictions", "Adapters evicted from GPU "
                                             "memory", [g], registry=r)

    # ---- labels -----------------------------------------------------------------------------------------------
    def labels_for(self, tenant: str, adapter: str | None, version: str | None = None) -> tuple[str, str, str]:
        """The bounded (tenant, adapter, version) label values for one request (counts it as traffic)."""
        t = self.tenants.label(tenant or "_unknown")
        a = adapter or BASE
        if a in (BASE, UNRESOLVED):
            return t, a, ""
        v = version or ""
        if self.adapters.label((t, a, v)) == OTHER:
            return t, OTHER, ""
        return t, a, v

    def _drop_adapter_series(self, key: tuple[str, str, str]) -> None:
        """An adapter version lost its labels: drop its series, so the label set stays within the cap."""
        statuses = self._series.pop(key, set())
        for status in statuses:
            for metric in (self.requests, self.errors):
                try:
                    metric.remove(*key, status)
                except KeyError:
                    pass
        for metric in (self.ttft, self.tpot, self.e2e, self.prompt_tokens, self.completion_tokens):
            try:
                metric.remove(*key)
            except KeyError:
                pass
        self.adapter_label_evictions.inc()

    # ---- platform events --------------------------------------------------------------------------------------
    def observe_request(self, tenant: str, adapter: str | None, status: int, ttft: float | None = None,
                        tpot: float | None = None, e2e: float | None = None, prompt_tokens: int = 0,
                        completion_tokens: int = 0, *, error: str | None = None, version: str | None = None) -> None:
        """One finished inference request. Latencies in seconds (None: not measured, e.g. failed before the first
        token); ``error`` a short reason code for the dashboard's error list (never the prompt); ``version`` the
        number of the adapter version that served it."""
        status = int(status)
        with self._lock:  # labels and series bookkeeping must not interleave with an eviction
            t, a, v = self.labels_for(tenant, adapter, version)
            s = str(status)
            self._series.setdefault((t, a, v), set()).add(s)
            self.requests.labels(t, a, v, s).inc()
            if status >= 400:
                self.errors.labels(t, a, v, s).inc()
            if ttft is not None:
                self.ttft.labels(t, a, v).observe(ttft)
            if tpot is not None:
                self.tpot.labels(t, a, v).observe(tpot)
            if e2e is not None:
                self.e2e.labels(t, a, v).observe(e2e)
            if prompt_tokens:
                self.prompt_tokens.labels(t, a, v).inc(prompt_tokens)
            if completion_tokens:
                self.completion_tokens.labels(t, a, v).inc(completion_tokens)
            self.totals["requests"] += 1
            self.totals["errors"] += status >= 400
            self.totals["prompt_tokens"] += prompt_tokens
            self.totals["completion_tokens"] += completion_tokens
        shown = f"{adapter}:{version}" if adapter and adapter not in (BASE, UNRESOLVED) and version else adapter
        self.window.record(tenant=tenant or "_unknown", adapter=shown or BASE, status=status,
                           prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           latencies={"ttft": ttft, "tpot": tpot, "e2e": e2e}, error=error)

    def observe_quota_rejection(self, tenant: str, kind: str) -> None:
        """A request refused by a quota; ``kind`` is ``QuotaDecision.reason`` ("requests", "tokens", ...)."""
        t = self.tenants.label(tenant or "_unknown")
        self.quota_rejections.labels(t, kind).inc()
        with self._lock:
            self.quota_counts[(t, kind)] = self.quota_counts.get((t, kind), 0) + 1

    def observe_upload(self, outcome: str, reason: str = "ok", tenant: str | None = None) -> None:
        """A finished upload: ``outcome`` "ready", "replayed", "deduplicated", "rejected" (4xx) or "failed" (5xx);
        ``reason`` the error code ("too_large", "invalid_adapter", ...) or "ok"; ``tenant`` its tenant's name (None:
        refused before the key was checked, label ``_unknown``)."""
        t = self.tenants.label(tenant or "_unknown")
        self.upload_total.labels(t, outcome, reason).inc()
        with self._lock:
            self.upload_counts[(outcome, reason)] = self.upload_counts.get((outcome, reason), 0) + 1

    # ---- engines ----------------------------------------------------------------------------------------------
    def apply_engine_stats(self, replica: str, stats: dict) -> None:
        """Set the replica's gauges from an ``engine_stats`` dict; cumulative engine counters become Prometheus
        counter increments (a counter that went down means the engine restarted: its new value is the growth)."""
        now = self.clock()
        g = replica
        self.engine_up.labels(g).set(1)
        self.queue_length.labels(g).set(stats.get("queue_length", 0))
        self.running.labels(g).set(stats.get("requests_running", 0))
        self.waiting.labels(g).set(stats.get("requests_waiting", 0))
        self.kv_used.labels(g).set(stats.get("kv_blocks_used", 0))
        self.kv_free.labels(g).set(stats.get("kv_blocks_free", 0))
        self.kv_usage.labels(g).set(stats.get("kv_usage", 0.0))
        self.prefix_hit_rate.labels(g).set(stats.get("prefix_cache_hit_rate") or 0.0)
        self.slot_hit_rate.labels(g).set(stats.get("gpu_slot_hit_rate") or 0.0)
        for tier in TIERS:
            self.residency.labels(g, tier).set(stats.get("adapter_tiers", {}).get(tier, 0))
        self.adapter_gpu_bytes.labels(g).set(stats.get("adapter_gpu_bytes") or 0)
        self.adapter_gpu_budget.labels(g).set(stats.get("adapter_gpu_budget_bytes") or 0)
        adapter_counters = stats.get("adapter_counters") or {}
        with self._lock:
            prev = self._engine_prev.get(replica, {})
            current = {"prefix_cache_queries": stats.get("prefix_cache_queries", 0),
                       "prefix_cache_hits": stats.get("prefix_cache_hits", 0),
                       "num_preemptions": stats.get("num_preemptions", 0),
                       "adapter_cold_starts": stats.get("adapter_cold_starts", 0),
                       "adapter_gpu_loads": adapter_counters.get("activations", 0),
                       "adapter_gpu_evictions": adapter_counters.get("evictions", 0)}
            for name, counter in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits",
                                  self.prefix_hits), ("num_preemptions", self.preemptions),
                                  ("adapter_cold_starts", self.cold_starts),
                                  ("adapter_gpu_loads", self.adapter_gpu_loads),
                                  ("adapter_gpu_evictions", self.adapter_gpu_evictions)):
                grown = current[name] - prev.get(name, 0)
                counter.labels(g).inc(grown if grown >= 0 else current[name])
            self._engine_prev[replica] = current
            # load latency: an adapter seen "loading" at one poll and gone at a later one took (now - first seen);
            # the resolution is the poll interval, and loads shorter than one interval may go unseen
            loading = set(stats.get("adapters", {}).get("loading", []))
            since = self._loading_since.setdefault(replica, {})
            for adapter_id in list(since):
                if adapter_id not in loading:
                    self.adapter_load.labels(g).observe(max(0.0, now - since.pop(adapter_id)))
            for adapter_id in loading:
                since.setdefault(adapter_id, now)
            self.engines[replica] = {"up": True, "time": now, "stats": stats, "error": None}

    def mark_engine_down(self, replica: str, error: str) -> None:
        """The replica's stats poll failed: ``engine_up`` 0, its last stats kept for the dashboard."""
        self.engine_up.labels(replica).set(0)
        with self._lock:
            last = self.engines.get(replica, {})
            self.engines[replica] = {"up": False, "time": self.clock(), "stats": last.get("stats"), "error": error}

    # ---- exposition -------------------------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in Prometheus text format (version 0.0.4)."""
        return generate_latest(self.registry)
