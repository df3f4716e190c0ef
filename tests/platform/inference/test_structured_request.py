"""response_format and guided_* to the engine's StructuredOutput: the mapping, one constraint per request, and
400s naming the field for malformed or uncompilable constraints."""
from __future__ import annotations

import pytest

from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from loraplex.platform.inference.structured_request import check_compiles

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kw):
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})


@pytest.mark.parametrize("kw, wire, param", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA, "strict": True}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     {"json_schema": SCHEMA, "strict": False}, "response_format"),
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA, "strict": False}, "guided_json"),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'},
     {"json_schema": SCHEMA, "strict": False}, "guided_json"),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}, "guided_regex"),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}, "guided_choice"),
    ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}, "guided_grammar"),
])
def test_mapping_onto_the_engine(kw, wire, param):
    req = chat(**kw)
    assert req.structured.param == param
    sampling = req.sampling_params(8)
    assert sampling["structured"] == wire
    assert SamplingParams.from_dict(sampling).structured.kind == next(iter(wire))   # the engine takes it as is
    check_compiles(req.structured)


def test_text_and_nothing_are_free():
    assert chat(response_format={"type": "text"}).structured is None and chat().structured is None
    assert "structured" not in chat().sampling_params(4)


def test_completions_take_response_format_as_an_extension():
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    assert req.sampling_params(4)["structured"] == {"json_object": True}


@pytest.mark.parametrize("kw, param, message", [
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"guided_regex": "a", "guided_grammar": 'start: "a"'}, "guided_grammar", "one output constraint"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
    ({"guided_regex": "  "}, "guided_regex", "non-empty string"),
    ({"guided_json": "[1, "}, "guided_json", "not valid JSON"),
    ({"guided_json": "3"}, "guided_json", "must be a JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
])
def test_malformed_constraints_are_400_naming_the_field(kw, param, message):
    with pytest.raises(InferenceError, match=message) as e:
        chat(**kw).structured
    assert e.value.status_code == 400 and e.value.param == param


@pytest.mark.parametrize("kw, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": {"type": "object", "not": {"required": ["a"]}}}}},
     "response_format", "unsupported JSON schema keyword(s): not"),
    ({"guided_json": {"type": "string", "format": "colour"}}, "guided_json", None),
    ({"guided_regex": "(a"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
])
def test_uncompilable_constraints_are_400_naming_the_field(kw, param, message):
    req = chat(**kw).structured
    if message is None:   # guided_json is lenient (strict false): an unknown format is left unchecked
        check_compiles(req)
        return
    with pytest.raises(InferenceError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        check_compiles(req)
    assert e.value.status_code == 400 and e.value.param == param and e.value.code == "invalid_value"
    assert "structured." not in e.value.message


@pytest.mark.parametrize("bias, message", [({"x": 1}, "token ids"), ({"5": 101}, r"\[-100, 100\]"),
                                           ({str(i): 1 for i in range(1025)}, "at most 1024")])
def test_logit_bias_is_checked(bias, message):
    with pytest.raises(InferenceError, match=message) as e:
        chat(logit_bias=bias)
    assert e.value.param == "logit_bias"


def test_logit_bias_reaches_the_engine():
    sampling = chat(logit_bias={"7": -100, "9": 2.5}).sampling_params(4)
    assert SamplingParams.from_dict(sampling).logit_bias == {7: -100.0, 9: 2.5}
