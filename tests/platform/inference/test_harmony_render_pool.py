"""Long harmony conversations render in worker processes (openai-harmony holds the GIL while it renders): the ids
are exactly the in-thread rendering's, refusals keep their field, and a stopped pool falls back to the thread."""
from __future__ import annotations

import pytest

from loraplex.platform.gateway.tokenizer import GIL_FREE_CHARS
from loraplex.platform.inference.harmony import HarmonyRenderer, HarmonyRenderError, render_pool
from tests.utils.harmony_vocab import o200k_vocab_dir

DATE = "2025-06-28"
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Looks things up. " * 5000,
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    folder = o200k_vocab_dir(str(tmp_path_factory.mktemp("o200k")))
    yield folder
    render_pool.shutdown()


def long_conversation() -> list[dict]:
    text = "Once upon a time, <|start|> a tale 東京 🙂 of 12345 words.\n\n" * (render_pool.LONG_CHARS // 40)
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": text}]},
            {"role": "assistant", "content": "Noted.", "reasoning_content": "thinking " * 100},
            {"role": "user", "content": text[:GIL_FREE_CHARS]}]


def test_long_conversations_render_in_a_pool_to_the_same_ids(vocab_dir):
    pooled = HarmonyRenderer.from_vocab_dir(vocab_dir)
    here = HarmonyRenderer(pooled.encoding)          # no vocabulary folder: always in the calling thread
    messages = long_conversation()
    kw = {"current_date": DATE, "reasoning_effort": "high", "tools": [TOOL]}
    before = render_pool.submitted
    ids = pooled.render_ids(messages, **kw)
    assert render_pool.submitted == before + 1
    assert ids == here.render_ids(messages, **kw) and len(ids) > render_pool.LONG_CHARS // 8
    short = [{"role": "user", "content": "What is 2 + 2?"}]
    assert pooled.render_ids(short, current_date=DATE) == here.render_ids(short, current_date=DATE)
    assert render_pool.submitted == before + 1, "a short conversation went to the pool"


def test_a_refusal_in_a_pool_process_names_its_field(vocab_dir):
    pooled = HarmonyRenderer.from_vocab_dir(vocab_dir)
    messages = [*long_conversation(), {"role": "tool", "tool_call_id": "nope", "content": "x"}]
    before = render_pool.submitted
    with pytest.raises(HarmonyRenderError) as e:
        pooled.render_ids(messages, current_date=DATE)
    assert render_pool.submitted == before + 1 and e.value.param == "messages.4.tool_call_id"


def test_a_stopped_pool_renders_in_the_thread_and_the_next_call_starts_another(vocab_dir, monkeypatch):
    pooled = HarmonyRenderer.from_vocab_dir(vocab_dir)
    messages = long_conversation()
    want = HarmonyRenderer(pooled.encoding).render_ids(messages, current_date=DATE)
    pool = render_pool._pool(vocab_dir)
    pool.shutdown(wait=True)                          # as if its processes had died: submit refuses
    from concurrent.futures.process import BrokenProcessPool

    def broken(*a, **k):
        raise BrokenProcessPool("a process died")

    monkeypatch.setattr(pool, "submit", broken)
    assert pooled.render_ids(messages, current_date=DATE) == want     # rendered here
    assert render_pool._pool(vocab_dir) is not pool                   # a fresh pool next time
    monkeypatch.undo()
    before = render_pool.submitted
    assert pooled.render_ids(messages, current_date=DATE) == want
    assert render_pool.submitted == before + 1
