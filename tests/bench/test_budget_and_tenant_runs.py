"""The two scenarios that need the engine's consolidation features, at tiny scale on the CPU: churn under an
adapter memory budget (the engine's memory-bounded adapter pool: ``adapter_memory_bytes``, per-load timings in
its residency) and two-tenant fairness under each scheduling policy (tenant-fair scheduling: ``add_request(...,
tenant=, weight=)``, ``scheduling_policy``)."""
from __future__ import annotations

import json


def _run(tmp_path, *args) -> dict:
    from loraplex.cli import main

    rc = main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--input-len", "12", "--out", str(tmp_path),
               *args])
    assert rc == 0
    return json.loads((tmp_path / "bench_serve.json").read_text(encoding="utf-8"))


def test_churn_under_an_adapter_memory_budget(tmp_path):
    report = _run(tmp_path, "--scenario", "churn", "--num-adapters", "6", "--adapter-files", "2", "--adapter-budget",
                  "2", "--mix", "uniform", "--concurrency", "2", "--num-requests", "8", "--output-len", "3")
    one = report["workload"]["adapter_bytes"]
    full_info, tight_info = report["engine"]["float32 all-resident"], report["engine"]["float32 budget 2"]
    assert full_info["adapter_memory_bytes"] == 6 * one and tight_info["adapter_memory_bytes"] == 2 * one
    full, tight = report["scenarios"]
    assert full["extra"]["adapters_resident_peak"] == 6
    assert tight["extra"]["adapters_resident_peak"] <= 2 and tight["extra"]["adapter_counters"]["evictions"] > 0
    loads = tight["extra"]["adapter_loads"]           # the engine's per-load times: CPU -> GPU copies of this run
    assert loads["cpu_to_gpu_ms"]["n"] > 0 and 0 <= loads["cpu_to_gpu_ms"]["p50"] <= loads["cpu_to_gpu_ms"]["p99"]
    assert loads["since_start"]["disk_to_cpu_ms"]["n"] >= 6   # every adapter was read from disk once
    assert tight["num_requests"] == 8 and "churn TTFT p99 float32 budget 2 / all-resident" in report["ratios"]


def test_fairness_under_fcfs_and_vtc(tmp_path):
    report = _run(tmp_path, "--scenario", "fairness", "--num-adapters", "2", "--concurrency", "2", "--light-rate",
                  "2", "--arrivals", "fixed", "--light-output-len", "2", "--output-len", "4", "--heavy-factor", "3",
                  "--heavy-n", "1,2", "--scenario-time", "2", "--scheduling-policy", "fcfs,vtc")
    assert [(k, v["scheduling_policy"]) for k, v in report["engine"].items()] == [
        ("float32 fcfs", "fcfs"), ("float32 vtc", "vtc")]
    rows = {s["name"]: s for s in report["scenarios"]}
    assert set(rows) | {s.split(" (")[0] for s in report["skipped"]} == {
        "float32 fcfs light alone", "float32 fcfs light beside heavy", "float32 fcfs light beside heavy n=2",
        "float32 vtc light beside heavy", "float32 vtc light beside heavy n=2"}
    alone = rows["float32 fcfs light alone"]
    assert alone["extra"]["groups"]["light"]["requests_started"] == 4 and alone["num_requests"] == 4
    for name in ("float32 vtc light beside heavy", "float32 vtc light beside heavy n=2"):
        groups = rows[name]["extra"]["groups"]
        assert groups["light"]["requests_completed"] == 4 and groups["heavy"]["output_tokens"] > 0
        assert f"light TTFT p50 float32 vtc {rows[name]['extra']['variant']} / alone" in report["ratios"]
