"""Run reports: ``summarize(records, duration_s, engines_before, engines_after, invariants)`` → a JSON-ready dict;
``write_reports(summary, out_dir)`` writes ``report.json`` and ``report.md``.

Per scenario: requests, throughput (answered requests/s), latency percentiles of answered requests (ms), time to
first token and inter-token gaps (streams), errors by kind (expected or not). Adapter hit rates come from the
engines' counters (GPU slot hits vs activations, cold starts) over the run.
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict

from load_tests.records import Record


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in ps} | {"max": None}
    v = sorted(values)
    out = {f"p{p}": round(v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))], 2) for p in ps}
    return out | {"max": round(v[-1], 2)}


def adapter_hit_rates(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Per engine and overall: slot hits / (slot hits + activations) and cold starts during the run (for an
    engine restarted during it, since its last restart)."""
    per, tot = {}, Counter()
    for url, a in after.items():
        b = before.get(url, {})
        ca, cb = a.get("adapter_counters", {}), b.get("adapter_counters", {})
        keys = ("slot_hits", "activations", "fetches", "disk_hits", "loads")
        restarted = any(ca.get(k, 0) < cb.get(k, 0) for k in keys)    # counters start over: since the restart
        d = {k: ca.get(k, 0) - (0 if restarted else cb.get(k, 0)) for k in keys}
        admitted = d["slot_hits"] + d["activations"]
        per[url] = {**d, "restarted": restarted,
                    "gpu_slot_hit_rate": round(d["slot_hits"] / admitted, 4) if admitted else None,
                    "cold_starts": d["fetches"] + d["disk_hits"]}
        tot.update(d)
    admitted = tot["slot_hits"] + tot["activations"]
    return {"engines": per, "gpu_slot_hit_rate": round(tot["slot_hits"] / admitted, 4) if admitted else None,
            "admissions": admitted, "cold_starts": tot["fetches"] + tot["disk_hits"],
            "fetches_from_blob_store": tot["fetches"]}


def summarize(records: list[Record], duration_s: float, *, engines_before: dict | None = None,
              engines_after: dict | None = None, invariants: dict | None = None, config: dict | None = None) -> dict:
    by = defaultdict(list)
    for r in records:
        by[r.scenario].append(r)
    scenarios = {}
    for name, rs in sorted(by.items()):
        ok = [r for r in rs if r.kind == "ok"]
        s = {"requests": len(rs), "answered": len(ok), "throughput_rps": round(len(ok) / duration_s, 2),
             "latency_ms": percentiles([r.latency_ms for r in ok]),
             "errors_by_kind": dict(Counter(r.kind for r in rs if r.kind != "ok")),
             "unexpected_by_kind": dict(Counter(r.kind for r in rs if not r.expected)),
             "completion_tokens": sum(r.completion_tokens for r in ok)}
        ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        if ttft:
            s["ttft_ms"] = percentiles(ttft)
            s["itl_ms"] = percentiles([g for r in ok for g in (r.itl_ms or [])])
            s["tokens_per_s"] = round(s["completion_tokens"] / duration_s, 1)
        scenarios[name] = s
    models = Counter(r.model for r in records if r.scenario == "zipf")
    top = models.most_common(10)
    return {"duration_s": round(duration_s, 1), "requests": len(records), "scenarios": scenarios,
            "zipf_top10_share": round(sum(n for _, n in top) / max(1, sum(models.values())), 3),
            "zipf_distinct_adapters": len(models),
            "adapter_hit_rates": adapter_hit_rates(engines_before or {}, engines_after or {}),
            "invariants": invariants or {}, "config": config or {}}


def _fmt(p: dict) -> str:
    return " / ".join("–" if v is None else f"{v:.0f}" for v in (p["p50"], p["p90"], p["p99"], p["max"]))


def markdown(summary: dict) -> str:
    lines = [f"# Load run ({summary['duration_s']} s, {summary['requests']} requests)", "",
             "| scenario | requests | answered | req/s | latency p50/p90/p99/max ms | TTFT p50/p90/p99/max ms "
             "| ITL p50/p90/p99/max ms | errors by kind | unexpected |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary["scenarios"].items():
        lines.append(f"| {name} | {s['requests']} | {s['answered']} | {s['throughput_rps']} | {_fmt(s['latency_ms'])} "
                     f"| {_fmt(s['ttft_ms']) if 'ttft_ms' in s else '–'} "
                     f"| {_fmt(s['itl_ms']) if 'itl_ms' in s else '–'} "
                     f"| {s['errors_by_kind'] or '–'} | {s['unexpected_by_kind'] or '–'} |")
    h = summary["adapter_hit_rates"]
    lines += ["", f"Zipf: {summary['zipf_distinct_adapters']} distinct adapters requested, top 10 took "
                  f"{summary['zipf_top10_share']:.0%} of the requests.",
              f"Adapter hit rate (GPU slot hits / admissions): {h['gpu_slot_hit_rate']} over {h['admissions']} "
              f"admissions; cold starts {h['cold_starts']} (blob-store fetches {h['fetches_from_blob_store']}).", "",
              "| invariant | ok | detail |", "|---|---|---|"]
    for name, v in summary["invariants"].items():
        detail = {k: x for k, x in v.items() if k != "ok"}
        lines.append(f"| {name} | {'yes' if v['ok'] else '**NO**'} | {json.dumps(detail)[:300]} |")
    if "faults" in summary:
        lines += ["", *fault_markdown(summary["faults"])]
    return "\n".join(lines) + "\n"


OUTCOMES = ("2xx", "429", "503", "other_5xx", "4xx", "stream_error", "client_disconnect", "connection_error")


def _outcomes(d: dict) -> str:
    return " / ".join(str(d.get(k, 0)) for k in OUTCOMES)


def fault_markdown(f: dict) -> list[str]:
    """The fault matrix: per fault, then every injection (``faults.summarize_faults``)."""
    lines = ["## Fault matrix", "",
             f"Load requests overlapping a fault (injection → recovery), by outcome: {' / '.join(OUTCOMES)}. "
             "Excused: outcomes the fault allows (clear, retryable) for requests overlapping it (+ "
             "3 s after recovery). Late: such outcomes after that, still counted as unexpected.", "",
             "| fault | injected | recovered | hold s | recovery s min / median / max | requests during | excused "
             "| late | invariants held after | figures |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, b in f["by_fault"].items():
        rec = b["recovery_s"]
        rec_s = "–" if rec is None else f"{rec['min']:.2f} / {rec['median']:.2f} / {rec['max']:.2f}"
        figures = {k: v for k, v in b["figures"].items() if k != "engine"}
        lines.append(f"| {name} | {b['injected']} | {b['recovered']} | {b['hold_s'][0]:.1f}–{b['hold_s'][1]:.1f} "
                     f"| {rec_s} | {_outcomes(b['requests_during'])} | {b['excused'] or '–'} | {b['late'] or '–'} "
                     f"| {b['invariants_ok']}/{b['injected']} | {json.dumps(figures)[:300] if figures else '–'} |")
    lines += ["", "| t s | fault | round | hold s | recovery s | requests during | pause s | invariants | error |",
              "|---|---|---|---|---|---|---|---|---|"]
    for i in f["injections"]:
        bad = [k for k, v in i["invariants"].items() if not v["ok"]]
        lines.append(f"| {i['injected_s']:.1f} | {i['fault']} | {i['round']} | {i['hold_s']} | {i['recovery_s']} "
                     f"| {_outcomes(i['requests_during'])} | {i['pause_s']} "
                     f"| {'ok' if i['invariants_ok'] else '**broken: ' + ', '.join(bad) + '**'} "
                     f"| {i['error'] or '–'} |")
    if f["crashed"]:
        lines += ["", "**The fault schedule crashed:**", "", "```", f["crashed"][-2000:], "```"]
    return lines


def write_reports(summary: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    pj, pm = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    with open(pj, "w") as f:
        json.dump(summary, f, indent=2)
    with open(pm, "w") as f:
        f.write(markdown(summary))
    return pj, pm
