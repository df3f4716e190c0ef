"""asyncio front of the engine: one background thread drives ``LLMEngine.step()``; each request's outputs are
streamed to its own asyncio queue.

    generate() ──(add/abort commands)──▶ engine thread: apply commands, step(), route outputs
        ▲                                                     │
        └──────────── per-request asyncio.Queue ◀─────────────┘  (one loop.call_soon_threadsafe per step)

A consumer that stops iterating (client gone, task cancelled) aborts its request, which frees its KV blocks.
With overlapped scheduling a step's outputs are delivered by the ``step()`` call after it (step_pipeline.py); the
loop keeps stepping while ``has_unfinished_requests()``, which counts a step still in flight.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora.manager import AdapterLoadError
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight requests are failed with this error."""


class RequestFailedError(RuntimeError):
    """The engine ended one request on a fault of its own (the message says what); other requests go on."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | None
    adapter: object | None
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    tenant: str | None = None
    weight: float = 1.0


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On the consumers' loop: one step's items into their queues, in order."""
    for sink, item in items:
        sink.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model: str, **kwargs) -> "AsyncEngine":
        return cls(LLMEngine.from_pretrained(model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- public API -----------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                       adapter: object | None = None, *, tenant: str | None = None,
                       weight: float = 1.0) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs, one per step that gives it a token; the last has ``finished=True``.
        ``tenant`` / ``weight``: see ``LLMEngine.add_request``. Bad input raises ValueError from the first
        iteration (a grammar that does not compile too, once its compile failed); an adapter that cannot be loaded
        raises AdapterLoadError (its message says why); other requests are unaffected."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        if isinstance(prompt, str) and self.engine.tokenizer is not None:
            # in a worker thread: a long text would otherwise hold the engine thread, every tenant's steps, meanwhile
            prompt = await asyncio.to_thread(self.engine.tokenize, prompt)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request_id, prompt, params, adapter, loop, sink, tenant, weight))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps (adapter evictions and anything else that
        touches device buffers the step uses); returns its result or raises its exception."""
        if not self.is_alive():
            raise EngineDeadError(f"engine loop is not running: {self._error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ---- engine thread --------------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._sinks.get(request_id)
        if target is None:
            return
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody listens any more
            self._sinks.pop(request_id, None)
            self.engine.abort(request_id)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Route one step's outputs: one hand-off per event loop (a single wake-up of that loop, not one per
        request), each sink getting its items in step order; a finished request's sink is dropped."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, Any]]] = {}
        for out in outputs:
            target = self._sinks.get(out.request_id)
            if target is not None:
                kind = getattr(out, "error_type", None)
                if out.finish_reason == "error" and kind == "invalid_request":
                    item = ValueError(out.error)  # e.g. its grammar does not compile: raised to the consumer
                elif out.finish_reason == "error" and kind == "engine_error":
                    item = RequestFailedError(out.error)
                elif out.finish_reason == "error":  # its adapter failed to load: the consumer gets it raised
                    item = AdapterLoadError(out.error, retryable=out.error_retryable)
                else:
                    item = out
                batches.setdefault(target[0], []).append((out.request_id, target[1], item))
            if out.finished:
                self._sinks.pop(out.request_id, None)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, [(sink, item) for _, sink, item in items])
            except RuntimeError:  # the consumers' loop is closed: nobody listens any more
                for request_id, _, _ in items:
                    self._sinks.pop(request_id, None)
                    self.engine.abort(request_id)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call):
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn(self.engine))
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        cmd.future.set_exception(e)
            elif isinstance(cmd, _Add):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.adapter, tenant=cmd.tenant,
                                            weight=cmd.weight)
                except (ValueError, TypeError) as e:
                    cmd.loop.call_soon_threadsafe(cmd.sink.put_nowait, e)
                    continue
                self._sinks[cmd.request_id] = (cmd.loop, cmd.sink)
            else:
                self.engine.abort(cmd.request_id)
                self._sinks.pop(cmd.request_id, None)

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver_step(self.engine.step())
        except BaseException as e:  # noqa: BLE001 - fail every waiter loudly, never hang them
            logger.exception("engine loop failed")
            self._error = e
            err = EngineDeadError(f"engine loop failed: {e!r}")
            for request_id in list(self._sinks):
                self._deliver(request_id, err)
            self._sinks.clear()
        finally:
            self._fail_pending_calls()

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call) and not cmd.future.done():
                cmd.future.set_exception(EngineDeadError("the engine loop stopped before running this call"))
