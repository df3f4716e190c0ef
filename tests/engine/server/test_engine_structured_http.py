"""Structured outputs and logit_bias over the engine's HTTP API (the app ``loraplex engine serve`` runs): the
``sampling`` object carries them, the stream's text matches the schema, a grammar that does not compile and a
bad token id are 400 ``invalid_request`` naming the problem, and nothing stays in flight."""
from __future__ import annotations

import json
import time

import httpx

PROMPT = [5, 17, 42, 99, 7, 13]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


def _generate(url: str, request_id: str, sampling: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/generate", json={"request_id": request_id, "prompt": PROMPT, "sampling": sampling},
                      timeout=60)


def _lines(resp: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in resp.text.splitlines() if line.strip()]


def _idle(service, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while service.health()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return service.health()["in_flight"]


def test_structured_and_logit_bias_over_http(engine_server):
    import jsonschema

    service, server = engine_server
    resp = _generate(server.url, "s-ok", {"max_tokens": 48, "temperature": 0.0,
                                          "structured": {"json_schema": SCHEMA, "strict": True}})
    assert resp.status_code == 200, resp.text
    chunks = _lines(resp)
    text = "".join(c["text"] for c in chunks)
    assert chunks[-1]["finished"] and chunks[-1]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)

    resp = _generate(server.url, "s-bias", {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                                            "logit_bias": {"123": 100}})
    assert resp.status_code == 200 and [t for c in _lines(resp) for t in c["token_ids"]] == [123] * 4
    assert _idle(service) == 0


def test_grammar_errors_and_bad_bias_are_400(engine_server):
    service, server = engine_server
    bad_schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    for rid in ("s-bad-1", "s-bad-2"):  # a compile failure, then the cached failure (refused before queueing)
        resp = _generate(server.url, rid, {"max_tokens": 8, "structured": {"json_schema": bad_schema}})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "invalid_request" and "uniqueItems" in err["message"]
    resp = _generate(server.url, "s-bad-3", {"max_tokens": 8, "structured": {"regex": "(", "choice": ["a"]}})
    assert resp.status_code == 400 and "exactly one of" in resp.json()["error"]["message"]
    resp = _generate(server.url, "s-bad-4", {"max_tokens": 8, "logit_bias": {"99999999": 1}})
    assert resp.status_code == 400 and "outside the vocabulary" in resp.json()["error"]["message"]
    resp = _generate(server.url, "s-bad-5", {"max_tokens": 8, "logit_bias": {"5": 500}})
    assert resp.status_code == 400 and "[-100, 100]" in resp.json()["error"]["message"]
    assert _idle(service) == 0
