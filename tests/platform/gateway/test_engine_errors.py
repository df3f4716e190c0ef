"""Engine refusals as tenants see them: the request field the engine's message is about becomes ``param`` (a
grammar the engine could not compile: the constraint's field, named in the message too)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex.platform.engines.errors import EngineError, EngineRequestError
from loraplex.platform.gateway.engine_errors import for_tenant
from loraplex.platform.inference.protocol import ChatCompletionRequest, CompletionRequest, parse_request


def prep(kind: str, **body):
    if kind == "chat":
        req = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    **body})
    else:
        req = parse_request(CompletionRequest, {"model": "m", "prompt": "x", **body})
    return SimpleNamespace(request_id="req-1", tenant=SimpleNamespace(id="t"), body=req, kind=kind)


@pytest.mark.parametrize("kind, body, message, param", [
    ("chat", {"guided_regex": "a+"}, "structured.regex: the regex does not compile: too big", "guided_regex"),
    ("chat", {"response_format": {"type": "json_object"}}, "structured.json_object: no EOS", "response_format"),
    ("completion", {}, "top_k=99 exceeds the vocabulary size 32", "top_k"),
    ("completion", {}, "logit_bias has token id(s) [40] outside the vocabulary [0, 32)", "logit_bias"),
    ("chat", {}, "min_tokens must be in [0, max_tokens=4], got 9", "min_tokens"),
    ("chat", {}, "prompt has 40 tokens, which leaves no room", None),      # not a chat parameter
    ("chat", {}, "stop strings need a tokenizer", "stop"),
    ("chat", {}, "something else happened", None),
])
def test_the_field_of_an_engine_refusal_is_param(kind, body, message, param):
    e = for_tenant(EngineRequestError(message), prep(kind, **body))
    assert e.status_code == 400 and e.param == param
    assert "structured." not in e.message and "req-1" in e.message


def test_server_errors_name_no_field():
    e = for_tenant(EngineError("top_k broke the engine"), prep("chat"))
    assert e.status_code == 500 and e.param is None and "top_k" not in e.message


@pytest.mark.parametrize("kind, params, param", [
    ("chat", {"n": 5, "temperature": 1.0}, "n"),
    ("completion", {"n": 1, "best_of": 5, "temperature": 1.0}, "best_of"),
])
def test_more_sequences_than_the_engine_runs_names_the_field_that_asked(kind, params, param):
    """The scheduler's refusal of a request wider than max_num_seqs, as the platform relays it."""
    from loraplex.engine.kv_cache import KVCacheManager
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.scheduler import Scheduler, SchedulerConfig
    from loraplex.engine.sequence import SequenceGroup

    sched = Scheduler(SchedulerConfig(max_num_seqs=4), KVCacheManager(64, 4, num_cpu_blocks=8))
    with pytest.raises(ValueError) as refused:
        sched.add(SequenceGroup.from_prompt("wide", [1, 2, 3], SamplingParams(max_tokens=2, **params)))
    e = for_tenant(EngineRequestError(str(refused.value)), prep(kind, **params))
    assert e.status_code == 400 and e.param == param
    assert f"lower {param}" in e.message and "max_num_seqs=4" in e.message
