"""Speculative decoding through the platform: the embedded tiny engine speculating with n-gram drafts
(``LORAPLEX_ENGINE_SPECULATIVE_METHOD=ngram``), the official ``openai`` client. ``extra_body={"speculative": False}``
reaches the engine's sampling dict, gives the greedy text of a speculating request and proposes no draft (the
engine's own counters, read through the engine client's ``stats()``); a request without it speculates; a value
that is not a boolean is a 400 naming ``speculative``."""
from __future__ import annotations

import openai
import pytest

from tests.platform.gateway.conftest import LiveServer, make_adapter, settings_for

PROMPT = "one two three four one two three four one two three four one two three"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def live(tiny_base, tmp_path_factory):
    from loraplex.commands.db import run
    from loraplex.platform.main import create_app

    tmp = tmp_path_factory.mktemp("speculative")
    settings = settings_for(tmp, tiny_base, engine_mode="embedded", engine_device="cpu", engine_dtype="float32",
                            engine_speculative_method="ngram", engine_num_speculative_tokens=3)
    run("upgrade", "head", url=settings.sqlalchemy_url)
    server = LiveServer(create_app(settings))
    try:
        _, key = server.new_tenant()
        server.upload(key, "spec-a", make_adapter(tiny_base, str(tmp / "spec-a"), seed=1))
        sent = server.record_engine_requests()
        yield server, key, sent
    finally:
        server.stop()


def spec_stats(server) -> dict:
    """The embedded engine's speculative counters, through the gateway's engine client."""
    stats = server.call(server.gateway.router.replicas["embedded"].client.stats())
    assert stats["speculative"] is not None, "the embedded engine does not speculate"
    return stats["speculative"]


def proposed_by(spec: dict, adapter_id: str | None) -> int:
    return sum(row["proposed"] for row in spec["adapters"] if row["adapter"] == adapter_id)


def call(server, key, endpoint: str, model: str, **kw):
    c = server.openai(key)
    kw = {"model": model, "max_tokens": 24, "temperature": 0, **kw}
    if endpoint == "chat":
        r = c.chat.completions.create(messages=MESSAGES, **kw)
        return r.choices[0].message.content, r
    r = c.completions.create(prompt=PROMPT, **kw)
    return r.choices[0].text, r


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("adapter", [False, True])
def test_opting_out_keeps_the_text_and_proposes_nothing(live, endpoint, adapter):
    server, key, sent = live
    model = "spec-a" if adapter else server.gateway.model_name
    body = {"ignore_eos": True}

    before = spec_stats(server)
    speculated, _ = call(server, key, endpoint, model, extra_body=body)
    assert "speculative" not in sent[-1].sampling
    adapter_id = sent[-1].adapter.adapter_id if adapter else None
    middle = spec_stats(server)
    assert middle["proposed"] > before["proposed"], "a request without the opt-out proposed no draft"
    assert proposed_by(middle, adapter_id) > proposed_by(before, adapter_id)
    assert middle["verified"] > before["verified"]

    plain, r = call(server, key, endpoint, model, extra_body={**body, "speculative": False})
    assert sent[-1].sampling["speculative"] is False
    after = spec_stats(server)
    assert (after["proposed"], after["verified"]) == (middle["proposed"], middle["verified"])   # no draft at all
    assert plain == speculated and r.usage.completion_tokens == 24     # lossless: the same greedy text

    again, _ = call(server, key, endpoint, model, extra_body={**body, "speculative": True})
    assert sent[-1].sampling["speculative"] is True and again == plain
    assert spec_stats(server)["proposed"] > after["proposed"]


def test_streamed_opt_out_proposes_nothing(live):
    server, key, sent = live
    before = spec_stats(server)
    stream = server.openai(key).completions.create(model=server.gateway.model_name, prompt=PROMPT, max_tokens=16,
                                                   temperature=0, stream=True,
                                                   extra_body={"speculative": False, "ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text and sent[-1].sampling["speculative"] is False
    assert spec_stats(server)["proposed"] == before["proposed"]


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("value", ["false", 0, 1, "no", [], {"on": False}])
def test_a_value_that_is_not_a_boolean_is_a_400_naming_it(live, endpoint, value):
    server, key, sent = live
    n = len(sent)
    with pytest.raises(openai.BadRequestError) as e:
        call(server, key, endpoint, server.gateway.model_name, extra_body={"speculative": value})
    assert e.value.status_code == 400 and e.value.param == "speculative" and e.value.code == "invalid_value"
    assert "'speculative'" in e.value.message and "boolean" in e.value.message, e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    assert len(sent) == n     # nothing reached the engine


def test_null_is_not_sent(live):
    server, key, sent = live
    call(server, key, "completion", server.gateway.model_name, max_tokens=2, extra_body={"speculative": None})
    assert "speculative" not in sent[-1].sampling
