"""benchmarks/engine/bench_scheduler_policy.py at a small load: a row per policy and tenant count, the timed steps
counted, positive times; fcfs and vtc with one tenant schedule the same requests step for step; the fair policy
yields slots only with a preempt gap."""
from __future__ import annotations

import json
import math

from tests.utils.scripts import load_script

bench = load_script("engine", "bench_scheduler_policy")

SMALL = ["--running", "8", "--waiting", "24", "--budget", "96", "--min-prompt", "8", "--max-prompt", "48",
         "--min-tokens", "4", "--max-tokens", "12", "--warmup", "10", "--steps", "30"]


def _rows(tmp_path, monkeypatch, *extra: str) -> list[dict]:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(SMALL + list(extra)) == 0
    report = json.loads((tmp_path / "bench_scheduler_policy.json").read_text())
    assert report["args"]["steps"] == 30
    return report["rows"]


def test_rows_per_policy_and_tenants(tmp_path, monkeypatch, capsys):
    rows = _rows(tmp_path, monkeypatch, "--tenants", "1,4")
    assert [(r["policy"], r["tenants"]) for r in rows] == [("fcfs", 1), ("vtc", 1), ("vtc", 4)]
    for r in rows:
        assert r["steps"] == 30 and 0 < r["running"] <= 8 and r["waiting"] == 24, r
        assert r["admitted_per_step"] > 0  # requests finish and are admitted every few steps
        for key in ("schedule_us_p50", "schedule_us_p90", "update_us_p50", "step_us_p50", "step_us_p90"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["schedule_us_p50"] <= r["schedule_us_p90"] and r["step_us_p50"] <= r["step_us_p90"]
        assert math.isfinite(r["vs_fcfs_us_p50"])
    fcfs, vtc1, _ = rows
    assert fcfs["vs_fcfs_us_p50"] == 0.0  # paired with itself
    # one tenant: the fair policy schedules exactly what FCFS schedules
    assert (vtc1["running"], vtc1["admitted_per_step"]) == (fcfs["running"], fcfs["admitted_per_step"])
    out = capsys.readouterr().out
    assert out.count("\nvtc ") == 2 and "\nfcfs " in out and "bench_scheduler_policy.json" in out


def test_the_fair_policy_yields_only_with_a_preempt_gap(tmp_path, monkeypatch):
    """A small gap makes the fair policy preempt slot holders for waiting tenants; "none" turns every yield off
    (FCFS never yields). The request stream is seeded: the counts do not depend on timing."""
    rows = _rows(tmp_path, monkeypatch, "--tenants", "4", "--vtc-preempt-gap", "1")
    assert [(r["policy"], r["tenants"]) for r in rows] == [("fcfs", 1), ("vtc", 4)]
    assert rows[0]["slot_preemptions"] == rows[0]["budget_yields"] == 0 and rows[1]["slot_preemptions"] > 0
    rows = _rows(tmp_path, monkeypatch, "--tenants", "4", "--vtc-preempt-gap", "none")
    assert all(r["slot_preemptions"] == 0 and r["budget_yields"] == 0 for r in rows)
