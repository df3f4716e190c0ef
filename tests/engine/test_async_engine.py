"""AsyncEngine streams concurrent requests, fails bad ones alone, and frees blocks when a consumer leaves."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from loraplex.engine import AsyncEngine, LLMEngine, SamplingParams


@pytest.fixture
def engine_path(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


def make(path):
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=32,
                                     progress=False)


def prompts(vocab):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 13, 21)]


def test_streams_match_sync_engine_and_bad_request_fails_alone(engine_path):
    sync = make(engine_path)
    ps = prompts(sync.model_config.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.output_token_ids for o in sync.generate(ps, params)]
    engine = AsyncEngine(make(engine_path))

    async def consume(rid, prompt):
        tokens, n_chunks = [], 0
        async for out in engine.generate(rid, prompt, params):
            tokens.extend(out.new_token_ids)
            n_chunks += 1
            assert out.output_token_ids == tokens
        return tokens, n_chunks

    async def bad():
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in engine.generate("bad", [], params):
                pass
        return "raised"

    async def main():
        return await asyncio.gather(*(consume(f"r{i}", p) for i, p in enumerate(ps)), bad())

    try:
        *results, bad_result = asyncio.run(main())
    finally:
        engine.shutdown()
    assert bad_result == "raised"
    for (tokens, n_chunks), exp in zip(results, expected):
        assert tokens == exp
        assert n_chunks == len(exp), "each token should stream as its own chunk"


def test_text_prompts_are_tokenized_off_the_engine_thread(engine_path):
    """A long text holds whichever thread tokenizes it; that is a worker thread, never the one that steps every
    tenant's requests. The tokens are the sync engine's for the same text."""
    import threading

    sync = make(engine_path)
    if sync.tokenizer is None:
        pytest.fail("the tiny checkpoint has no tokenizer")
    text = "the quick brown fox " * 6
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = sync.generate([text], params)[0].output_token_ids
    inner = make(engine_path)
    threads = []
    tokenize = inner.tokenize

    def recording(prompt):
        if isinstance(prompt, str):   # the engine thread checks the ids it is given against the vocabulary
            threads.append(threading.current_thread().name)
        return tokenize(prompt)

    inner.tokenize = recording
    engine = AsyncEngine(inner)

    async def main():
        tokens = []
        async for out in engine.generate("text", text, params):
            tokens.extend(out.new_token_ids)
        return tokens

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.shutdown()
    assert len(threads) == 1 and threads[0] not in ("loraplex-engine", threading.main_thread().name), threads


def test_consumer_that_leaves_aborts_and_frees_blocks(engine_path):
    inner = make(engine_path)
    engine = AsyncEngine(inner)
    ps = prompts(inner.model_config.vocab_size)

    async def leave_early():
        got = 0
        gen = engine.generate("leaver", ps[2], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        async for _ in gen:
            got += 1
            if got == 3:
                break
        await gen.aclose()
        return got

    try:
        assert asyncio.run(leave_early()) == 3
        deadline = time.monotonic() + 5
        while inner.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not inner.has_unfinished_requests()
        assert inner.kv_cache.num_free_blocks == inner.runner.num_blocks
    finally:
        engine.shutdown()


def test_call_runs_on_the_engine_thread_and_propagates_errors(engine_path):
    import threading

    engine = AsyncEngine(make(engine_path))

    async def main():
        name = await engine.call(lambda llm: threading.current_thread().name)
        free = await engine.call(lambda llm: llm.kv_cache.num_free_blocks)
        with pytest.raises(KeyError, match="nope"):
            await engine.call(lambda llm: {}["nope"])
        return name, free

    try:
        name, free = asyncio.run(main())
    finally:
        engine.shutdown()
    assert name == "loraplex-engine"
    assert free == engine.engine.runner.num_blocks


def test_one_step_is_handed_to_each_event_loop_in_one_call():
    """A step's outputs reach their queues in order through one call_soon_threadsafe per loop; a finished
    request's sink is dropped; a closed loop aborts its requests."""
    from types import SimpleNamespace

    class Loop:
        def __init__(self, closed=False):
            self.calls, self.closed = 0, closed

        def call_soon_threadsafe(self, fn, *args):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.calls += 1
            fn(*args)

    class Sink(list):
        put_nowait = list.append

    aborted = []
    ae = AsyncEngine.__new__(AsyncEngine)  # the routing only: no engine thread
    ae.engine = SimpleNamespace(abort=aborted.append)
    open_loop, closed_loop = Loop(), Loop(closed=True)
    sinks = {rid: Sink() for rid in "abcd"}
    ae._sinks = {"a": (open_loop, sinks["a"]), "b": (open_loop, sinks["b"]), "c": (open_loop, sinks["c"]),
                 "d": (closed_loop, sinks["d"])}

    def out(rid, finished=False, error=None):
        return SimpleNamespace(request_id=rid, finished=finished, finish_reason="error" if error else None,
                               error=error, error_retryable=False)

    outs = [out("a"), out("b", finished=True), out("c", error="no such adapter"), out("d"), out("zz")]
    ae._deliver_step(outs)
    assert open_loop.calls == 1
    assert sinks["a"] == [outs[0]] and sinks["b"] == [outs[1]] and sinks["d"] == []
    assert len(sinks["c"]) == 1 and "no such adapter" in str(sinks["c"][0])
    assert set(ae._sinks) == {"a", "c"} and aborted == ["d"]
