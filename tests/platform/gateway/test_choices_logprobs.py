"""n > 1, best_of, logprobs and echo through the gateway with the official ``openai`` client, against the embedded
engine on the tiny llama (CPU, float32): choices equal the engine's own results, logprobs equal log_softmax of
the HF model's logits, streams interleave their choices, usage bills every choice and candidate."""
from __future__ import annotations

import math

import pytest
import torch

from loraplex.platform.engines.messages import EngineRequest
from tests.platform.gateway.conftest import settings_for

TOL = 1e-4


@pytest.fixture
def server(serve, tmp_path, tiny_base):
    return serve(settings_for(tmp_path, tiny_base, engine_mode="embedded", engine_device="cpu",
                              engine_dtype="float32"))


@pytest.fixture(scope="module")
def hf(tiny_base):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the HF logits [len(ids), V]: row p scores token p + 1."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def engine_choices(server, prompt: list[int], sampling: dict, logprobs: dict | None = None) -> dict[int, list[int]]:
    """The embedded engine's own completions of ``prompt`` (token ids per index), asked directly; their logprob
    entries go to ``logprobs`` (by index) when given."""
    client = server.gateway.router.replicas["embedded"].client

    async def run():
        out: dict[int, list[int]] = {}
        async for chunk in client.generate(EngineRequest("direct-" + str(id(sampling)), None, prompt, sampling)):
            for o in chunk.outputs:
                out.setdefault(o.index, []).extend(o.token_ids)
                if logprobs is not None:
                    logprobs.setdefault(o.index, []).extend(o.logprobs or [])
        return out

    return server.call(run(), timeout=60)


def chat_prompt(server, messages) -> list[int]:
    tok = server.gateway.tokenizer
    return tok.encode(tok.chat_template.render(messages), add_special_tokens=False)


def test_chat_greedy_n3_logprobs_equal_hf(server, hf):
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    messages = [{"role": "user", "content": "Tell me about llamas"}]
    r = client.chat.completions.create(model=model, messages=messages, n=3, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3 * 6   # every choice is billed
    # the engine's greedy tokens, and HF's log_softmax at each of them
    prompt = chat_prompt(server, messages)
    direct: dict = {}
    ids = engine_choices(server, prompt, {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 3},
                         direct)[0]
    # the engine's values (the direct run hits the prefix cache, so float rounding may differ slightly)
    assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx([e.logprob for e in direct[0]], abs=TOL)
    logp = hf_logprobs(hf, prompt + ids)
    tok = server.gateway.tokenizer
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        for j, (entry, t) in enumerate(zip(content, ids)):
            row = logp[len(prompt) - 1 + j]
            assert entry.token == tok.decode([t])
            assert abs(entry.logprob - row[t].item()) < TOL
            assert entry.bytes == list(entry.token.encode("utf-8")) or entry.token == "\ufffd"
            top = row.topk(3)
            got = [x.logprob for x in entry.top_logprobs]
            assert len(got) == 3 and all(abs(a - b) < TOL for a, b in zip(got, top.values.tolist()))
            assert [x.token for x in entry.top_logprobs] == [tok.decode([i]) for i in top.indices.tolist()]
            assert abs(entry.top_logprobs[0].logprob - entry.logprob) < TOL   # greedy took the argmax
    # the tokens' bytes join into the text (also across tokens that split a character)
    raw = b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content
    assert raw == tok.decode(ids).encode("utf-8") or "\ufffd" in r.choices[0].message.content


def test_chat_seeded_n2_equals_engine_and_stream_interleaves(server):
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    messages = [{"role": "user", "content": "Once"}]
    args = dict(model=model, messages=messages, n=2, seed=7, temperature=1.0, max_tokens=8,
                extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**args)
    prompt = chat_prompt(server, messages)
    direct = engine_choices(server, prompt, {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2,
                                             "ignore_eos": True})
    tok = server.gateway.tokenizer
    assert [c.message.content for c in r.choices] == [tok.decode(direct[0]), tok.decode(direct[1])]
    assert direct[0] != direct[1]   # two samples, not copies
    assert r.usage.completion_tokens == 16

    events = list(client.chat.completions.create(**args, stream=True, logprobs=True,
                                                 stream_options={"include_usage": True}))
    assert [e.choices[0].delta.role for e in events[:2]] == ["assistant", "assistant"]
    assert [e.choices[0].index for e in events[:2]] == [0, 1]
    content = [(e.choices[0].index, e.choices[0]) for e in events[2:] if e.choices]
    order = [i for i, c in content if c.delta.content]
    first_one = order.index(1)
    assert 0 in order[first_one:], f"the choices did not interleave: {order}"
    for i in (0, 1):
        mine = [c for j, c in content if j == i]
        assert "".join(c.delta.content or "" for c in mine) == r.choices[i].message.content
        assert sum(len(c.logprobs.content) for c in mine if c.logprobs) == 8
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 16


def test_completions_echo_logprobs_equal_hf(server, hf):
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    text = "Once upon a time"
    prompt = server.gateway.tokenizer.encode(text, add_special_tokens=True)
    r = client.completions.create(model=model, prompt=text, echo=True, logprobs=2, temperature=0, max_tokens=4,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith(text) and len(c.text) > len(text)
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt) + 4 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    out = engine_choices(server, prompt, {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True})[0]
    logp = hf_logprobs(hf, prompt + out)
    for p, t in enumerate((prompt + out)[1:], start=1):
        assert abs(lp.token_logprobs[p] - logp[p - 1, t].item()) < TOL, p
        assert len(lp.top_logprobs[p]) in (2, 3)   # the 2 best, and the chosen token when it is not among them
    assert lp.text_offset[len(prompt)] == len(text)
    assert lp.text_offset == sorted(lp.text_offset)
    # usage: the prompt once, the completion's tokens (the prompt logprobs are free)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4

    # streamed: echo without logprobs comes first; with logprobs the same content as the whole answer
    parts = list(client.completions.create(model=model, prompt=text, echo=True, temperature=0, max_tokens=4,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert parts[0].choices[0].text == text and "".join(p.choices[0].text for p in parts) == c.text
    parts = list(client.completions.create(model=model, prompt=text, echo=True, logprobs=2, temperature=0,
                                           max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == c.text
    streamed = [x for p in parts if p.choices[0].logprobs for x in p.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert [x for p in parts if p.choices[0].logprobs for x in p.choices[0].logprobs.text_offset] == lp.text_offset


def test_completions_best_of_picks_highest_cumulative_logprob(server):
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    args = dict(model=model, prompt="The llama", temperature=1.0, seed=11, max_tokens=5,
                extra_body={"ignore_eos": True})
    # the same seed and sequence count: best_of's candidates are exactly these three
    every = client.completions.create(**args, n=3, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert len({round(t, 6) for t in totals}) == 3
    ranked = sorted(range(3), key=lambda i: -totals[i])
    best = client.completions.create(**args, n=2, best_of=3)
    assert [c.text for c in best.choices] == [every.choices[i].text for i in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 15   # every candidate is billed
    one = client.completions.create(**args, best_of=3, logprobs=1)
    assert one.choices[0].text == every.choices[ranked[0]].text
    assert math.isclose(sum(one.choices[0].logprobs.token_logprobs), max(totals), abs_tol=TOL)
