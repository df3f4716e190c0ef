"""Compiled grammars by ``StructuredOutput.cache_key``: an LRU, compiles on a small executor, a compile-time bound.

    entry = cache.get(spec)          # hit: the entry (ready or failed); miss: a new entry, its compile submitted
    cache.poll(entry)                # "compiling" | "ready" | "failed" (a compile past the time bound fails)

Failures are cached like successes, so a repeated bad schema is refused at once, synchronously. A compile still
running after ``compile_timeout_s`` fails its entry (the worker thread finishes in the background; llguidance's
own parser limits keep that bounded too). Entries beyond ``max_entries`` leave least recently used first; a
request holds its own reference, so eviction never takes a grammar from under a running sequence. Called from
one thread (the engine's); the executor only runs ``compile_fn``.
"""
from __future__ import annotations

import concurrent.futures
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from loraplex.engine.structured.spec import StructuredOutput


@dataclass
class GrammarEntry:
    key: str
    kind: str
    future: concurrent.futures.Future | None = None
    started: float | None = None  # when its compile began on the executor (queueing and ``prepare`` excluded)
    compiled: object | None = None
    error: str | None = None

    @property
    def state(self) -> str:
        if self.compiled is not None:
            return "ready"
        return "failed" if self.error is not None else "compiling"


class GrammarCache:
    def __init__(self, compile_fn: Callable[[StructuredOutput], object], *, max_entries: int = 256,
                 compile_timeout_s: float = 10.0, max_workers: int = 2,
                 prepare: Callable[[], None] | None = None) -> None:
        if max_entries < 1 or compile_timeout_s <= 0 or max_workers < 1:
            raise ValueError("max_entries and max_workers must be >= 1 and compile_timeout_s > 0")
        self._compile = compile_fn
        self._prepare = prepare  # run before each compile, outside its time bound (the one-off tokenizer wrap)
        self.max_entries = max_entries
        self.compile_timeout_s = compile_timeout_s
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                               thread_name_prefix="loraplex-grammar")
        self._entries: OrderedDict[str, GrammarEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.failures = 0
        self.compile_ms: list[float] = []  # of every successful compile, in order

    def get(self, spec: StructuredOutput) -> GrammarEntry:
        key = spec.cache_key
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            self.poll(entry)
            return entry
        self.misses += 1
        entry = GrammarEntry(key, spec.kind)
        entry.future = self._executor.submit(self._run, entry, spec)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry

    def _run(self, entry: GrammarEntry, spec: StructuredOutput) -> object:
        if self._prepare is not None:
            self._prepare()
        entry.started = time.monotonic()
        return self._compile(spec)

    def poll(self, entry: GrammarEntry) -> str:
        if entry.state != "compiling":
            return entry.state
        future = entry.future
        if future.done():
            try:
                entry.compiled = future.result()
                self.compile_ms.append(getattr(entry.compiled, "compile_ms", 0.0))
            except Exception as e:  # noqa: BLE001 - the request fails with the message
                entry.error = str(e) or type(e).__name__
                self.failures += 1
            entry.future = None
        elif entry.started is not None and time.monotonic() - entry.started > self.compile_timeout_s:
            entry.error = (f"the {entry.kind} took longer than {self.compile_timeout_s:g} s to compile; simplify it "
                           f"(fewer alternatives, smaller bounds)")
            future.cancel()
            entry.future = None
            self.failures += 1
        return entry.state

    def wait(self, entries: list[GrammarEntry], timeout: float) -> None:
        """Block up to ``timeout`` s until one of ``entries`` finishes compiling."""
        futures = [e.future for e in entries if e.future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the compile executor (e.g. wrapping the tokenizer ahead of the first compile)."""
        return self._executor.submit(fn)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        n = self.hits + self.misses
        ms = sorted(self.compile_ms)
        return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses, "failures": self.failures,
                "hit_rate": self.hits / n if n else 0.0, "compiles": len(ms),
                "compile_ms_median": ms[len(ms) // 2] if ms else None, "compile_ms_max": ms[-1] if ms else None}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
