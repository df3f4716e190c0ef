"""n > 1 and best_of against quotas and usage, with the null engine (fixed tokens " tok", every token certain):
the reservation is prompt + candidates * max_tokens, usage bills every choice and candidate, leases are released,
streams interleave their choices, and bad values are 400s naming the parameter."""
from __future__ import annotations

import openai
import pytest

from tests.platform.gateway.conftest import settings_for

TOK = " tok"


@pytest.fixture
def server(serve, tmp_path, tiny_base):
    return serve(settings_for(tmp_path, tiny_base, engine_max_num_seqs=8))


def test_usage_bills_every_choice_and_candidate_and_leases_are_released(server):
    _, key = server.new_tenant({"max_concurrency": 1})
    client, model = server.openai(key), server.gateway.model_name
    r = client.completions.create(model=model, prompt=[5, 6, 7], n=3, max_tokens=4)
    assert [c.text for c in r.choices] == [TOK * 4] * 3 and [c.index for c in r.choices] == [0, 1, 2]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 12)
    r = client.completions.create(model=model, prompt=[5, 6, 7], n=2, best_of=4, max_tokens=2)   # 4 run, 2 kept
    assert len(r.choices) == 2 and r.usage.completion_tokens == 8
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                       temperature=0, max_tokens=3)   # greedy: one engine sequence, two copies
    assert [c.message.content for c in r.choices] == [TOK * 3] * 2 and r.usage.completion_tokens == 6
    assert server.gateway.router.replicas["null"].client.service.num_requests == 3
    usage = server.http.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["totals"]
    assert (usage["requests"], usage["completion_tokens"]) == (3, 12 + 8 + 6)


def test_reservation_counts_candidates(server):
    _, key = server.new_tenant({"tokens_per_minute": 100})
    client, model = server.openai(key), server.gateway.model_name
    assert client.completions.create(model=model, prompt=[5, 6], max_tokens=40).usage.completion_tokens == 40
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5, 6], n=3, max_tokens=40)
    assert e.value.code == "request_too_large" and e.value.param == "n"
    assert "prompt (2) + n (3) x max_tokens (40) = 122 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5, 6], best_of=3, max_tokens=40)
    assert e.value.param == "best_of" and "lower 'best_of'" in e.value.message


def test_streams_interleave_choices_with_logprobs(server):
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    events = list(client.completions.create(model=model, prompt=[5, 6, 7], n=2, max_tokens=3, logprobs=1,
                                            stream=True))
    assert [e.choices[0].index for e in events] == [0, 1] * 3
    for i in (0, 1):
        mine = [e.choices[0] for e in events if e.choices[0].index == i]
        assert "".join(c.text for c in mine) == TOK * 3 and mine[-1].finish_reason == "length"
        assert [c.logprobs.tokens for c in mine] == [[TOK]] * 3
        assert [c.logprobs.text_offset for c in mine] == [[0], [4], [8]]
        assert [c.logprobs.top_logprobs for c in mine] == [[{TOK: 0.0}]] * 3
    # greedy n = 3 streams three copies of each token
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=3,
                                               temperature=0, max_tokens=2, stream=True, logprobs=True))
    assert [e.choices[0].index for e in chat] == [0, 1, 2] * 3
    assert [e.choices[0].delta.content for e in chat[3:]] == [TOK] * 6
    assert all(e.choices[0].logprobs.content[0].token == TOK for e in chat[3:])


BAD = [
    ("chat", {"n": 200}, "n", "less than or equal to 128"),
    ("chat", {"n": 9}, "n", "engines run at most 8 per request"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("completion", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("completion", {"n": 2, "best_of": 1}, "best_of", "must be greater than or equal to 'n'"),
    ("completion", {"best_of": 9}, "best_of", "engines run at most 8 per request"),
    ("completion", {"n": 1, "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ("completion", {"suffix": "x"}, "suffix", "not supported"),
]


def test_bad_values_are_400_naming_the_parameter(server):
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    for kind, extra, param, message in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            if kind == "chat":
                r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=2, **extra)
            else:
                r = client.completions.create(model=model, prompt="x", max_tokens=2, **extra)
            list(r) if extra.get("stream") else r
        assert e.value.param == param and message in e.value.message, (extra, e.value.message)
