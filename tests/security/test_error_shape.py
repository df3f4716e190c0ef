"""One error shape on every route: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with an
``x-request-id`` for each kind of refusal (400, 401, 403, 404, 405, 409, 413, 422, 429), the same id in the access
log, and an OpenAPI schema that documents it (400 for validation, not FastAPI's 422)."""
from __future__ import annotations

import logging

from tests.security.live_stack import ADMIN_KEY, assert_openai_error, lora_files

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_every_kind_of_refusal_has_the_shape_and_a_request_id(stack, caplog):
    http, auth = stack.server.http, stack.auth()
    base = stack.server.gateway.model_name
    tid, key = stack.server.new_tenant(quotas={"requests_per_minute": 1})
    limited = {"Authorization": f"Bearer {key}"}
    body = {"model": base, "prompt": "hi", "max_tokens": 1}
    assert http.post("/v1/completions", json=body, headers=limited).status_code == 200
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        answers = {
            400: http.get("/v1/adapters?limit=0", headers=auth),
            401: http.get("/v1/usage", headers={"Authorization": "Bearer nope"}),
            404: http.get("/v1/adapters/no-such", headers=auth),
            405: http.put("/healthz"),
            413: http.post("/v1/chat/completions", content=b"x" * (300 * 1024),
                           headers={**auth, "content-type": "application/json"}),
            422: stack.upload(stack.owner_key, "bad-config", lora_files(stack.base, config={"r": 0})),
            429: http.post("/v1/completions", json=body, headers=limited),
        }
        http.post("/admin/tenants", json={"name": "dup-" + tid[:8]}, headers=ADMIN)
        answers[409] = http.post("/admin/tenants", json={"name": "dup-" + tid[:8]}, headers=ADMIN)
        http.post(f"/admin/tenants/{tid}/disable", headers=ADMIN)
        answers[403] = http.get("/v1/adapters", headers=limited)
    for status, r in answers.items():
        error = assert_openai_error(r, status)
        assert error["type"] == {401: "authentication_error", 403: "permission_error",
                                 429: "rate_limit_exceeded"}.get(status, "invalid_request_error"), (status, error)
    assert answers[400].json()["error"]["param"] == "limit"
    assert answers[429].headers.get("retry-after")
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "loraplex.access")
    for status, r in answers.items():
        assert r.headers["x-request-id"] in logged and f" {status} " in logged, (status, logged[-500:])
    assert "limit=0" not in logged                          # paths are logged without their query string
    ok = http.get("/v1/models", headers=auth)
    assert ok.status_code == 200 and ok.headers["x-request-id"].startswith("req-")
    ids = {r.headers["x-request-id"] for r in answers.values()}
    assert len(ids) == len(answers)


def test_the_schema_documents_the_error_shape(stack):
    schema = stack.server.http.get("/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert set(schema["components"]["schemas"]["ErrorBody"]["properties"]) == {"error"}
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            documents_422 = path in ("/v1/adapters", "/v1/adapters/import") or "aliases" in path
            assert "422" not in op["responses"] or documents_422, (method, path)
            for status, response in op["responses"].items():
                if status[0] in "45" or status == "default":
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorBody"), (method, path, status)
