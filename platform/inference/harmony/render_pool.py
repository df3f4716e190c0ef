"""Long conversations rendered in worker processes. openai-harmony's renderer is Rust that holds the GIL for the
whole call (about 0.15 s a MB of text), so rendering a few MB from a worker thread would still freeze the event
loop, every tenant's requests with it. Conversations past ``LONG_CHARS`` of text go to a small pool of processes
(spawned on first use, each with the same encoding loaded from the same vocabulary folder); shorter ones render in
the calling thread, where the call takes milliseconds.

    render_ids(vocab_dir, messages, kw)   -> ids, exactly ``HarmonyRenderer.render_ids`` in this process
    shutdown()                            the pools' processes stopped (the gateway's close)

A pool whose process died (or that ``shutdown`` stopped meanwhile) is dropped and the conversation renders in
the calling thread instead: a slower answer, not an error. The next long conversation starts a new pool.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from array import array
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

logger = logging.getLogger(__name__)

LONG_CHARS = 64 * 1024       # about 10 ms of rendering: below it the thread's GIL hold is harmless
WORKERS = max(1, min(2, os.cpu_count() or 1))

_pools: dict[str, ProcessPoolExecutor] = {}
_lock = threading.Lock()
_worker_renderer: Any = None   # in a pool process: its HarmonyRenderer
submitted = 0                  # conversations sent to a pool (for tests and the curious)


def text_size(messages: Any, kw: dict[str, Any]) -> int:
    """Characters of text a conversation holds (its repr: contents, tool calls, tool schemas), a cheap bound."""
    return len(repr(messages)) + len(repr(kw))


def _init(vocab_dir: str) -> None:
    from loraplex.platform.inference.harmony.render import HarmonyRenderer

    global _worker_renderer
    _worker_renderer = HarmonyRenderer.from_vocab_dir(vocab_dir)


def _render(messages: Any, kw: dict[str, Any]) -> tuple[bool, bytes | str, str | None]:
    """(ok, ids as uint32 bytes | the refusal's message, the refusal's param); the exception itself would not
    survive pickling with its param."""
    from loraplex.platform.inference.harmony.render import HarmonyRenderError

    try:
        ids = _worker_renderer.render_here(messages, **kw)
    except HarmonyRenderError as e:
        return False, str(e), e.param
    return True, array("I", ids).tobytes(), None


def _pool(vocab_dir: str) -> ProcessPoolExecutor:
    with _lock:
        pool = _pools.get(vocab_dir)
        if pool is None:
            pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
                                       initargs=(vocab_dir,))
            _pools[vocab_dir] = pool
        return pool


def render_ids(vocab_dir: str, messages: Any, kw: dict[str, Any]) -> list[int] | None:
    """The conversation's ids rendered in a pool process; None when the pool broke (the caller renders itself).
    Raises ``HarmonyRenderError`` as the renderer would."""
    from loraplex.platform.inference.harmony.render import HarmonyRenderError

    global submitted
    pool = _pool(vocab_dir)
    try:
        submitted += 1
        ok, payload, param = pool.submit(_render, messages, kw).result()
    except (BrokenProcessPool, CancelledError, RuntimeError):   # a process died, or ``shutdown`` ran meanwhile
        # (RuntimeError: submit to a pool shut down after this thread took it; BrokenProcessPool is one too)
        logger.warning("the harmony rendering pool stopped; this conversation renders in the gateway's thread")
        with _lock:
            if _pools.get(vocab_dir) is pool:
                del _pools[vocab_dir]
        pool.shutdown(wait=False, cancel_futures=True)
        return None
    if not ok:
        raise HarmonyRenderError(str(payload), param or "messages")
    ids = array("I")
    ids.frombytes(payload)  # type: ignore[arg-type]
    return ids.tolist()


def shutdown() -> None:
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)
