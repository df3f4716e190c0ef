"""The long run's fault mode (``python -m load_tests.run --spawn --faults all``) at small scale on the session stack:
Zipf, churn and streaming load while every fault of ``load_tests.faults`` is injected once, in order. Each must
have been in effect (a probe during it failed the expected way), restored and recovered, with every invariant
holding after it and at the end; the report carries the fault matrix.

~3 min on 2 cores: the load runs 180 s so that every fault is injected while it runs even when the engine restart
alone takes 10–50 s of model load on a busy CPU (the schedule's pace, not the clock, decides when each fault comes;
the length only has to outlast the seven faults): marked slow.
"""
from __future__ import annotations

import json

import pytest

from load_tests.faults import FAULTS, FaultSchedule
from load_tests.invariants import failed
from load_tests.run import check_and_report, engine_stats, faults_ok, run_load

# what a probe request sent while the fault holds gets (proof the fault was in effect)
DURING = {"engine": "exit -9", "redis": "quota_store_unavailable", "redis_stall": "quota_store_unavailable",
          "postgres": "database_unavailable", "s3_down": "blob_store_unavailable"}


@pytest.mark.slow
def test_every_fault_injected_recovered_and_every_invariant_held(stack, population, tmp_path):
    info = stack.info
    pop_path = str(tmp_path / "population.json")
    population.save(pop_path)
    schedule = FaultSchedule(stack, population, list(FAULTS), interval_s=1.0, hold_s=1.5, slow_delay_s=0.2,
                             max_rounds=1)
    schedule.budget_s = lambda fault: 0.0       # one round: inject each while the load runs, however long it takes
    before = engine_stats(info.engine_urls)
    records, secs = run_load(info, pop_path, ("zipf", "churn", "stream"), duration_s=180, users=3, streams=2,
                             max_tokens=4, work_dir=str(tmp_path), faults=schedule)
    summary, results, pj, pm = check_and_report(info, records, secs, before=before, out=str(tmp_path / "report"),
                                                config={}, faults=schedule)
    f = summary["faults"]
    assert f["crashed"] is None, f["crashed"]
    assert [i["fault"] for i in f["injections"]] == list(FAULTS), [i["fault"] for i in f["injections"]]
    for i in f["injections"]:
        assert i["error"] is None, i
        assert i["hold_s"] >= (1.5 if i["fault"] != "disconnect" else 0), i
        assert i["recovered_s"] is not None and i["recovered_s"] >= i["restored_s"], i
        assert i["invariants_ok"], json.dumps(i["invariants"], indent=1)
        if i["fault"] in DURING:
            assert i["figures"]["during_kind"] == DURING[i["fault"]], i["figures"]
    by = f["by_fault"]
    assert by["s3_slow"]["figures"]["upload_kind"] == ["ok"] and by["s3_slow"]["figures"]["cold_load_kind"] == ["ok"]
    assert by["disconnect"]["figures"]["disconnects"][0] >= 8
    assert by["engine"]["requests_during"].get("2xx", 0) > 0          # the other replica kept serving
    assert by["engine"]["figures"]["restart_to_ready_s"][0] > 0
    assert not failed(results), json.dumps(failed(results), indent=1)
    assert faults_ok(summary)
    md = open(pm).read()
    assert "## Fault matrix" in md and "| redis |" in md and json.load(open(pj))["faults"]["by_fault"]
