"""A fixed sequence of events, then /metrics: exact counts per tenant and adapter, through the functions and
through a FastAPI app that mounts the route."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex.platform.metrics import BASE, MetricsConfig, PlatformMetrics, install_metrics, metrics_router
from tests.platform.metrics.conftest import parse_scrape, sample

# (tenant, adapter, status, ttft, tpot, e2e, prompt, completion)
WORKLOAD = [
    ("acme", "support-bot", 200, 0.020, 0.004, 0.20, 11, 7),
    ("acme", "support-bot", 200, 0.030, 0.005, 0.30, 13, 9),
    ("acme", "support-bot", 500, None, None, 0.01, 5, 0),
    ("acme", None, 200, 0.010, 0.002, 0.05, 4, 2),
    ("globex", "sql-writer", 200, 0.600, 0.050, 3.00, 100, 50),
    ("globex", "sql-writer", 429, None, None, None, 0, 0),
    ("globex", "support-bot", 200, 0.040, 0.006, 0.40, 20, 10),
]


def drive(m: PlatformMetrics) -> None:
    for tenant, adapter, status, ttft, tpot, e2e, prompt, completion in WORKLOAD:
        m.observe_request(tenant, adapter, status, ttft, tpot, e2e, prompt, completion)
    m.observe_quota_rejection("globex", "requests")
    m.observe_quota_rejection("globex", "requests")
    m.observe_quota_rejection("acme", "tokens")
    m.observe_upload("ready")
    m.observe_upload("rejected", "too_large")
    m.observe_upload("rejected", "too_large")


def check(values: dict) -> None:
    req = "loraplex_requests_total"
    assert sample(values, req, tenant="acme", adapter="support-bot", status="200") == 2
    assert sample(values, req, tenant="acme", adapter="support-bot", status="500") == 1
    assert sample(values, req, tenant="acme", adapter=BASE, status="200") == 1
    assert sample(values, req, tenant="globex", adapter="sql-writer", status="200") == 1
    assert sample(values, req, tenant="globex", adapter="sql-writer", status="429") == 1
    assert sample(values, req, tenant="globex", adapter="support-bot", status="200") == 1
    assert sum(v for (n, _), v in values.items() if n == req) == len(WORKLOAD)
    err = "loraplex_request_errors_total"
    assert sample(values, err, tenant="acme", adapter="support-bot", status="500") == 1
    assert sample(values, err, tenant="globex", adapter="sql-writer", status="429") == 1
    assert sample(values, err, tenant="acme", adapter="support-bot", status="200") is None
    assert sample(values, "loraplex_prompt_tokens_total", tenant="acme", adapter="support-bot") == 29
    assert sample(values, "loraplex_completion_tokens_total", tenant="acme", adapter="support-bot") == 16
    assert sample(values, "loraplex_prompt_tokens_total", tenant="globex", adapter="sql-writer") == 100
    assert sample(values, "loraplex_completion_tokens_total", tenant="globex", adapter="support-bot") == 10
    ttft = "loraplex_time_to_first_token_seconds"
    assert sample(values, ttft + "_count", tenant="acme", adapter="support-bot") == 2
    assert sample(values, ttft + "_sum", tenant="acme", adapter="support-bot") == pytest.approx(0.05)
    assert sample(values, ttft + "_bucket", tenant="acme", adapter="support-bot", le="0.025") == 1
    assert sample(values, ttft + "_bucket", tenant="acme", adapter="support-bot", le="0.05") == 2
    assert sample(values, ttft + "_bucket", tenant="globex", adapter="sql-writer", le="0.5") == 0
    assert sample(values, ttft + "_bucket", tenant="globex", adapter="sql-writer", le="1.0") == 1
    e2e = "loraplex_e2e_request_latency_seconds"
    assert sample(values, e2e + "_count", tenant="acme", adapter="support-bot") == 3   # the 500 had an e2e
    assert sample(values, e2e + "_count", tenant="globex", adapter="sql-writer") == 1  # the 429 had none
    assert sample(values, "loraplex_time_per_output_token_seconds_count", tenant="acme", adapter=BASE) == 1
    q = "loraplex_quota_rejections_total"
    assert sample(values, q, tenant="globex", kind="requests") == 2
    assert sample(values, q, tenant="acme", kind="tokens") == 1
    up = "loraplex_uploads_total"
    assert sample(values, up, outcome="ready", reason="ok") == 1
    assert sample(values, up, outcome="rejected", reason="too_large") == 2


def test_exact_counts_from_the_functions():
    m = PlatformMetrics()
    drive(m)
    check(parse_scrape(m.exposition().decode()))
    assert m.totals == {"requests": 7, "errors": 2, "prompt_tokens": 153, "completion_tokens": 78}


def test_exact_counts_through_the_route_of_an_app():
    app = FastAPI()
    m = install_metrics(app)
    drive(m)
    with TestClient(app) as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    check(parse_scrape(r.text))


def test_two_apps_in_one_process_do_not_share_metrics():
    a, b = FastAPI(), FastAPI()
    ma, mb = install_metrics(a), install_metrics(b)
    ma.observe_request("acme", "x", 200)
    with TestClient(a) as ca, TestClient(b) as cb:
        va, vb = parse_scrape(ca.get("/metrics").text), parse_scrape(cb.get("/metrics").text)
    assert sample(va, "loraplex_requests_total", tenant="acme", adapter="x", status="200") == 1
    assert sample(vb, "loraplex_requests_total", tenant="acme", adapter="x", status="200") is None
    assert mb.registry is not ma.registry


def _app_with_settings(**kw):
    from loraplex.platform.api.errors import install_error_handlers
    from loraplex.platform.core.config import Settings

    app = FastAPI()
    app.state.settings = Settings(environment="test", admin_key="admin-key-0123456789", secret_key="s" * 24, **kw)
    install_error_handlers(app)
    return app, install_metrics(app)


def test_an_app_with_settings_protects_the_scrape_with_the_admin_key_or_the_metrics_token():
    app, m = _app_with_settings(metrics_token="metrics-token-0123456789")
    m.observe_request("acme", "bot", 200)
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = client.get("/metrics", headers=headers)
            body = r.json()
            message = body["error"]["message"] if "error" in body else body["detail"]    # either error shape
            assert r.status_code == 401 and "missing or invalid admin key or metrics token" in message
            assert "acme" not in r.text and r.headers["www-authenticate"] == "Bearer"
        for token in ("admin-key-0123456789", "metrics-token-0123456789"):
            r = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and 'tenant="acme"' in r.text


def test_the_metrics_port_serves_the_scrape_without_auth_while_the_app_runs():
    import httpx

    from tests.utils.services import free_port

    port = free_port()
    app, m = _app_with_settings(metrics_port=port)
    m.observe_request("acme", "bot", 200)
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 401
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert r.status_code == 200 and 'tenant="acme"' in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/admin/dashboard", timeout=10).status_code == 404
    with pytest.raises(httpx.ConnectError):                   # stopped with the app's lifespan
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_protected_route_needs_the_admin_key():
    from loraplex.platform.api.errors import install_error_handlers
    from loraplex.platform.core.config import Settings

    app = FastAPI()
    app.state.settings = Settings(environment="test", admin_key="admin-key-0123456789", secret_key="s" * 24)
    app.state.metrics = PlatformMetrics()
    install_error_handlers(app)
    app.include_router(metrics_router(protect=True))
    with TestClient(app) as client:
        r = client.get("/metrics")
        assert r.status_code == 401 and "missing or invalid admin key" in r.json()["error"]["message"]
        r = client.get("/metrics", headers={"Authorization": "Bearer admin-key-0123456789"})
        assert r.status_code == 200 and "loraplex_requests_total" in r.text


def test_access_log_lines_never_show_credential_query_parameters():
    import logging

    from loraplex.platform.core.access_log import RedactQueryFilter, redact_target

    assert redact_target("/admin/dashboard?key=s3cr3t&bin=5") == "/admin/dashboard?key=[REDACTED]&bin=5"
    assert redact_target("/x?Api_Key=1&login=a.b.c&k=2&token") == "/x?Api_Key=[REDACTED]&login=[REDACTED]&k=2&token"
    assert redact_target("/x?%6Bey=1") == "/x?%6Bey=[REDACTED]" and redact_target("/plain") == "/plain"
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("1.2.3.4:5", "GET", "/admin/dashboard?key=s3cr3t", "1.1", 400), None)
    assert RedactQueryFilter().filter(record) and "s3cr3t" not in record.getMessage()


def test_versions_of_one_adapter_are_series_of_their_own_within_the_cap():
    """``bot:1``, ``bot:2`` and ``bot:prod`` (an alias of 2) count under the version that served them; past the
    label cap a (tenant, adapter, version) triple counts as ``_other`` with no version."""
    m = PlatformMetrics(MetricsConfig(max_adapter_labels=3))
    for version in ("1", "2", "2", "2"):          # bot:1, bot:2, bot:prod -> 2, bot -> 2
        m.observe_request("acme", "bot", 200, version=version)
    m.observe_request("acme", "other", 200, version="7")
    m.observe_request("acme", None, 200)
    values = parse_scrape(m.exposition().decode())
    assert sample(values, "loraplex_requests_total", tenant="acme", adapter="bot", version="1", status="200") == 1
    assert sample(values, "loraplex_requests_total", tenant="acme", adapter="bot", version="2", status="200") == 3
    assert sample(values, "loraplex_requests_total", tenant="acme", adapter="_other", version="", status="200") == 1
    assert sample(values, "loraplex_requests_total", tenant="acme", adapter="_base", version="", status="200") == 1
    assert {dict(lbls)["adapter"] for (n, lbls) in values if n == "loraplex_requests_total"} == {
        "bot", "_other", "_base"}
