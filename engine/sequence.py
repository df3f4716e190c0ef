"""Token streams and requests, as the scheduler and KV cache manager see them (torch-free).

    Sequence       one token stream: prompt + outputs, how many tokens have K/V cached, its block table
    SequenceGroup  one request: its sequences (one today; n > 1 later), sampling params, adapter, timings

A sequence's tokens split into computed (K/V in the cache) and not yet computed:

    all_token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]         num_tokens = 7
                      <-- computed --> <-new->         num_computed_tokens = 5
"""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Hashable

from loraplex.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
_FINISH_REASON = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort"}
_seq_ids = itertools.count(1 << 40)  # from_prompt's ids; far from an engine's own counter


class Sequence:
    """One token stream. ``block_ids`` is owned by the KV cache manager; nobody else writes it.

    ``extra_key`` (e.g. the adapter id) enters every prefix-cache hash, so the same prompt under two
    adapters never shares K/V.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 extra_key: Hashable | None = None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.extra_key = extra_key

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort", or None while unfinished."""
        return self.status.finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole stream."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:  # lengths only: never the prompt
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)}, {self.status.name})")


class SequenceGroup:
    """One request: its sequences, options and timings. ``adapter`` is opaque here (None = base model);
    the scheduler only compares it by identity for the ``max_loras`` budget."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float | None = None, adapter: object | None = None) -> None:
        if not seqs:
            raise ValueError(f"request {request_id!r} has no sequences")
        self.request_id = request_id
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.adapter = adapter
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @classmethod
    def from_prompt(cls, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, adapter: object | None = None,
                    extra_key: Hashable | None = None) -> "SequenceGroup":
        """A one-sequence request; ``extra_key`` salts its prefix-cache hashes (pass the adapter id)."""
        return cls(request_id, [Sequence(next(_seq_ids), request_id, prompt_token_ids, extra_key)], sampling_params,
                   arrival_time, adapter)

    @property
    def seq(self) -> Sequence:
        """The only sequence (n == 1)."""
        return self.seqs[0]

    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={len(self.seqs)}, finished={self.is_finished()})"
