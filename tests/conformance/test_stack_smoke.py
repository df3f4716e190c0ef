"""A smoke subset on the production configuration (PostgreSQL, Redis quotas, S3 blobs, the null engine): the
openai client's refusals and structured-output errors are OpenAI-shaped 400s naming the field, with a request id;
constrained and list-prompt requests are served (the null engine ignores the constraint: the shapes are checked)."""
from __future__ import annotations

import openai
import pytest

from tests.security.live_stack import assert_openai_error


def test_refusals_and_unknown_fields_on_the_stack(stack):
    http, auth, model = stack.server.http, stack.auth(), stack.server.gateway.model_name
    cases = [({"store": True}, "store", "unsupported_parameter"),
             ({"max_token": 3}, "max_token", "unsupported_parameter"),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
              "response_format", "invalid_value"),
             ({"guided_regex": "(unclosed"}, "guided_regex", "invalid_value")]
    for extra, param, code in cases:
        r = http.post("/v1/chat/completions", headers=auth, json={
            "model": stack.adapter, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})
        error = assert_openai_error(r, 400)
        assert error["param"] == param and error["code"] == code, error
    client = openai.OpenAI(base_url=stack.server.url + "/v1", api_key=stack.owner_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=2, suffix="end")
    assert e.value.param == "suffix"


def test_constrained_and_list_prompt_requests_are_served_on_the_stack(stack):
    client = openai.OpenAI(base_url=stack.server.url + "/v1", api_key=stack.owner_key, max_retries=0)
    r = client.chat.completions.create(model=stack.adapter, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    r = client.completions.create(model=stack.adapter, prompt=["a", "b c"], n=2, max_tokens=3, temperature=0.5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 4 * 3


def test_every_route_answers_in_the_openai_error_shape(stack):
    from tests.security.live_stack import ADMIN_KEY

    http, auth, admin = stack.server.http, stack.auth(), {"Authorization": f"Bearer {ADMIN_KEY}"}
    cases = [("GET", "/v1/nope", {}, 404, None), ("GET", "/dashboard/api/nothing", {"headers": admin}, 404, None),
             ("GET", "/v1/usage?start=bad", {"headers": auth}, 400, "start"),
             ("GET", "/v1/adapters?limit=abc", {"headers": auth}, 400, "limit"),
             ("GET", "/admin/usage?start=x", {"headers": admin}, 400, "start"),
             ("POST", "/admin/tenants", {"headers": admin, "json": {"name": 5}}, 400, "name"),
             ("DELETE", "/v1/models/x", {"headers": auth}, 405, None),
             ("POST", "/v1/completions", {"headers": auth, "json": [1, 2]}, 400, None),
             ("POST", "/v1/chat/completions", {"headers": {**auth, "content-type": "application/json"},
                                               "content": b"{bad"}, 400, None)]
    for method, path, kw, status, param in cases:
        error = assert_openai_error(http.request(method, path, **kw), status)
        assert error["param"] == param, (path, error)
