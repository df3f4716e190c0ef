"""Usage export for billing over the live app: per (day, tenant, adapter) as CSV (tenant) and JSON (admin), the
day range, every finished request counted (the buffer is flushed first), another tenant's usage never in a
tenant's export."""
from __future__ import annotations

import csv
import io
from datetime import datetime, timedelta, timezone

from loraplex.platform.usage import UsageEvent
from tests.platform.gateway.conftest import ADMIN_KEY, settings_for

HEADER = ["day", "tenant_id", "tenant", "adapter", "requests", "prompt_tokens", "completion_tokens", "total_tokens"]


def test_usage_export_csv_and_json(serve, tmp_path, tiny_base, adapters):
    server = serve(settings_for(tmp_path, tiny_base, usage_flush_s=30))
    t1, k1 = server.new_tenant()
    t2, k2 = server.new_tenant()
    server.upload(k1, "bot", adapters["a"])
    base = server.gateway.model_name
    c1 = server.openai(k1)
    for _ in range(2):
        c1.completions.create(model="bot", prompt=[1, 2, 3], max_tokens=4)
    c1.completions.create(model=base, prompt=[1, 2], max_tokens=3)
    server.openai(k2).completions.create(model=base, prompt=[5], max_tokens=2)
    past = datetime.now(timezone.utc) - timedelta(days=3)        # an older day, written as the gateway would
    server.gateway.usage.record(UsageEvent(tenant_id=t1, request_id="old", model="bot", prompt_tokens=10,
                                           completion_tokens=5, adapter_name="bot", created_at=past))
    today, old = datetime.now(timezone.utc).date().isoformat(), past.date().isoformat()

    r = server.http.get("/v1/usage/export?format=csv", headers={"Authorization": f"Bearer {k1}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv"), r.text
    assert r.headers["content-disposition"].startswith('attachment; filename="loraplex-usage-')
    rows = list(csv.reader(io.StringIO(r.text)))
    assert rows[0] == HEADER
    name = rows[1][2]
    assert rows[1:] == [[old, t1, name, "bot", "1", "10", "5", "15"],
                        [today, t1, name, "", "1", "2", "3", "5"],         # the base model: adapter empty
                        [today, t1, name, "bot", "2", "6", "8", "14"]]
    r = server.http.get(f"/v1/usage/export?format=csv&from={today}&to={today}", headers={"Authorization": f"Bearer {k1}"})
    assert [row[0] for row in list(csv.reader(io.StringIO(r.text)))[1:]] == [today, today]

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = server.http.get(f"/admin/usage/export?format=json&from={today}", headers=admin)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["object"] == "list" and body["from"] == today and body["to"] is None
    assert {(row["tenant_id"], row["adapter"], row["requests"]) for row in body["data"]} == {
        (t1, None, 1), (t1, "bot", 2), (t2, None, 1)}
    assert sum(row["total_tokens"] for row in body["data"]) == 5 + 14 + 3
    only = server.http.get(f"/admin/usage/export?format=json&tenant_id={t2}", headers=admin).json()
    assert [row["tenant_id"] for row in only["data"]] == [t2]
    # isolation, refusals
    r2 = server.http.get("/v1/usage/export?format=json", headers={"Authorization": f"Bearer {k2}"}).json()
    assert {row["tenant_id"] for row in r2["data"]} == {t2}
    bad = server.http.get(f"/v1/usage/export?from={today}&to={old}", headers={"Authorization": f"Bearer {k1}"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_range"
    assert bad.json()["error"]["param"] == "from"
    assert server.http.get("/v1/usage/export?format=xml", headers={"Authorization": f"Bearer {k1}"}).status_code == 400
    assert server.http.get("/admin/usage/export", headers={"Authorization": f"Bearer {k1}"}).status_code == 401
