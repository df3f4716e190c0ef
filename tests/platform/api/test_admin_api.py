"""Admin API: tenants, keys, quotas, and how tenant keys authenticate."""
from __future__ import annotations

from tests.platform.conftest import ADMIN_KEY


def test_admin_key_required(platform):
    c = platform.client
    r = c.get("/admin/tenants")
    assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
    r = c.get("/admin/tenants", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    _, tenant_auth = platform.new_tenant()
    assert c.get("/admin/tenants", headers=tenant_auth).status_code == 401


def test_tenant_crud_and_quotas(platform):
    c, admin = platform.client, platform.admin()
    r = c.post("/admin/tenants", json={"name": "acme", "quotas": {"requests_per_minute": 60}}, headers=admin)
    assert r.status_code == 201
    t = r.json()
    assert t["name"] == "acme" and not t["disabled"] and t["quotas"]["requests_per_minute"] == 60
    r = c.post("/admin/tenants", json={"name": "acme"}, headers=admin)
    assert r.status_code == 409 and "choose another name" in r.json()["error"]["message"]
    r = c.post("/admin/tenants", json={"name": "bad name!"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    assert t["quotas"]["scheduling_weight"] is None  # the deployment default
    quotas = {"requests_per_minute": 600, "tokens_per_minute": 100000, "max_concurrency": 8, "tokens_per_day": 10**9,
              "scheduling_weight": 2.5}
    r = c.put(f"/admin/tenants/{t['id']}/quotas", json=quotas, headers=admin)
    assert r.status_code == 200 and r.json()["quotas"] == quotas
    assert c.get(f"/admin/tenants/{t['id']}", headers=admin).json()["quotas"] == quotas
    assert platform.sql("SELECT tokens_per_day, scheduling_weight FROM tenants WHERE name = 'acme'")[0] == (10**9, 2.5)
    for bad in (-1, 0):
        r = c.put(f"/admin/tenants/{t['id']}/quotas", json={"max_concurrency": bad}, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_concurrency", r.text
        assert "disable the tenant" in r.json()["error"]["message"]
    for bad in (0, -1, 1e7):
        r = c.put(f"/admin/tenants/{t['id']}/quotas", json={"scheduling_weight": bad}, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "scheduling_weight", r.text
    c.post("/admin/tenants", json={"name": "beta"}, headers=admin)
    page = c.get("/admin/tenants?limit=1&offset=1", headers=admin).json()
    assert page["count"] == 2 and [x["name"] for x in page["data"]] == ["beta"]
    r = c.get("/admin/tenants/nope", headers=admin)
    assert r.status_code == 404 and "tenant 'nope' not found" in r.json()["error"]["message"]


def test_keys_shown_once_hashed_revocable(platform):
    c, admin = platform.client, platform.admin()
    tid, auth = platform.new_tenant()
    key = auth["Authorization"].split()[1]
    assert key.startswith("lpx_")
    stored = platform.sql("SELECT prefix, key_hash, last_used_at FROM api_keys")[0]
    assert stored[0] in key and key not in stored[1] and len(stored[1]) == 64 and stored[2] is None
    assert c.get("/v1/adapters", headers=auth).status_code == 200
    assert platform.sql("SELECT last_used_at FROM api_keys")[0][0] is not None
    listed = c.get(f"/admin/tenants/{tid}/keys", headers=admin).json()
    assert listed["count"] == 1 and "key" not in listed["data"][0] and key not in str(listed)
    key_id = listed["data"][0]["id"]
    r = c.delete(f"/admin/tenants/{tid}/keys/{key_id}", headers=admin)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    r = c.get("/v1/adapters", headers=auth)
    assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
    # a key with a valid prefix but a wrong secret is refused too
    second = c.post(f"/admin/tenants/{tid}/keys", json={}, headers=admin).json()["key"]
    forged = second[:15] + "x" * (len(second) - 15)
    assert c.get("/v1/adapters", headers={"Authorization": f"Bearer {forged}"}).status_code == 401
    assert c.get("/v1/adapters", headers={"Authorization": f"Bearer {second}"}).status_code == 200
    r = c.delete(f"/admin/tenants/{tid}/keys/other", headers=admin)
    assert r.status_code == 404


def test_disabled_tenant_is_refused(platform):
    c, admin = platform.client, platform.admin()
    tid, auth = platform.new_tenant()
    assert c.post(f"/admin/tenants/{tid}/disable", headers=admin).json()["disabled"] is True
    r = c.get("/v1/adapters", headers=auth)
    assert r.status_code == 403 and "tenant is disabled" in r.json()["error"]["message"]
    assert c.post(f"/admin/tenants/{tid}/enable", headers=admin).json()["disabled"] is False
    assert c.get("/v1/adapters", headers=auth).status_code == 200


def test_health(platform):
    assert platform.client.get("/healthz").json() == {"status": "ok"}
    # /readyz needs a running gateway with a ready engine: tests/platform/api/test_readyz.py
    assert ADMIN_KEY not in platform.client.get("/openapi.json").text
