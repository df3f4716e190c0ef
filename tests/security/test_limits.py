"""Size limits: inference request bodies (413 before parsing or tokenizing), prompt length and max_tokens against
the context (400 context_length_exceeded), bad max_tokens values (400 naming the field), and upload bodies (413)."""
from __future__ import annotations

import pytest

from tests.security.conftest import bearer


def post(t, path: str, body=None, *, content: bytes | None = None, headers: dict | None = None):
    h = {**bearer(t.owner_key), **(headers or {})}
    if content is not None:
        return t.server.http.post(path, content=content, headers={**h, "content-type": "application/json"})
    return t.server.http.post(path, json=body, headers=h)


def error(r) -> dict:
    return r.json()["error"]


def test_oversized_inference_body_is_413_before_parsing(tenants):
    limit = tenants.server.gateway.settings.max_request_bytes
    big = b'{"model": "x", "prompt": "' + b"a" * (limit + 10) + b'"}'
    r = post(tenants, "/v1/completions", content=big)
    assert r.status_code == 413 and error(r)["code"] == "request_too_large", r.text[:300]
    assert "LORAPLEX_MAX_REQUEST_BYTES" in error(r)["message"]

    def chunks():            # no Content-Length: the cap applies while streaming the body
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(limit // 65536 + 2):
            yield b"b" * 65536
        yield b'"}]}'

    r = tenants.server.http.post("/v1/chat/completions", content=chunks(),
                                 headers={**bearer(tenants.owner_key), "content-type": "application/json"})
    assert r.status_code == 413 and error(r)["code"] == "request_too_large", r.text[:300]


def test_prompt_longer_than_the_context_is_400(tenants):
    gw = tenants.server.gateway
    n = gw.max_model_len
    r = post(tenants, "/v1/completions", {"model": gw.model_name, "prompt": [5] * n, "max_tokens": 1})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text
    assert f"maximum context length is {n} tokens" in error(r)["message"] and error(r)["param"] == "max_tokens"
    r = post(tenants, "/v1/completions", {"model": gw.model_name, "prompt": [5] * (n - 4), "max_tokens": 5})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text
    r = post(tenants, "/v1/completions", {"model": gw.model_name, "prompt": [5] * (n - 4), "max_tokens": 4})
    assert r.status_code == 200, r.text      # exactly full is fine
    r = post(tenants, "/v1/chat/completions", {"model": gw.model_name, "max_tokens": 1,
                                               "messages": [{"role": "user", "content": "word " * (4 * n)}]})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -5), ("max_tokens", "many"),
                                         ("max_tokens", 10**12), ("max_completion_tokens", 0)])
def test_bad_max_tokens_is_400_naming_the_field(tenants, field, value):
    gw = tenants.server.gateway
    r = post(tenants, "/v1/chat/completions", {"model": gw.model_name, field: value,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert field in error(r)["message"] or error(r)["param"] in (field, "max_tokens"), r.text


def test_oversized_upload_is_413(tenants):
    limit = tenants.server.gateway.settings.max_upload_bytes
    files = [("files", ("adapter_config.json", b"{}")), ("files", ("adapter_model.safetensors", b"\0" * (limit + 1)))]
    r = tenants.server.http.post("/v1/adapters", data={"name": "huge"}, files=files, headers=bearer(tenants.owner_key))
    assert r.status_code == 413 and r.json()["error"]["message"], r.text[:300]
    assert tenants.server.http.get("/v1/adapters/huge", headers=bearer(tenants.owner_key)).status_code == 404
