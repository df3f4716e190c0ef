"""At least 10,000 generated requests across every route of the app on PostgreSQL, Redis and S3, and not one
answer >= 500; every documented answer matches the OpenAPI schema, where every error (the ``default`` response
included) is OpenAI's ``ErrorBody``, so this also checks the one error shape on every route.

- The schema's operations: schemathesis cases (positive and negative: wrong types, missing and extra fields,
  out-of-range numbers, odd strings) through an in-process ASGI client, tenant routes with a tenant key and admin
  routes with the admin key, ``EXAMPLES`` per operation, derandomized (the same requests every run).
- Routes outside the schema (the dashboard, ``/metrics``, unknown paths, wrong methods): hypothesis-generated
  methods, query strings, headers and bodies: ``EXTRA_EXAMPLES``, or more when the schema's operations ran out
  of distinct cases before ``TARGET_REQUESTS`` (an operation without inputs has only a handful).

The app under test is a second app on the same backends as ``stack`` (its own gateway and null engine), so the
generated traffic does not disturb the live server the other tests use. ~2-3 minutes on 2 cores.
"""
from __future__ import annotations

import math

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance

from tests.security.live_stack import ADMIN_KEY

TARGET_REQUESTS = 10_000
EXTRA_EXAMPLES = 800
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
OUTSIDE_SCHEMA = ["/admin/dashboard", "/admin/dashboard/data", "/admin/dashboard/login", "/admin/dashboard/links",
                  "/admin/dashboard/logout", "/metrics", "/", "/v1", "/v1/models/", "/v1/adapters/x/versions",
                  "/docs", "/openapi.json", "/v2/chat/completions"]


@pytest.fixture(scope="module")
def asgi_app(stack):
    from schemathesis.python.asgi import get_client

    from loraplex.platform.main import create_app

    app = create_app(stack.server.app.state.settings)
    with get_client(app) as client:     # starts the app's lifespan once (gateway, engine, quota store)
        yield app, client


def test_ten_thousand_generated_requests_without_a_server_error(stack, asgi_app):
    app, client = asgi_app
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    examples = math.ceil((TARGET_REQUESTS - EXTRA_EXAMPLES) / len(operations) * 1.15)
    failures: dict[str, str] = {}
    calls = {"schema": 0, "outside": 0}
    statuses: dict[int, int] = {}

    for op in operations:
        headers = {"Authorization": f"Bearer {ADMIN_KEY if op.path.startswith('/admin') else stack.owner_key}"}

        @given(case=op.as_strategy())
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            calls["schema"] += 1
            response = case.call(session=client, headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=CHECKS)

        try:
            run()
        except Exception as e:  # noqa: BLE001 - collect every operation's first failure
            failures[op.label] = f"{type(e).__name__}: {str(e)[:1500]}"

    text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)

    @given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]), path=st.sampled_from(OUTSIDE_SCHEMA),
           query=st.dictionaries(st.sampled_from(["key", "login", "bin_s", "span_s", "x", "offset"]), text, max_size=3),
           body=st.one_of(st.none(), st.binary(max_size=200), st.dictionaries(text, text, max_size=3)),
           auth=st.sampled_from([None, ADMIN_KEY, stack.owner_key, "wrong"]))
    @settings(max_examples=max(EXTRA_EXAMPLES, TARGET_REQUESTS - calls["schema"] + 50), deadline=None,
              derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def outside(method, path, query, body, auth):
        calls["outside"] += 1
        kw = {"json": body} if isinstance(body, dict) else {"data": body} if body is not None else {}
        response = client.request(method, path, params=query, allow_redirects=False,
                                  headers={"Authorization": f"Bearer {auth}"} if auth else {}, **kw)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (method, path, query, response.status_code, response.text[:500])
        assert response.headers.get("x-request-id"), (method, path)
        if response.status_code >= 400 and response.headers.get("content-type", "").startswith("application/json"):
            assert set(response.json()) == {"error"}, (method, path, response.text[:300])

    try:
        outside()
    except Exception as e:  # noqa: BLE001
        failures["outside the schema"] = f"{type(e).__name__}: {str(e)[:1500]}"

    total = calls["schema"] + calls["outside"]
    print(f"\ngenerated requests: {total} ({calls}); statuses: {dict(sorted(statuses.items()))}")
    assert not failures, "\n\n".join(f"{k}\n{v}" for k, v in failures.items())
    assert total >= TARGET_REQUESTS, calls
    assert not any(status >= 500 for status in statuses), statuses
