"""The dashboard's speculative-decoding view: counters summed over the replicas that speculate, ratios recomputed
from the sums (never averaged), adapters named from the registry, null where no replica speculates; and the data
route carrying it."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from loraplex.platform.dashboard.data import resident_ids
from loraplex.platform.dashboard.speculative import MAX_ADAPTERS_SHOWN, speculative_ids, speculative_view
from tests.platform.dashboard.conftest import ADMIN_KEY

A, B = "t1/bot/v1", "t2/sql/v7"


def row(adapter, proposed, accepted, verified, emitted=None) -> dict:
    return {"adapter": adapter, "proposed": proposed, "accepted": accepted, "verified": verified,
            "emitted": accepted + verified if emitted is None else emitted,
            "acceptance_length": (accepted + verified) / verified if verified else None,
            "acceptance_rate": accepted / proposed if proposed else None}


def spec(rows: list[dict], other: dict | None = None, method: str = "ngram", k: int = 3) -> dict:
    total = {key: sum(r[key] for r in rows) + (other or {}).get(key, 0)
             for key in ("proposed", "accepted", "verified", "emitted")}
    return {"method": method, "num_speculative_tokens": k, "verify_cuda_graphs": False, **total,
            "acceptance_length": 9.9, "acceptance_rate": 9.9,          # the view recomputes these from the sums
            "verify_steps": 1, "graph_steps": 0, "propose_ms": 0.0, "verify_ms": 0.0, "replay_agreement": None,
            "adapters": rows, "adapters_other": {"adapters": 0, "proposed": 0, "accepted": 0, "verified": 0,
                                                 "emitted": 0, **(other or {})},
            "proposer": {}}


def engines(**replicas) -> dict:
    return {name: {"up": True, "stats": {"speculative": s}} for name, s in replicas.items()}


def test_nothing_when_no_replica_speculates():
    assert speculative_view({}, {}) is None
    assert speculative_view(engines(e0=None, e1=None), {}) is None
    assert speculative_view({"e0": {"up": False, "error": "down"}}, {}) is None


def test_sums_over_replicas_and_recomputes_the_ratios():
    e = engines(e0=spec([row(A, 30, 15, 10), row(None, 12, 0, 4)]),
                e1=spec([row(A, 10, 9, 4)], method="ngram", k=3),
                e2=None)                                        # a replica that does not speculate
    names = {A: {"tenant": "acme", "adapter": "bot", "version": 1}}
    v = speculative_view(e, names)
    assert v["replicas"] == [{"replica": "e0", "method": "ngram", "num_speculative_tokens": 3},
                             {"replica": "e1", "method": "ngram", "num_speculative_tokens": 3}]
    assert (v["proposed"], v["accepted"], v["verified"]) == (52, 24, 18)
    assert v["acceptance_length"] == pytest.approx((24 + 18) / 18)
    assert v["acceptance_rate"] == pytest.approx(24 / 52)
    bot, base = v["adapters"]
    assert bot == {"adapter_id": A, "tenant": "acme", "adapter": "bot", "version": 1, "proposed": 40, "accepted": 24,
                   "verified": 14, "emitted": 38, "acceptance_length": pytest.approx(38 / 14),
                   "acceptance_rate": pytest.approx(0.6)}
    assert base["adapter_id"] is None and base["tenant"] is None and base["acceptance_length"] == 1.0
    assert v["adapters_other"]["adapters"] == 0 and v["adapters_other"]["acceptance_length"] is None


def test_an_adapter_the_registry_no_longer_knows_keeps_the_name_its_id_carries():
    v = speculative_view(engines(e0=spec([row(B, 4, 2, 2)])), {})
    [sql] = v["adapters"]
    assert (sql["tenant"], sql["adapter"], sql["version"]) == (None, "sql", None)


def test_the_replicas_rest_and_adapters_past_the_cap_are_summed_apart():
    rows = [row(f"t/a{i}/v", 100 + i, 50, 40) for i in range(MAX_ADAPTERS_SHOWN + 2)]
    v = speculative_view(engines(e0=spec(rows, other={"adapters": 3, "proposed": 7, "accepted": 1, "verified": 2,
                                                       "emitted": 3})), {})
    assert len(v["adapters"]) == MAX_ADAPTERS_SHOWN
    assert v["adapters"][0]["adapter"] == f"a{MAX_ADAPTERS_SHOWN + 1}"           # most proposed first
    other = v["adapters_other"]
    assert other["adapters"] == 3 + 2 and other["proposed"] == 7 + 100 + 101 and other["verified"] == 2 + 80
    assert v["proposed"] == sum(r["proposed"] for r in rows) + 7


def test_malformed_counters_count_as_zero():
    bad = spec([])
    bad.update(proposed=None, accepted="many", verified=-3,
               adapters=[{"adapter": A, "proposed": "many", "accepted": -3, "verified": True}, "junk"])
    v = speculative_view(engines(e0=bad), {})
    assert v["proposed"] == 0 and v["acceptance_length"] is None and v["acceptance_rate"] is None
    assert v["adapters"][0]["proposed"] == 0


def test_adapter_ids_are_looked_up_for_names():
    e = engines(e0=spec([row(A, 1, 1, 1), row(None, 1, 0, 1)]), e1=spec([row(B, 1, 0, 1)]))
    assert speculative_ids(e) == [A, B]
    assert set(resident_ids(e)) == {A, B}


def test_the_data_route_carries_the_view(app):
    m = app.state.metrics
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with TestClient(app) as c:
        m.apply_engine_stats("e0", {"speculative": None})
        assert c.get("/admin/dashboard/data", headers=headers).json()["speculative"] is None
        m.apply_engine_stats("e0", {"speculative": spec([row(A, 9, 6, 3)], method="eagle3", k=4)})
        d = c.get("/admin/dashboard/data", headers=headers).json()["speculative"]
    assert d["replicas"] == [{"replica": "e0", "method": "eagle3", "num_speculative_tokens": 4}]
    assert d["acceptance_length"] == 3.0 and d["acceptance_rate"] == pytest.approx(2 / 3)
    assert d["adapters"][0]["adapter"] == "bot" and d["adapters"][0]["proposed"] == 9
