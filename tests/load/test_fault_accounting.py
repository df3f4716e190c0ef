"""How the fault mode counts requests, without a stack: which outcomes a fault excuses (and only while it lasts),
late outcomes after it, the outcome buckets of the fault matrix, and the CLI's checks of ``--faults``."""
from __future__ import annotations

import pytest

from load_tests.faults import GRACE_S, Injection, during, excuse, late, outcome, summarize_faults
from load_tests.records import Record
from load_tests.report import fault_markdown
from load_tests.run import parse_args


def rec(kind: str, start: float, *, status: int = 503, latency_ms: float = 50.0, scenario: str = "zipf") -> Record:
    return Record(scenario=scenario, tenant="t", model="m", status=status, kind=kind, latency_ms=latency_ms,
                  started_s=start, expected=kind == "ok")


def redis_fault() -> Injection:
    return Injection(fault="redis", round=1, injected_s=10.0, restored_s=13.0, recovered_s=13.5)


def test_a_fault_excuses_only_its_own_outcomes_and_only_while_it_lasts():
    inj = redis_fault()
    inside = rec("quota_store_unavailable", 11.0)
    straddling = rec("quota_store_unavailable", 9.0, latency_ms=1500)       # started before, ended during
    other_kind = rec("database_unavailable", 11.0)
    too_late = rec("quota_store_unavailable", 13.5 + GRACE_S + 1.0)
    records = [inside, straddling, other_kind, too_late, rec("ok", 11.0, status=200)]
    assert excuse(records, [inj]) == {"redis": {"quota_store_unavailable": 2}}
    assert inside.expected and straddling.expected
    assert not other_kind.expected and not too_late.expected
    assert late(records, [inj]) == {"redis": {"quota_store_unavailable": 1}}


def test_outcome_buckets_and_requests_during_a_fault():
    inj = redis_fault()
    records = [rec("ok", 11.0, status=200), rec("rate_limit_exceeded", 11.2, status=429),
               rec("quota_store_unavailable", 11.4), rec("internal_error", 11.5, status=500),
               rec("model_not_found", 11.6, status=404), rec("engine_unavailable", 11.7, status=200),
               rec("client_disconnect", 11.8, status=200), rec("transport:ConnectError", 12.0, status=0),
               rec("ok", 20.0, status=200)]                                   # after recovery: not counted
    assert [outcome(r) for r in records[:8]] == ["2xx", "429", "503", "other_5xx", "4xx", "stream_error",
                                                 "client_disconnect", "connection_error"]
    assert during(records, inj) == {"2xx": 1, "429": 1, "503": 1, "other_5xx": 1, "4xx": 1, "stream_error": 1,
                                    "client_disconnect": 1, "connection_error": 1}


def test_fault_summary_and_markdown():
    inj = redis_fault()
    inj.invariants = {"leases": {"ok": True}}
    broken = Injection(fault="redis", round=2, injected_s=40.0, restored_s=43.0, recovered_s=None,
                       invariants={"leases": {"ok": False, "detail": "held"}}, error="TimeoutError: no success")
    records = [rec("quota_store_unavailable", 11.0), rec("ok", 12.0, status=200), rec("ok", 12.5, status=200,
                                                                                      scenario="probe")]
    excused = excuse(records, [inj, broken])
    f = summarize_faults([inj, broken], records, excused, None)
    b = f["by_fault"]["redis"]
    assert b["injected"] == 2 and b["recovered"] == 1 and b["invariants_ok"] == 1
    assert b["requests_during"] == {"503": 1, "2xx": 1}                       # the probe is not load
    assert b["recovery_s"] == {"min": 0.5, "median": 0.5, "max": 0.5}
    assert b["errors"] == ["TimeoutError: no success"]
    md = "\n".join(fault_markdown(f))
    assert "| redis | 2 | 1 |" in md and "**broken: leases**" in md


@pytest.mark.parametrize("argv, message", [
    (["--faults", "redis", "--url", "http://x", "--admin-key", "k", "--database-url", "d",
      "--base-model-path", "/m"], "--faults needs --spawn"),
    (["--spawn", "--faults", "redis,meteor"], "unknown fault(s) ['meteor']"),
    (["--spawn", "--faults", "all", "--fault-interval", "0"], "must be > 0"),
])
def test_fault_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_all_means_every_fault():
    assert parse_args(["--spawn", "--faults", "all"]).fault_list == ["engine", "redis", "redis_stall", "postgres",
                                                                   "s3_down", "s3_slow", "disconnect"]
