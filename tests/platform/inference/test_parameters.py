"""The parameter table: unknown and refused fields are 400 ``unsupported_parameter`` naming them, neutral values and
null pass, every field the request models read is in the table."""
from __future__ import annotations

import pytest

from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.parameters import PARAMETERS, check_parameters, compat_table, parameters_of
from loraplex.platform.inference.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("endpoint, body, param, message", [
    ("chat", {"store": True}, "store", "completions are not stored"),
    ("chat", {"functions": []}, "functions", "send `tools` instead"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities", "only text output"),
    ("chat", {"service_tier": "priority"}, "service_tier", "one service tier"),
    ("chat", {"echo": True}, "echo", "Unrecognized request argument supplied: echo"),
    ("completion", {"suffix": ""}, "suffix", "insertion"),
    ("completion", {"messages": []}, "messages", "Unrecognized request argument"),
    ("completion", {"x" * 100: 1}, "x" * 61 + "...", "Unrecognized request argument"),
])
def test_refused_and_unknown_fields(endpoint, body, param, message):
    with pytest.raises(InferenceError, match=message) as e:
        check_parameters({"model": "m", **body}, endpoint)
    assert e.value.status_code == 400 and e.value.code == "unsupported_parameter" and e.value.param == param


@pytest.mark.parametrize("body", [{"store": False}, {"modalities": ["text"]}, {"service_tier": "auto"},
                                  {"metadata": {}}, {"audio": None}, {"functions": None}, {"top_k": 3}])
def test_neutral_values_and_null_pass(body):
    check_parameters({"model": "m", **body}, "chat")


def test_neutral_values_compare_types():
    with pytest.raises(InferenceError):
        check_parameters({"store": 0}, "chat")   # 0 is not false


def test_every_field_of_the_request_models_is_in_the_table():
    for endpoint, model in (("chat", ChatCompletionRequest), ("completion", CompletionRequest)):
        known = parameters_of(endpoint)
        assert set(model.model_fields) <= set(known), set(model.model_fields) - set(known)
        accepted = {n for n, p in known.items() if p.status != "refused"}
        # parallel_tool_calls is read by the tool-calling code, not a field of its own here
        assert accepted - set(model.model_fields) <= {"parallel_tool_calls"}


def test_the_table_has_one_row_per_parameter_and_endpoint():
    rows = [(e, p.name) for p in PARAMETERS for e in p.endpoints]
    assert len(rows) == len(set(rows))
    assert compat_table().count("\n") == len(rows) + 2
    assert all(p.note for p in PARAMETERS) and all(not p.neutral for p in PARAMETERS if p.status != "refused")


def test_null_is_the_default():
    from loraplex.platform.inference.protocol import parse_request

    req = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "stream": None, "n": None, "max_tokens": None,
                                            "suffix": None, "logit_bias": None})
    assert (req.stream, req.n, req.max_tokens) == (False, 1, 16)
    chat = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "stream": None, "store": None, "tools": None, "response_format": None})
    assert chat.stream is False and chat.structured is None
