"""Choices: a request's completions built up from its engine chunks, in the client's index space.

    EngineChunk.outputs (engine index, deltas) ──add──▶ deltas by client index (streaming)
                                               ──final──▶ one Choice per client index (whole answers)

A plan with ``fanout`` (greedy n > 1: one engine sequence) copies each delta to indexes 0..n-1; a plan with
``pick_best`` (best_of > n) keeps, at the end, the n completions of highest cumulative logprob, best first,
renumbered 0..n-1. A completion's ``finish_reason`` is taken once; one the engine never ended gets the request's.

With a ``parser`` factory (``PromptTokenizer.output_parser``: GPT-OSS chat, or tools offered) each engine
completion goes through its own parser (harmony's ``TokenFeed`` over its token ids, ``tools.ToolCallFeed`` over
its text): ``text`` is then the content only, ``reasoning`` the analysis channel, ``tool_calls`` the parsed calls,
and a completion whose calls closed (harmony: that ended in ``<|call|>``) finishes with "tool_calls".
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from loraplex.platform.engines.messages import EngineChunk, OutputDelta, TokenLogprob
from loraplex.platform.inference.plan import ChoicePlan


@dataclass
class ChoiceDelta:
    """One completion's part of a chunk, by client index (``OutputDelta`` with the parsed fields)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)     # ToolCallDelta parts (harmony.parser)


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)     # ToolCall (id, name, arguments; harmony.parser)


class Choices:
    def __init__(self, plan: ChoicePlan, parser: Callable[[], Any] | None = None) -> None:
        self.plan = plan
        self._engine: dict[int, Choice] = {}   # by engine index
        self._parser_factory = parser
        self._parsers: dict[int, Any] = {}     # by engine index: TokenFeed | ToolCallFeed
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, chunk: EngineChunk) -> list[ChoiceDelta]:
        """Take one chunk; returns its deltas by client index (a finish_reason only the first time)."""
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        deltas = []
        for o in chunk.outputs:
            c = self._engine.setdefault(o.index, Choice(o.index))
            d = self._parse(o)
            c.text += d.text
            c.reasoning += d.reasoning
            c.token_ids.extend(o.token_ids)
            c.logprobs.extend(o.logprobs or ())
            c.cumulative_logprob = o.cumulative_logprob
            if d.finish_reason and c.finish_reason is None:
                c.finish_reason = d.finish_reason
            elif d.finish_reason:
                d = replace(d, finish_reason=None)
            deltas.extend(self._fan(d))
        return deltas

    def _parse(self, o: OutputDelta) -> ChoiceDelta:
        d = ChoiceDelta(o.index, o.token_ids, o.text, o.finish_reason, o.cumulative_logprob, o.logprobs)
        if self._parser_factory is None:
            return d
        feed = self._parsers.get(o.index)
        if feed is None:
            feed = self._parsers[o.index] = self._parser_factory()
        parsed = feed.push_output(o)
        if o.finish_reason:
            parsed.merge(feed.finish())
            if feed.finish_reason == "tool_calls":
                d.finish_reason = "tool_calls"
        self._engine[o.index].tool_calls = feed.tool_calls
        d.text, d.reasoning, d.tool_calls = parsed.content, parsed.reasoning, parsed.tool_calls
        return d

    def _fan(self, o: ChoiceDelta) -> list[ChoiceDelta]:
        if self.plan.fanout == 1:
            return [o]
        return [replace(o, index=k) for k in range(self.plan.fanout)]

    def unfinished(self) -> list[int]:
        """Client indexes whose end was never reported (the request ended for them: abort, error)."""
        ended = {c.index for c in self._engine.values() if c.finish_reason}
        engine_missing = [i for i in range(self.plan.engine_n) if i not in ended]
        if self.plan.fanout > 1:
            return list(range(self.plan.fanout)) if engine_missing else []
        return engine_missing

    def final(self, request_reason: str | None) -> list[Choice]:
        """The client's choices, index 0..n-1 (a parser still open is flushed first: the request ended without a
        last chunk for it)."""
        for i, feed in self._parsers.items():
            if not feed.finished:
                c = self._engine[i]
                rest = feed.finish()
                c.text += rest.content
                c.reasoning += rest.reasoning
        engine = [self._engine.get(i) or Choice(i) for i in range(self.plan.engine_n)]
        for c in engine:
            c.finish_reason = c.finish_reason or request_reason
        if self.plan.pick_best:
            best = sorted(engine, key=lambda c: -c.cumulative_logprob)[:self.plan.n]
            return [replace(c, index=i) for i, c in enumerate(best)]
        if self.plan.fanout > 1:
            return [replace(engine[0], index=k) for k in range(self.plan.fanout)]
        return engine
