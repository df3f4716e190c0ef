"""Long harmony conversations render in worker processes (openai-harmony holds the GIL while it renders): the ids
are exactly the in-thread rendering's, refusals keep their field, and a stopped pool falls back to the thread."""
from __future__ import annotations

import pytest

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
            {"role": "user", "content": text[:16 * 1024]}]


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


def test_a_dead_or_stopped_pool_renders_in_the_thread_and_the_next_call_starts_another(vocab_dir):
    import os
    import signal
    import time

    pooled = HarmonyRenderer.from_vocab_dir(vocab_dir)
    messages = long_conversation()
    want = HarmonyRenderer(pooled.encoding).render_ids(messages, current_date=DATE)
    assert pooled.render_ids(messages, current_date=DATE) == want
    pool = render_pool._pool(vocab_dir)
    for pid in list(pool._processes):                 # its processes killed, as the OOM killer would
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(p.is_alive() for p in pool._processes.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pooled.render_ids(messages, current_date=DATE) == want     # rendered here
    fresh = render_pool._pool(vocab_dir)
    assert fresh is not pool
    fresh.shutdown(wait=True)                         # stopped after a caller took it (the gateway's close)
    assert pooled.render_ids(messages, current_date=DATE) == want
    assert render_pool._pool(vocab_dir) is not fresh
    before = render_pool.submitted
    assert pooled.render_ids(messages, current_date=DATE) == want
    assert render_pool.submitted == before + 1
