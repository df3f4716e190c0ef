"""API keys: a revoked key (and a disabled tenant) is refused on the next request to every tenant endpoint,
inference included (the gateway's auth cache must not keep it alive; other gateway processes learn within
AUTH_CACHE_S <= 1 s); admin endpoints refuse tenant keys."""
from __future__ import annotations

import pytest

from tests.security.conftest import ADMIN_KEY, bearer

REVOKE_BAR_S = 1.0


def infer(server, key: str):
    return server.http.post("/v1/completions", json={"model": server.gateway.model_name, "prompt": "hi",
                                                     "max_tokens": 1}, headers=bearer(key))


def test_revoked_key_is_refused_on_the_next_request(tenants):
    server = tenants.server
    tid = tenants.other_id
    r = server.http.post(f"/admin/tenants/{tid}/keys", json={"name": "short-lived"}, headers=bearer(ADMIN_KEY))
    key, key_id = r.json()["key"], r.json()["id"]
    assert infer(server, key).status_code == 200          # the key is now in the gateway's auth cache
    assert server.http.get("/v1/adapters", headers=bearer(key)).status_code == 200
    assert server.http.delete(f"/admin/tenants/{tid}/keys/{key_id}", headers=bearer(ADMIN_KEY)).status_code == 200
    # the process that served the revoke drops its auth cache: the very next request is refused (other gateway
    # processes within AUTH_CACHE_S, see test_auth_cache_ttl_default_is_at_most_one_second)
    r = infer(server, key)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = server.http.get("/v1/adapters", headers=bearer(key))
    assert r.status_code == 401 and r.json()["error"]["message"]


def test_disabled_tenant_is_refused_on_the_next_request_and_comes_back(tenants):
    server, tid = tenants.server, tenants.other_id
    key = tenants.other_key
    assert infer(server, key).status_code == 200
    assert server.http.post(f"/admin/tenants/{tid}/disable", headers=bearer(ADMIN_KEY)).status_code == 200
    try:
        r = infer(server, key)
        assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled", r.text
    finally:
        assert server.http.post(f"/admin/tenants/{tid}/enable", headers=bearer(ADMIN_KEY)).status_code == 200
    assert infer(server, key).status_code == 200


def test_auth_cache_ttl_default_is_at_most_one_second():
    """Gateways in other processes learn of a revocation only when their cache entry expires."""
    from loraplex.platform.core.config import Settings

    assert Settings(environment="test", admin_key="a" * 24, secret_key="s" * 24).auth_cache_s <= REVOKE_BAR_S


def admin_routes(server) -> list[tuple[str, str]]:
    schema = server.http.get("/openapi.json").json()
    return [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops if p.startswith("/admin")]


@pytest.mark.parametrize("who", ["tenant", "none", "garbage"])
def test_admin_endpoints_refuse_tenant_keys(tenants, who):
    server = tenants.server
    routes = admin_routes(server)
    assert len(routes) >= 8, routes
    headers = {"tenant": bearer(tenants.owner_key), "none": {}, "garbage": bearer("lpx_nope_nope")}[who]
    for method, path in routes:
        url = path.replace("{tenant_id}", tenants.owner_id).replace("{key_id}", "x")
        body = {"name": "x"} if method in ("POST", "PUT") else None
        r = server.http.request(method, url, headers=headers, json=body)
        assert r.status_code == 401, f"{method} {url} with a {who} key: {r.status_code} {r.text}"
        assert "admin" in r.text.lower(), r.text
    # and nothing changed: the tenant's keys still work
    assert infer(server, tenants.owner_key).status_code == 200
