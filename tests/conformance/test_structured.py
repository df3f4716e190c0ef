"""Structured outputs through the API with the official client: ``parse()`` with a nested Pydantic model, JSON-schema
answers valid against their schema, compile errors as 400s naming the feature and the field, a concurrent batch
mixing constrained and free requests of different adapters."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Describe a llama as JSON"}]


class Size(BaseModel):
    unit: Literal["cm", "in"]
    value: int = Field(ge=0, le=300)


class Llama(BaseModel):
    name: Literal["ana", "bo", "cy"]
    size: Size
    friendly: bool
    colours: list[Literal["white", "brown"]] = Field(max_length=2)


NESTED_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                   "owner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                             "additionalProperties": False}},
    "required": ["id", "tags", "owner"], "additionalProperties": False}


def test_parse_returns_the_nested_model(live):
    client = live.client()
    for model in (live.model, live.adapters[0]):
        r = client.beta.chat.completions.parse(model=model, messages=MESSAGES, response_format=Llama, max_tokens=200,
                                               temperature=0)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Llama) and isinstance(parsed.size, Size)
        assert Llama.model_validate_json(r.choices[0].message.content) == parsed
        sentformat = live.sent[-1].sampling["structured"]
        assert sentformat["strict"] is True and "$defs" in json.dumps(sentformat["json_schema"])


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(live, stream):
    client = live.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": NESTED_SCHEMA, "strict": False}}
    r = client.chat.completions.create(model=live.adapters[1], messages=MESSAGES, response_format=fmt, n=2,
                                       temperature=1.0, seed=4, max_tokens=60, stream=stream)
    if stream:
        texts = {}
        for e in r:
            for c in e.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    else:
        texts = {c.index: c.message.content for c in r.choices}
    assert sorted(texts) == [0, 1]
    for t in texts.values():
        jsonschema.validate(json.loads(t), NESTED_SCHEMA)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "u", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "f", "strict": True, "schema": {"type": "string", "format": "llama-id"}}}},
     "response_format", "llama-id"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no schema", "schema": {}}}},
     "response_format.json_schema.name", "should match pattern"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
    ({"extra_body": {"guided_regex": "[a-z"}}, "guided_regex", "unclosed character class"),
    ({"extra_body": {"guided_grammar": "start: nothing_here"}}, "guided_grammar", "nothing_here"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "not valid JSON"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "1 to"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
     "one output constraint"),
]


@pytest.mark.parametrize("kw, param, message", BAD)
def test_constraints_that_cannot_compile_are_400_naming_the_field(live, kw, param, message):
    before = len(live.sent)
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=4, **kw)
    assert e.value.param == param and message in e.value.message, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert len(live.sent) == before   # refused before anything was queued


def test_strict_false_leaves_unsupported_keywords_unchecked(live):
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "maxItems": 2}
    r = live.client().chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=20, response_format={
        "type": "json_schema", "json_schema": {"name": "lenient", "schema": schema, "strict": False}})
    assert set(json.loads(r.choices[0].message.content)) <= {"a", "b"}


def test_batch_mixes_constrained_and_free_requests_of_different_adapters(live):
    """Sent together (one engine batch): every constrained answer matches its constraint, every free answer equals
    the same request sent alone."""
    a, b = live.adapters
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    jobs = [
        (a, {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
         lambda t: jsonschema.validate(json.loads(t), schema) is None),
        (b, {}, None),
        (live.model, {"extra_body": {"guided_regex": "[a-c]{2}[0-9]"}}, lambda t: re.fullmatch("[a-c]{2}[0-9]", t)),
        (a, {}, None),
        (b, {"extra_body": {"guided_choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        (live.model, {"extra_body": {"guided_grammar": 'start: "x" ("y" | "z")'}}, lambda t: t in ("xy", "xz")),
    ]
    client = live.client()

    def run(job):
        model, kw, _ = job
        return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, temperature=0,
                                              **kw).choices[0].message.content

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    for (model, kw, check), answer in zip(jobs, together):
        if check is None:
            assert answer == run((model, kw, None)), model
        else:
            assert check(answer), (model, kw, answer)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_too_large_to_run_is_a_400_naming_the_field(live, stream):
    """It compiles, so it reaches the engine; llguidance's parser stops on its first token (a row of 20,001 items
    against a limit of 2,000), and the answer is the engine's invalid request as a 400 naming the field."""
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(20000))
    with pytest.raises(openai.BadRequestError) as e:
        out = live.client().chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=4,
                                                    stream=stream, extra_body={"guided_grammar": grammar})
        if stream:
            list(out)
    assert e.value.param == "guided_grammar" and "the grammar is too large to run" in e.value.message, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    answer = live.client().chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=2)
    assert answer.choices[0].finish_reason in ("length", "stop")
