"""Tenant isolation: every tenant endpoint called by another tenant with the owner's adapter names, versions,
aliases and ids answers 404 (never 403, never 200) with the same error as a name that does not exist, and lists
never show the owner's adapters. ``test_every_tenant_route_is_covered`` fails when a tenant route is added to
the OpenAPI schema without a case here."""
from __future__ import annotations

import pytest

from tests.security.conftest import bearer

# (method, path template, body kind) of every tenant route that names an adapter
ADAPTER_ROUTES = [
    ("GET", "/v1/adapters/{name}", None),
    ("GET", "/v1/adapters/{name}/versions", None),
    ("DELETE", "/v1/adapters/{name}", None),
    ("DELETE", "/v1/adapters/{name}/versions/{n}", None),
    ("PUT", "/v1/adapters/{name}/aliases/{alias}", "alias"),
    ("DELETE", "/v1/adapters/{name}/aliases/{alias}", None),
    ("POST", "/v1/adapters/{name}/rollback", "alias"),
]
LISTING_ROUTES = ["/v1/adapters", "/v1/models", "/v1/usage", "/v1/usage/export", "/v1/imports", "/v1/keys"]
OWN_ROUTES = {("POST", "/v1/adapters/import"), ("GET", "/v1/imports/{import_id}"), ("POST", "/v1/keys"),
              ("DELETE", "/v1/keys/{key_id}")}    # tested below: another tenant's import / key is a 404
MODEL_ROUTE = "/v1/models/{model}"
INFERENCE_ROUTES = ["/v1/chat/completions", "/v1/completions"]
UPLOAD_ROUTE = "/v1/adapters"


def foreign_models(t) -> list[str]:
    """Every way to name the owner's adapter, plus its row ids and the engines' adapter id."""
    a = t.adapter
    return [a, f"{a}:1", f"{a}:2", f"{a}:prod", f"{a}:latest", t.adapter_id, *t.version_ids,
            f"{t.owner_id}/{a}/{t.version_ids[0]}", f"{t.owner_id}/{a}", f"{a.upper()}", f" {a}"]


def assert_not_found(r, what: str) -> None:
    assert r.status_code == 404, f"{what}: {r.status_code} {r.text}"
    body = r.json()
    msg = body["error"]["message"] if "error" in body else body["detail"]
    assert "not found" in msg.lower() or "does not exist" in msg.lower(), f"{what}: {msg}"


@pytest.mark.parametrize("method,template,body", ADAPTER_ROUTES)
def test_adapter_routes_answer_404_for_another_tenants_adapter(tenants, method, template, body):
    t, http = tenants, tenants.server.http
    for name in (t.adapter, t.adapter_id, t.version_ids[0]):
        for n in (1, 2):
            path = template.format(name=name, n=n, alias="prod")
            r = http.request(method, path, headers=bearer(t.other_key), json={"version": n} if body else None)
            if name != t.adapter and r.status_code == 400:
                continue     # an id that is not a valid adapter name is refused by the path pattern first
            assert_not_found(r, f"{method} {path}")
            missing = http.request(method, template.format(name="no-such-adapter", n=n, alias="prod"),
                                   headers=bearer(t.other_key), json={"version": n} if body else None)
            assert missing.status_code == 404 and missing.json()["error"]["code"] == r.json()["error"]["code"]  # indistinguishable
    # nothing happened to the owner's adapter
    r = http.get(f"/v1/adapters/{t.adapter}", headers=bearer(t.owner_key))
    assert r.status_code == 200 and [v["number"] for v in r.json()["versions"]] == [1, 2]
    assert r.json()["aliases"]["prod"] == 1


@pytest.mark.parametrize("route", INFERENCE_ROUTES)
def test_inference_answers_404_for_every_name_of_another_tenants_adapter(tenants, route):
    t, http = tenants, tenants.server.http
    for model in foreign_models(t):
        body = {"model": model, "max_tokens": 1,
                **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})}
        r = http.post(route, json=body, headers=bearer(t.other_key))
        assert r.status_code == 404, f"{model!r}: {r.status_code} {r.text}"
        assert r.json()["error"]["code"] == "model_not_found", r.text
        for secret in (t.owner_id, t.adapter_id, *t.version_ids):   # echoes only what the caller sent
            assert secret in model or secret not in r.text, r.text
    # the owner itself is served
    body = {"model": f"{t.adapter}:prod", "prompt": "hi", "max_tokens": 1}
    assert http.post("/v1/completions", json=body, headers=bearer(t.owner_key)).status_code == 200


def test_models_retrieve_answers_404_for_every_name_of_another_tenants_adapter(tenants):
    t, http = tenants, tenants.server.http
    for model in foreign_models(t):
        r = http.get(MODEL_ROUTE.format(model=model), headers=bearer(t.other_key))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", f"{model!r}: {r.text}"
    assert http.get(MODEL_ROUTE.format(model=f"{t.adapter}:prod"), headers=bearer(t.owner_key)).status_code == 200


def test_listings_never_show_another_tenants_adapters(tenants):
    t, http = tenants, tenants.server.http
    http.post("/v1/completions", json={"model": t.adapter, "prompt": "hi", "max_tokens": 1},
              headers=bearer(t.owner_key))
    for path in LISTING_ROUTES:
        r = http.get(path, headers=bearer(t.other_key))
        assert r.status_code == 200, f"{path}: {r.text}"
        assert t.adapter not in r.text and t.owner_id not in r.text, f"{path} leaks: {r.text[:300]}"
    names = [m["id"] for m in http.get("/v1/models", headers=bearer(t.other_key)).json()["data"]]
    assert any(n.startswith(t.other_adapter) for n in names)


def test_same_name_upload_by_another_tenant_is_its_own_adapter(tenants, tiny_llama):
    from load_tests.adapters import rank1_adapter
    from tests.security.conftest import upload_files

    t = tenants
    created = upload_files(t.server, t.other_key, t.adapter, rank1_adapter(tiny_llama, value=0.05))
    assert created["number"] == 1         # its own version 1, not the owner's version 3 (no 409 leak either)
    r = t.server.http.get(f"/v1/adapters/{t.adapter}", headers=bearer(t.owner_key))
    assert [v["number"] for v in r.json()["versions"]] == [1, 2]
    assert t.server.http.delete(f"/v1/adapters/{t.adapter}", headers=bearer(t.other_key)).status_code in (200, 204)
    r = t.server.http.get(f"/v1/adapters/{t.adapter}", headers=bearer(t.owner_key))
    assert r.status_code == 200 and len(r.json()["versions"]) == 2


def test_every_tenant_route_is_covered(tenants):
    schema = tenants.server.http.get("/openapi.json").json()
    tenant_routes = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops
                     if p.startswith("/v1/")}
    covered = {(m, p.replace("{n}", "{number}")) for m, p, _ in ADAPTER_ROUTES}
    covered |= {("GET", p) for p in LISTING_ROUTES} | {("POST", p) for p in INFERENCE_ROUTES}
    covered |= {("POST", UPLOAD_ROUTE), ("GET", MODEL_ROUTE)} | OWN_ROUTES
    normalised = {(m, p) for m, p in tenant_routes}
    uncovered = {(m, p) for m, p in normalised
                 if (m, p) not in covered and (m, _generic(p)) not in {(cm, _generic(cp)) for cm, cp in covered}}
    assert not uncovered, f"tenant routes without an isolation case: {sorted(uncovered)}"


def _generic(path: str) -> str:
    import re

    return re.sub(r"\{[^}]+\}", "{}", path)


def test_another_tenants_keys_and_imports_are_404(tenants):
    """Key ids and import ids of the owner, used by the other tenant: 404 like ids that do not exist."""
    t, http = tenants, tenants.server.http
    keys = http.get("/v1/keys", headers=bearer(t.owner_key)).json()["data"]
    assert keys and all(k["prefix"] for k in keys)
    assert all(k["id"] not in http.get("/v1/keys", headers=bearer(t.other_key)).text for k in keys)
    r = http.delete(f"/v1/keys/{keys[0]['id']}", headers=bearer(t.other_key))
    assert r.status_code == 404 and r.json()["error"]["code"] == "key_not_found"
    assert http.get("/v1/adapters", headers=bearer(t.owner_key)).status_code == 200     # still live
    r = http.get("/v1/imports/no-such-import", headers=bearer(t.other_key))
    assert r.status_code == 404 and r.json()["error"]["code"] == "import_not_found"
