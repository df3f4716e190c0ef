"""``dashboard_data()``: the JSON the dashboard page polls (``GET /admin/dashboard/data``).

    totals      requests, errors, tokens since start; error_rate
    series      per-bin throughput (requests/s, tokens/s), latency percentiles (ttft/tpot/e2e p50/p90/p99, s),
                errors (4xx, 5xx) over the last ``span_s`` seconds
    engines     per replica: up, KV blocks, queue, running/waiting, hit rates, tiers
    adapters    tiers (summed over replicas), resident adapters with their tier and their tenant, adapter and version
                names from the registry, top adapters by traffic (tenant, adapter, version)
    tenants     per tenant: requests and tokens in the last minute against requests/tokens-per-minute limits,
                quota rejections since start
    errors      the last errors (time, tenant, adapter, status, code), newest first
    uploads     outcomes by (outcome, reason), uploads in flight with their progress, the last finished ones (each with
                its tenant, adapter and version once known)
    speculative speculative decoding where replicas speculate (method, k, acceptance overall and per adapter:
                ``speculative.py``), else null
"""
from __future__ import annotations

from typing import Any

from loraplex.platform.dashboard.speculative import speculative_ids, speculative_view
from loraplex.platform.metrics.platform_metrics import PlatformMetrics

ENGINE_FIELDS = ("requests_running", "requests_waiting", "queue_length", "kv_blocks_total", "kv_blocks_used",
                 "kv_blocks_free", "kv_usage", "prefix_cache_hit_rate", "gpu_slot_hit_rate", "adapter_tiers",
                 "adapter_cold_starts", "lora_enabled")
MAX_ADAPTERS_LISTED = 200


def resident_ids(engines: dict[str, dict]) -> list[str]:
    """Every adapter id some replica reports in a tier or in its speculative counters (what the names lookup
    needs)."""
    ids: set[str] = set(speculative_ids(engines))
    for entry in engines.values():
        ad = (entry.get("stats") or {}).get("adapters") or {}
        for tier in ("gpu", "loading", "cpu"):
            ids.update(ad.get(tier, []))
    return sorted(ids)[:MAX_ADAPTERS_LISTED * 4]


def _adapters(engines: dict[str, dict], names: dict[str, dict]) -> dict:
    tiers = {"gpu": 0, "cpu": 0, "disk": 0, "loading": 0}
    listed: list[dict] = []
    for replica, entry in sorted(engines.items()):
        stats = entry.get("stats") or {}
        ad = stats.get("adapters") or {}
        for tier in ("gpu", "cpu", "disk"):
            tiers[tier] += int((stats.get("adapter_tiers") or {}).get(tier, 0))
        tiers["loading"] += len(ad.get("loading", []))
        seen: set[str] = set()
        for tier in ("gpu", "loading", "cpu"):  # an adapter in a slot also has its CPU copy: list it once, as gpu
            for adapter_id in ad.get(tier, []):
                if adapter_id not in seen and len(listed) < MAX_ADAPTERS_LISTED:
                    seen.add(adapter_id)
                    named = names.get(adapter_id, {})
                    listed.append({"adapter_id": adapter_id, "replica": replica, "tier": tier,
                                   "tenant": named.get("tenant"), "adapter": named.get("adapter"),
                                   "version": named.get("version")})
    return {"tiers": tiers, "resident": listed}


def _tenants(metrics: PlatformMetrics, quotas: dict[str, dict]) -> list[dict]:
    usage = metrics.window.tenant_usage(60)
    rejections: dict[str, int] = {}
    for (tenant, _kind), n in dict(metrics.quota_counts).items():
        rejections[tenant] = rejections.get(tenant, 0) + n
    rows = []
    for tenant in sorted(set(usage) | set(quotas) | set(rejections)):
        u, q = usage.get(tenant, {"requests": 0, "tokens": 0}), quotas.get(tenant, {})
        tpm, rpm = q.get("tokens_per_minute"), q.get("requests_per_minute")
        rows.append({"tenant": tenant, "requests_last_min": u["requests"], "tokens_last_min": u["tokens"],
                     "requests_per_minute": rpm, "tokens_per_minute": tpm,
                     "tokens_pct": round(100.0 * u["tokens"] / tpm, 1) if tpm else None,
                     "requests_pct": round(100.0 * u["requests"] / rpm, 1) if rpm else None,
                     "quota_rejections": rejections.get(tenant, 0)})
    rows.sort(key=lambda r: (-r["tokens_last_min"], r["tenant"]))
    return rows


def dashboard_data(metrics: PlatformMetrics, *, quotas: dict[str, dict] | None = None, bin_s: int = 5,
                   span_s: int = 300, names: dict[str, dict] | None = None) -> dict[str, Any]:
    """Everything the page draws, as plain JSON. ``names``: ``resident_names`` of ``resident_ids``."""
    totals = dict(metrics.totals)
    totals["error_rate"] = totals["errors"] / totals["requests"] if totals["requests"] else 0.0
    engines = dict(metrics.engines)
    return {
        "time": metrics.clock(),
        "bin_s": bin_s,
        "totals": totals,
        "series": metrics.window.series(bin_s, span_s, since=metrics.started),
        "engines": [{"replica": r, "up": e.get("up"), "error": e.get("error"),
                     **{k: (e.get("stats") or {}).get(k) for k in ENGINE_FIELDS}} for r, e in sorted(engines.items())],
        "adapters": {**_adapters(engines, names or {}),
                     "top": [{"tenant": k[0], "adapter": k[1], "version": k[2] if len(k) > 2 else None, "requests": n}
                             for k, n in metrics.adapters.top(10)]},
        "tenants": _tenants(metrics, quotas or {}),
        "errors": metrics.window.recent_errors(),
        "uploads": {"outcomes": [{"outcome": o, "reason": r, "count": n}
                                 for (o, r), n in sorted(dict(metrics.upload_counts).items())],
                    **metrics.uploads.snapshot()},
        "speculative": speculative_view(engines, names or {}),
    }
