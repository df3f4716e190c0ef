"""The dashboard's speculative-decoding view: the replicas' ``engine_stats()["speculative"]`` counters summed over
the replicas that speculate, overall and per adapter (named from the registry, never by id).

    {"replicas": [{"replica", "method", "num_speculative_tokens"}],        # the replicas that speculate
     "proposed", "accepted", "verified", "emitted",                          # summed, since each engine started
     "acceptance_length", "acceptance_rate",                                 # recomputed from the sums
     "adapters": [{"adapter_id", "tenant", "adapter", "version", "proposed", "accepted", "verified", "emitted",
                   "acceptance_length", "acceptance_rate"}, ...],            # most proposed first; null id: base model
     "adapters_other": {"adapters", "proposed", ...}}                        # what the replicas did not list by name

None when no replica speculates. acceptance_length = (accepted + verified) / verified (tokens per verification,
1 = no draft kept), acceptance_rate = accepted / proposed, as the engine defines them (engine/spec_decode/stats.py).
"""
from __future__ import annotations

COUNTS = ("proposed", "accepted", "verified", "emitted")
MAX_ADAPTERS_SHOWN = 50


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _counts(row: dict | None) -> dict[str, int]:
    return {k: _int((row or {}).get(k)) for k in COUNTS}


def _add(into: dict[str, int], row: dict | None) -> None:
    for k, v in _counts(row).items():
        into[k] += v


def _with_ratios(counts: dict[str, int]) -> dict:
    verified, proposed = counts["verified"], counts["proposed"]
    return {**counts,
            "acceptance_length": (counts["accepted"] + verified) / verified if verified else None,
            "acceptance_rate": counts["accepted"] / proposed if proposed else None}


def _speculating(engines: dict[str, dict]) -> list[tuple[str, dict]]:
    out = []
    for replica, entry in sorted(engines.items()):
        spec = (entry.get("stats") or {}).get("speculative")
        if isinstance(spec, dict):
            out.append((replica, spec))
    return out


def speculative_ids(engines: dict[str, dict]) -> list[str]:
    """The adapter ids some speculating replica lists (what the names lookup needs)."""
    ids = {row.get("adapter") for _, spec in _speculating(engines) for row in spec.get("adapters") or []
           if isinstance(row, dict)}
    return sorted(i for i in ids if isinstance(i, str))


def speculative_view(engines: dict[str, dict], names: dict[str, dict]) -> dict | None:
    """The view of ``engines`` (``PlatformMetrics.engines``: replica -> {"stats", ...}); ``names``:
    ``resident_names`` of ``speculative_ids``. An adapter whose version is gone from the registry keeps the name
    its id carries (``<tenant id>/<adapter>/<version id>``), without tenant or version."""
    replicas = _speculating(engines)
    if not replicas:
        return None
    total = dict.fromkeys(COUNTS, 0)
    other = dict.fromkeys(COUNTS, 0)
    other_adapters = 0
    per_adapter: dict[str | None, dict[str, int]] = {}
    for _, spec in replicas:
        _add(total, spec)
        for row in spec.get("adapters") or []:
            if isinstance(row, dict):
                key = row.get("adapter") if isinstance(row.get("adapter"), str) else None
                _add(per_adapter.setdefault(key, dict.fromkeys(COUNTS, 0)), row)
        rest = spec.get("adapters_other") or {}
        _add(other, rest)
        other_adapters += _int(rest.get("adapters"))
    rows = sorted(per_adapter.items(), key=lambda kv: (-kv[1]["proposed"], kv[0] or ""))
    for _, counts in rows[MAX_ADAPTERS_SHOWN:]:
        for k in COUNTS:
            other[k] += counts[k]
    adapters = []
    for adapter_id, counts in rows[:MAX_ADAPTERS_SHOWN]:
        named = names.get(adapter_id, {}) if adapter_id else {}
        fallback = adapter_id.split("/")[1] if adapter_id and adapter_id.count("/") == 2 else adapter_id
        adapters.append({"adapter_id": adapter_id, "tenant": named.get("tenant"),
                         "adapter": named.get("adapter", fallback), "version": named.get("version"),
                         **_with_ratios(counts)})
    return {"replicas": [{"replica": r, "method": spec.get("method"),
                          "num_speculative_tokens": spec.get("num_speculative_tokens")} for r, spec in replicas],
            **_with_ratios(total), "adapters": adapters,
            "adapters_other": {"adapters": other_adapters + max(0, len(rows) - MAX_ADAPTERS_SHOWN),
                               **_with_ratios(other)}}
