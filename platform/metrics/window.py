"""RecentWindow: the last few minutes of traffic in memory, per second, for the admin dashboard (Prometheus keeps
the long history; this answers "what is happening now" without a Prometheus server).

    buckets: {second: _Bucket}   requests, errors by status class, tokens, per-tenant counts, latency samples
    series(bin_s, span_s)        -> per-bin throughput and latency percentiles (nearest rank)
    tenant_usage(60)             -> requests and tokens per tenant in the last minute (against quotas)

Latency samples per second are a reservoir of at most ``samples_per_second`` values, so memory stays bounded
under any load.
"""
from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

LATENCIES = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)


@dataclass
class _Bucket:
    requests: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seen: int = 0  # requests that offered a latency sample (reservoir denominator)
    tenants: dict[str, list[int]] = field(default_factory=dict)  # tenant -> [requests, tokens]
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in LATENCIES})


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of an already sorted list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


class RecentWindow:
    """Thread-safe per-second counters over the last ``horizon_s`` seconds, plus the last ``max_errors`` errors."""

    def __init__(self, horizon_s: int = 900, samples_per_second: int = 256, max_errors: int = 50,
                 clock: Callable[[], float] = time.time, seed: int | None = None) -> None:
        if horizon_s < 60:
            raise ValueError(f"horizon_s must be >= 60 (the per-tenant usage looks back one minute), got {horizon_s}")
        self.horizon_s = horizon_s
        self.samples_per_second = samples_per_second
        self.clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._errors: deque[dict] = deque(maxlen=max_errors)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def _bucket(self, now: float) -> _Bucket:
        second = int(now)
        bucket = self._buckets.get(second)
        if bucket is None:
            bucket = self._buckets[second] = _Bucket()
            oldest = second - self.horizon_s
            for s in [s for s in self._buckets if s <= oldest]:
                del self._buckets[s]
        return bucket

    def record(self, *, tenant: str, adapter: str, status: int, prompt_tokens: int, completion_tokens: int,
               latencies: dict[str, float | None], error: str | None = None) -> None:
        now = self.clock()
        with self._lock:
            b = self._bucket(now)
            b.requests += 1
            if 400 <= status < 500:
                b.errors_4xx += 1
            elif status >= 500:
                b.errors_5xx += 1
            tokens = prompt_tokens + completion_tokens
            b.prompt_tokens += prompt_tokens
            b.completion_tokens += completion_tokens
            t = b.tenants.setdefault(tenant, [0, 0])
            t[0] += 1
            t[1] += tokens
            if status < 400 and any(v is not None for v in latencies.values()):
                b.seen += 1
                slot = b.seen - 1 if b.seen <= self.samples_per_second else self._rng.randrange(b.seen)
                if slot < self.samples_per_second:
                    for name in LATENCIES:
                        value = latencies.get(name)
                        samples = b.samples[name]
                        if value is None:
                            continue
                        if slot < len(samples):
                            samples[slot] = value
                        else:
                            samples.append(value)
            if status >= 400:
                self._errors.append({"time": now, "tenant": tenant, "adapter": adapter, "status": status,
                                     "error": error or ""})

    def series(self, bin_s: int = 5, span_s: int = 300, since: float | None = None) -> dict:
        """Complete bins of ``bin_s`` seconds over the last ``span_s`` (oldest first; the bin in progress is left
        out so the last point never dips), none ending before ``since`` (the process start: no empty history):
        ``t`` (bin start, epoch s), ``requests_per_s``, ``tokens_per_s``, ``errors_4xx``, ``errors_5xx`` and for
        each latency ``<name>_p50/p90/p99`` in seconds (None where the bin had no sample)."""
        if bin_s < 1 or span_s < bin_s:
            raise ValueError(f"need 1 <= bin_s <= span_s, got bin_s={bin_s}, span_s={span_s}")
        now = int(self.clock())
        last_bin = now - now % bin_s - bin_s
        starts = [last_bin - i * bin_s for i in range(span_s // bin_s - 1, -1, -1)]
        if since is not None:
            starts = [s for s in starts if s + bin_s > since]
        out: dict[str, list] = {"t": [], "requests_per_s": [], "tokens_per_s": [], "errors_4xx": [],
                                "errors_5xx": []}
        for name in LATENCIES:
            for p in PERCENTILES:
                out[f"{name}_p{p}"] = []
        with self._lock:
            for start in starts:
                buckets = [self._buckets[s] for s in range(start, start + bin_s) if s in self._buckets]
                out["t"].append(start)
                out["requests_per_s"].append(sum(b.requests for b in buckets) / bin_s)
                out["tokens_per_s"].append(sum(b.prompt_tokens + b.completion_tokens for b in buckets) / bin_s)
                out["errors_4xx"].append(sum(b.errors_4xx for b in buckets))
                out["errors_5xx"].append(sum(b.errors_5xx for b in buckets))
                for name in LATENCIES:
                    values = sorted(v for b in buckets for v in b.samples[name])
                    for p in PERCENTILES:
                        out[f"{name}_p{p}"].append(percentile(values, p))
        return out

    def tenant_usage(self, window_s: int = 60) -> dict[str, dict[str, int]]:
        """``{tenant: {"requests", "tokens"}}`` over the last ``window_s`` seconds."""
        now = int(self.clock())
        usage: dict[str, dict[str, int]] = {}
        with self._lock:
            for second, b in self._buckets.items():
                if second > now - window_s:
                    for tenant, (requests, tokens) in b.tenants.items():
                        u = usage.setdefault(tenant, {"requests": 0, "tokens": 0})
                        u["requests"] += requests
                        u["tokens"] += tokens
        return usage

    def recent_errors(self) -> list[dict]:
        """The last errors, newest first."""
        with self._lock:
            return list(reversed(self._errors))
