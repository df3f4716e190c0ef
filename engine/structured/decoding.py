"""The engine's constrained requests: their compiled grammars, one matcher per sequence, each step's bitmask.

    add_request(id, spec)      cache hit: ready (or a cached failure: GrammarError now); miss: compile submitted
    state(id)                  "compiling" (the scheduler skips it, like a loading adapter) | "ready" | "failed"
    bitmask(seqs)              before sampling: the TokenBitmask of the constrained ones among ``seqs``
    advance(seqs)              after their tokens were appended: consume them; which grammars terminated / failed
    remove(id)                 finished or aborted

A matcher follows its sequence's output tokens (``GrammarMatcher.advance_to``): it consumes whatever it has not
seen, so the state survives preemption by recompute or swap unchanged (the output tokens are kept), a forked
sequence (n > 1, best_of) gets a new matcher that replays its tokens (one at the fork step), and a sequence that
lost tokens (speculative decoding's rejected drafts) is rolled back. Overlapped steps: a pending token (value
still on the device) is never consumed; ``bitmask`` runs after the previous step's tokens were resolved.

Mask filling loops over the rows on the step thread (llguidance releases the GIL): at batch 16-64 that beat its
thread-pool batch call on small hosts (benchmarks/engine/bench_grammar.py). With ``fill_threads`` > 1 the pool is
used once a step has at least ``fill_threads`` constrained rows.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from loraplex.engine.structured.bitmask import TokenBitmask
from loraplex.engine.structured.cache import GrammarCache, GrammarEntry
from loraplex.engine.structured.compiler import GrammarCompiler, GrammarError
from loraplex.engine.structured.matcher import GrammarMatcher
from loraplex.engine.structured.spec import StructuredOutput


# llguidance's parser stops a grammar that outgrows its limits (``LLParserLimits``: items in a row, items a step,
# lexer fuel and states) on the token after the mask that allowed it, with one of these in its error
_LIMIT_ERROR = re.compile(r"Too many items \(limit|items; max is|fuel|too many states|too many expressions")


@dataclass
class _Constrained:
    entry: GrammarEntry
    kind: str
    matchers: dict[int, GrammarMatcher] = field(default_factory=dict)


class StructuredDecoding:
    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: list[int], pin_memory: bool = False,
                 max_entries: int = 256, compile_timeout_s: float = 10.0, fill_threads: int = 1) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
        self.cache = GrammarCache(self.compiler.compile, max_entries=max_entries,
                                  compile_timeout_s=compile_timeout_s, prepare=self.compiler.warm)
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self.fill_threads = fill_threads
        self._executor = None
        self._requests: dict[str, _Constrained] = {}
        self.num_masked_rows = 0
        self.fill_s = 0.0      # host time filling masks
        self.advance_s = 0.0   # host time consuming tokens

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, spec: StructuredOutput) -> None:
        """Start (or find) the request's grammar; GrammarError at once for a grammar known not to compile."""
        entry = self.cache.get(spec)
        if entry.state == "failed":
            raise GrammarError(entry.error, spec.kind)
        self._requests[request_id] = _Constrained(entry, spec.kind)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._requests

    def state(self, request_id: str) -> str | None:
        """None for a request without a grammar."""
        req = self._requests.get(request_id)
        return None if req is None else self.cache.poll(req.entry)

    def error(self, request_id: str) -> str | None:
        req = self._requests.get(request_id)
        return None if req is None else req.entry.error

    def failed_requests(self) -> list[str]:
        return [rid for rid, req in self._requests.items() if self.cache.poll(req.entry) == "failed"]

    def wait_for_compiles(self, timeout: float) -> bool:
        """Block up to ``timeout`` s for a compile to finish; False when none is running."""
        entries = [r.entry for r in self._requests.values() if r.entry.state == "compiling"]
        if not entries:
            return False
        self.cache.wait(entries, timeout)
        return True

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---- the step -------------------------------------------------------------------------------------------
    def matcher_for(self, seq) -> GrammarMatcher | None:
        """``seq``'s grammar matcher, caught up with its output tokens (the speculative verifier walks drafts with
        it); None for a request without a grammar or whose grammar has not compiled. GrammarStateError as
        ``bitmask``."""
        req = self._requests.get(seq.request_id)
        if req is None or req.entry.compiled is None:
            return None
        return self._matcher(req, seq)

    def _matcher(self, req: _Constrained, seq) -> GrammarMatcher:
        m = req.matchers.get(seq.seq_id)
        if m is None:
            m = req.matchers[seq.seq_id] = req.entry.compiled.new_matcher()
        tokens = seq.output_token_ids[:seq.num_output_tokens - seq.num_pending_tokens]
        if not m.advance_to(tokens):
            if _LIMIT_ERROR.search(m.error or ""):
                reason = m.error.strip().splitlines()[0]  # the parser's state dump follows on later lines
                raise GrammarLimitError(f"the grammar is too large to run: {reason}; simplify it (fewer "
                                        "alternatives or properties)")
            raise GrammarStateError(f"the grammar refused output token {tokens[m.num_tokens]} at position "
                                    f"{m.num_tokens}: {m.error}")
        return m

    def bitmask(self, seqs: list) -> TokenBitmask | None:
        """The masks of the constrained ones among ``seqs`` (sequences about to sample), or None if there are none.
        GrammarStateError names a request whose tokens its grammar refuses (never for tokens drawn under its
        mask)."""
        rows = [(self._requests[s.request_id], s) for s in seqs if s.request_id in self._requests]
        if not rows:
            return None
        t0 = time.perf_counter()
        mask = TokenBitmask.allocate([s.seq_id for _, s in rows], self.vocab_size, pin=self.pin_memory)
        matchers = [self._matcher(req, s) for req, s in rows]
        if self.fill_threads > 1 and len(matchers) >= self.fill_threads:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(self.fill_threads)
            host = mask.host
            self._executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], host.data_ptr(),
                                                   host.shape[1] * 4, host.shape[0])
        else:
            for i, m in enumerate(matchers):
                m.fill_bitmask(mask.host, i)
        self.num_masked_rows += len(rows)
        self.fill_s += time.perf_counter() - t0
        return mask

    def advance(self, seqs: list) -> tuple[list, list[tuple[object, str, str]]]:
        """Consume the new output tokens of ``seqs`` (every unfinished sequence of the requests that sampled,
        forks included). Returns (sequences whose grammar is complete: finish them, [(sequence, error, error type)]
        whose token was refused: "invalid_request" where the parser stopped at its limits (``GrammarLimitError``,
        the client's grammar), else "engine_error"). Finished sequences' matchers are
        dropped."""
        t0 = time.perf_counter()
        done, failed = [], []
        for seq in seqs:
            req = self._requests.get(seq.request_id)
            if req is None or req.entry.compiled is None:
                continue
            if seq.status.is_finished:
                req.matchers.pop(seq.seq_id, None)
                continue
            try:
                m = self._matcher(req, seq)
            except GrammarLimitError as e:
                failed.append((seq, f"structured.{req.kind}: {e}", "invalid_request"))
                continue
            except GrammarStateError as e:
                failed.append((seq, str(e), "engine_error"))
                continue
            if m.is_terminated:
                done.append(seq)
        self.advance_s += time.perf_counter() - t0
        return done, failed

    def stats(self) -> dict:
        return {**self.cache.stats(), "constrained_requests": len(self._requests),
                "masked_rows": self.num_masked_rows, "fill_ms": self.fill_s * 1e3, "advance_ms": self.advance_s * 1e3,
                "tokenizer_ms": self.compiler.tokenizer_ms}

    def close(self) -> None:
        self.cache.close()


class GrammarStateError(RuntimeError):
    """A sequence's tokens left its grammar (an engine fault, never a client's)."""


class GrammarLimitError(GrammarStateError):
    """A grammar that compiled but outgrew the parser's limits (llguidance's items per row or per step, lexer fuel
    or states) on a token its mask allowed: the client's grammar is too large to run."""
