"""Choices: a request's completions built up from its engine chunks, in the client's index space.

    EngineChunk.outputs (engine index, deltas) ──add──▶ deltas by client index (streaming)
                                               ──final──▶ one Choice per client index (whole answers)

A plan with ``fanout`` (greedy n > 1: one engine sequence) copies each delta to indexes 0..n-1; a plan with
``pick_best`` (best_of > n) keeps, at the end, the n completions of highest cumulative logprob, best first,
renumbered 0..n-1. A completion's ``finish_reason`` is taken once; one the engine never ended gets the request's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from loraplex.platform.engines.messages import EngineChunk, OutputDelta, TokenLogprob
from loraplex.platform.inference.plan import ChoicePlan


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0


class Choices:
    def __init__(self, plan: ChoicePlan) -> None:
        self.plan = plan
        self._engine: dict[int, Choice] = {}   # by engine index
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, chunk: EngineChunk) -> list[OutputDelta]:
        """Take one chunk; returns its deltas by client index (a finish_reason only the first time)."""
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        deltas = []
        for o in chunk.outputs:
            c = self._engine.setdefault(o.index, Choice(o.index))
            c.text += o.text
            c.token_ids.extend(o.token_ids)
            c.logprobs.extend(o.logprobs or ())
            c.cumulative_logprob = o.cumulative_logprob
            if o.finish_reason and c.finish_reason is None:
                c.finish_reason = o.finish_reason
            elif o.finish_reason:
                o = replace(o, finish_reason=None)
            deltas.extend(self._fan(o))
        return deltas

    def _fan(self, o: OutputDelta) -> list[OutputDelta]:
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
        """The client's choices, index 0..n-1."""
        engine = [self._engine.get(i) or Choice(i) for i in range(self.plan.engine_n)]
        for c in engine:
            c.finish_reason = c.finish_reason or request_reason
        if self.plan.pick_best:
            best = sorted(engine, key=lambda c: -c.cumulative_logprob)[:self.plan.n]
            return [replace(c, index=i) for i, c in enumerate(best)]
        if self.plan.fanout > 1:
            return [replace(engine[0], index=k) for k in range(self.plan.fanout)]
        return engine
