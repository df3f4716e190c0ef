"""Schemathesis against the app's own OpenAPI schema: generated requests (positive and negative) to every
operation, tenant routes with a tenant key and admin routes with the admin key; no answer may be a 5xx, and every
answer must match the documented schema and content type. Bounded: EXAMPLES per operation, derandomized."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance

from tests.security.conftest import ADMIN_KEY, bearer

EXAMPLES = 25
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


def test_no_5xx_and_schema_conformant_answers(tenants):
    server = tenants.server
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    failures: dict[str, str] = {}
    calls = 0

    for op in operations:
        headers = bearer(ADMIN_KEY) if op.path.startswith("/admin") else bearer(tenants.owner_key)

        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            nonlocal calls
            calls += 1
            response = case.call(base_url=server.url, headers=headers, timeout=30)
            case.validate_response(response, checks=CHECKS)

        try:
            run()
        except Exception as e:  # noqa: BLE001 - collect every operation's first failure
            failures[op.label] = f"{type(e).__name__}: {str(e)[:1500]}"
    assert calls >= len(operations) * 5
    assert not failures, "\n\n".join(f"{k}\n{v}" for k, v in failures.items())
