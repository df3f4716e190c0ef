"""Completions with a list of prompts (strings, a token-id list, token-id lists): one group of ``n`` choices per
prompt, ``index`` = prompt_index * n + choice, usage summed, streamed too; each prompt's choices equal that prompt sent
alone (greedy)."""
from __future__ import annotations

import pytest

PROMPTS = ["Once upon a time", "The llama said", "x"]


def alone(live, prompt, **kw) -> str:
    r = live.client().completions.create(model=live.model, prompt=prompt, max_tokens=5, temperature=0, **kw)
    return r.choices[0].text


@pytest.mark.parametrize("as_ids", [False, True])
def test_whole_answer_groups_choices_by_prompt(live, as_ids):
    tok = live.server.gateway.tokenizer
    prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS] if as_ids else PROMPTS
    r = live.client().completions.create(model=live.adapters[0], prompt=prompts, n=2, max_tokens=5, temperature=0,
                                         echo=True, logprobs=1)
    assert [c.index for c in r.choices] == list(range(6))
    singles = [live.client().completions.create(model=live.adapters[0], prompt=p, max_tokens=5, temperature=0)
               for p in prompts]
    for i, c in enumerate(r.choices):
        p = i // 2
        echoed = tok.decode(prompts[p]) if as_ids else PROMPTS[p]
        assert c.text == echoed + singles[p].choices[0].text, i
        assert c.logprobs.tokens and c.finish_reason == singles[p].choices[0].finish_reason
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)


def test_streamed_choices_interleave_and_add_up(live):
    stream = live.client().completions.create(model=live.model, prompt=PROMPTS, n=1, max_tokens=5, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    texts, finished, usage = {}, set(), None
    for e in stream:
        if not e.choices:
            usage = e.usage
        for c in e.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                assert c.index not in finished   # one finish per choice
                finished.add(c.index)
    assert finished == {0, 1, 2}
    singles = [alone(live, p) for p in PROMPTS]
    assert [texts[i] for i in range(3)] == singles
    assert usage is not None and usage.completion_tokens > 0


def test_empty_prompt_in_a_list_is_400(live):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=live.model, prompt=[[1, 2], []], max_tokens=2)
    assert e.value.param == "prompt" and "prompt 1" in e.value.message
