"""The dashboard behind the admin key: login form, HttpOnly cookie of a server-side session (revoked at sign-out,
expired by the server), ``?key=`` refused, bearer fallback."""
from __future__ import annotations

from fastapi.testclient import TestClient

from loraplex.platform.dashboard.auth import COOKIE, new_session, valid_session
from loraplex.platform.dashboard.sessions import MemorySessionStore
from tests.platform.dashboard.conftest import ADMIN_KEY, make_app

WRONG_KEY = "That admin key is not valid"


def test_without_a_session_the_page_is_the_login_form_and_data_is_401(app):
    with TestClient(app) as c:
        r = c.get("/admin/dashboard")
        assert r.status_code == 401 and 'action="/admin/dashboard/login"' in r.text and "{{error}}" not in r.text
        r = c.get("/admin/dashboard/data")
        assert r.status_code == 401 and r.json() == {"error": {
            "message": "missing or invalid admin key; send it as 'Authorization: Bearer <key>'",
            "type": "authentication_error", "param": None, "code": "unauthorized"}}
        assert c.get("/admin/dashboard/static/vendor/chart.umd.min.js").status_code == 200


def test_login_form_sets_an_httponly_cookie_that_opens_page_and_data(app):
    with TestClient(app) as c:
        r = c.post("/admin/dashboard/login", data={"key": "nope"})
        assert r.status_code == 401 and WRONG_KEY in r.text and COOKIE not in c.cookies
        r = c.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/admin/dashboard"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin/dashboard" in cookie
        assert ADMIN_KEY not in cookie
        r = c.get("/admin/dashboard")
        assert r.status_code == 200 and 'id="chart-throughput"' in r.text
        assert "default-src 'self'" in r.headers["content-security-policy"]
        r = c.get("/admin/dashboard/data")
        assert r.status_code == 200 and r.json()["tenants"][0]["tenant"] == "acme"
        token = c.cookies[COOKIE]
        r = c.post("/admin/dashboard/logout", follow_redirects=False)
        assert r.status_code == 303 and COOKIE not in c.cookies
        assert c.get("/admin/dashboard/data").status_code == 401
        c.cookies.set(COOKIE, token, path="/admin/dashboard")          # a copy of the cookie, replayed
        assert c.get("/admin/dashboard/data").status_code == 401       # revoked server-side
        assert c.get("/admin/dashboard").status_code == 401


def test_admin_key_in_the_url_is_refused(app):
    with TestClient(app) as c:
        r = c.get("/admin/dashboard", params={"key": ADMIN_KEY}, follow_redirects=False)
        assert r.status_code == 400 and "not accepted in URLs" in r.text and COOKIE not in c.cookies
        assert ADMIN_KEY not in r.text and r.headers["referrer-policy"] == "no-referrer"
        assert c.get("/admin/dashboard/data").status_code == 401


def test_bearer_admin_key_works_without_a_cookie_and_forged_cookies_do_not(app):
    with TestClient(app) as c:
        r = c.get("/admin/dashboard/data", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200
        c.cookies.set(COOKIE, "9999999999.deadbeef", path="/admin/dashboard")
        assert c.get("/admin/dashboard/data").status_code == 401


def test_sessions_expire_server_side_and_die_with_a_new_admin_key(clock):
    settings = make_app().state.settings.model_copy(update={"dashboard_session_s": 60})
    store = MemorySessionStore(clock=clock)
    token = new_session(store, settings)
    clock.t += 59
    assert valid_session(store, settings, token)
    clock.t += 2
    assert not valid_session(store, settings, token)                  # expired, whatever the browser keeps
    token = new_session(store, settings)
    other = settings.model_copy(update={"admin_key": settings.admin_key.__class__("another-key-xyz")})
    assert not valid_session(store, other, token) and valid_session(store, settings, token)
    assert not valid_session(store, settings, None) and not valid_session(store, settings, "garbage")
    assert not valid_session(store, settings, "x" * 10_000)


def test_data_reports_every_panel(app, clock):
    m = app.state.metrics
    clock.t += 30.0                                   # 30 s after start
    m.observe_request("acme", "bot", 200, 0.02, 0.004, 0.2, 10, 20)
    m.observe_request("acme", "bot", 503, error="engine_unavailable")
    m.observe_quota_rejection("acme", "tokens")
    m.observe_upload("rejected", "too_large")
    m.apply_engine_stats("e0", {"adapters": {"gpu": ["t/bot/1"], "cpu": ["t/bot/1", "t/x/2"], "loading": []},
                                "adapter_tiers": {"gpu": 1, "cpu": 2, "disk": 3}, "kv_blocks_total": 10,
                                "kv_blocks_used": 4})
    clock.t += 5.0                                    # the bin of those requests is complete
    with TestClient(app) as c:
        d = c.get("/admin/dashboard/data", params={"bin_s": 5, "span_s": 60},
                  headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert d["totals"]["requests"] == 2 and d["totals"]["error_rate"] == 0.5
    # bins since the start only (no empty history before it), the bin in progress left out
    assert d["series"]["t"][0] <= m.started < d["series"]["t"][0] + 5 and d["series"]["t"][-1] + 10 > clock.t
    assert len(d["series"]["t"]) == 7 and sum(d["series"]["errors_5xx"]) == 1
    assert sum(d["series"]["requests_per_s"]) * 5 == 2
    assert max(v for v in d["series"]["e2e_p50"] if v is not None) == 0.2
    assert d["adapters"]["tiers"] == {"gpu": 1, "cpu": 2, "disk": 3, "loading": 0}
    unnamed = {"tenant": None, "adapter": None, "version": None}   # ids the registry does not know: no names
    assert d["adapters"]["resident"] == [{"adapter_id": "t/bot/1", "replica": "e0", "tier": "gpu", **unnamed},
                                         {"adapter_id": "t/x/2", "replica": "e0", "tier": "cpu", **unnamed}]
    [acme] = d["tenants"]
    assert acme["tokens_last_min"] == 30 and acme["tokens_per_minute"] == 1000 and acme["tokens_pct"] == 3.0
    assert acme["requests_last_min"] == 2 and acme["quota_rejections"] == 1
    assert d["errors"][0]["status"] == 503 and d["errors"][0]["error"] == "engine_unavailable"
    assert d["uploads"]["outcomes"] == [{"outcome": "rejected", "reason": "too_large", "count": 1}]
