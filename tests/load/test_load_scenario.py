"""The bounded CPU load run: every scenario at once (Locust: Zipf, bursty tenants over quota, uploads and deletes
while inference runs, long prompts; the asyncio streaming client with some clients leaving), then every
invariant and the reports."""
from __future__ import annotations

import json

from load_tests.invariants import check_all, failed
from load_tests.report import summarize, write_reports
from load_tests.run import engine_stats, run_load

DURATION_S = 25


def test_all_scenarios_keep_every_invariant(stack, population, tmp_path):
    info = stack.info
    pop_path = str(tmp_path / "population.json")
    population.save(pop_path)
    before = engine_stats(info.engine_urls)
    records, secs = run_load(info, pop_path, ("zipf", "burst", "churn", "long", "stream"), duration_s=DURATION_S,
                             users=6, streams=3, max_tokens=8, work_dir=str(tmp_path))
    after = engine_stats(info.engine_urls)
    results = check_all(info, records)
    summary = summarize(records, secs, engines_before=before, engines_after=after, invariants=results)
    pj, pm = write_reports(summary, str(tmp_path / "report"))
    assert not failed(results), json.dumps(results, indent=1)

    s = summary["scenarios"]
    assert set(s) == {"zipf", "burst", "churn", "long", "stream"}, s.keys()
    assert s["zipf"]["answered"] >= 50 and s["zipf"]["latency_ms"]["p99"] is not None
    assert summary["zipf_distinct_adapters"] >= 15                      # the long tail is exercised
    assert s["burst"]["errors_by_kind"].get("rate_limit_exceeded", 0) > 0   # over quota: 429 with Retry-After
    churn = [r for r in records if r.scenario == "churn"]
    assert any(r.model.startswith("upload ") and r.kind == "ok" for r in churn)
    assert any(r.model.startswith("delete ") and r.kind == "ok" for r in churn)
    assert s["long"]["answered"] > 0 and s["long"]["errors_by_kind"].get("context_length_exceeded", 0) >= 0
    assert s["stream"]["answered"] > 0 and s["stream"]["ttft_ms"]["p50"] is not None
    assert summary["adapter_hit_rates"]["admissions"] > 0
    assert json.load(open(pj))["invariants"]["usage"]["ok"] and "| zipf |" in open(pm).read()
