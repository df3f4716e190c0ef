"""Token streams and requests, as the scheduler and KV cache manager see them (torch-free).

    Sequence       one token stream: prompt + outputs, how many tokens have K/V cached, its block table
    SequenceGroup  one request: its sequences (n > 1 and beams fork them), sampling params, adapter, timings

A sequence's tokens split into computed (K/V in the cache) and not yet computed:

    all_token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]         num_tokens = 7
                      <-- computed --> <-new->         num_computed_tokens = 5

Overlapped steps (engine/step_pipeline.py) append an output token before its value has reached the host: a
*pending* token, stored as ``PENDING_TOKEN_ID`` and counted by ``num_pending_tokens`` (0 or 1), always the last
one and never computed. Its value is written in by ``resolve_pending_token`` before anything reads the tokens
(stop checks, detokenizer, outputs, prefix-cache hashes):

    all_token_ids:  [ p0 p1 p2 | o0 o1 | ? ]           ? = pending: counted (max_tokens, blocks), value unknown

Speculative decoding (engine/spec_decode/) proposes draft tokens for a decode before the step is scheduled:
``spec_token_ids``, outside the token lists (not counted anywhere) until the target accepts them.
"""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Hashable

from loraplex.engine.fairness import check_weight
from loraplex.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    SWAPPED = enum.auto()  # preempted by swapping: K/V in the CPU block pool, waiting to be swapped back in

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
PENDING_TOKEN_ID = -1  # an output token sampled on the device whose value the host has not read yet


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
        self.cumulative_logprob = 0.0  # sum of the chosen tokens' logprobs (best_of ranking, beam scores)
        self.parent_seq_id: int | None = None  # the sequence this one was forked from
        self.num_pending_tokens = 0  # trailing output tokens not read back from the device yet (0 or 1)
        self.spec_token_ids: list[int] = []  # speculative drafts proposed for the next step (never computed)

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

    def append_token(self, token_id: int, logprob: float = 0.0) -> None:
        """Add one output token; ``logprob`` (its log-probability) accumulates into ``cumulative_logprob``."""
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def append_tokens(self, token_ids: list[int], logprobs: list[float] | None = None) -> None:
        """Add several output tokens at once (a verify step's accepted ones); the same stream and score as
        ``append_token`` on each in order (``logprobs`` parallel to ``token_ids``; None: 0.0 each)."""
        self.output_token_ids.extend(token_ids)
        if logprobs is None:
            if token_ids:
                self.cumulative_logprob += 0.0  # x + 0.0 + 0.0 == x + 0.0, bit for bit (-0.0 becomes 0.0 once)
            return
        for logprob in logprobs:  # one addition per token, in order: the same rounding as append_token
            self.cumulative_logprob += logprob

    def append_pending_token(self) -> None:
        """Add one output token whose value is still on the device (an overlapped step sampled it)."""
        if self.num_pending_tokens:
            raise RuntimeError(f"sequence {self.seq_id} already has a pending token (pipeline depth is one)")
        self.output_token_ids.append(PENDING_TOKEN_ID)
        self.num_pending_tokens = 1

    def resolve_pending_token(self, token_id: int, logprob: float = 0.0) -> None:
        """Write the value of the pending token (it accumulates ``logprob`` as ``append_token`` does)."""
        if not self.num_pending_tokens:
            raise RuntimeError(f"sequence {self.seq_id} has no pending token")
        self.output_token_ids[-1] = token_id
        self.num_pending_tokens = 0
        self.cumulative_logprob += logprob

    def fork(self, seq_id: int | None = None) -> "Sequence":
        """A copy of this stream under a new id (tokens, computed count, score, status), with no blocks: the KV
        cache manager's ``fork(parent, child)`` gives it the parent's blocks."""
        child = Sequence(next(_seq_ids) if seq_id is None else seq_id, self.request_id, self.prompt_token_ids,
                         self.extra_key)
        child.output_token_ids = list(self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.parent_seq_id = self.seq_id
        return child

    def __repr__(self) -> str:  # lengths only: never the prompt
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)}, {self.status.name})")


class SequenceGroup:
    """One request: its sequences, options and timings. ``adapter`` is opaque here (None = base model);
    the scheduler only compares it by identity for the ``max_loras`` budget.

    ``tenant`` (None: no tenant; such requests share one) and ``weight`` (> 0) place the request in the
    tenant-fair scheduling policy (engine/fairness.py): a tenant of weight 2 is served twice the tokens of a
    tenant of weight 1 when both are backlogged."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float | None = None, adapter: object | None = None, tenant: str | None = None,
                 weight: float = 1.0) -> None:
        if not seqs:
            raise ValueError(f"request {request_id!r} has no sequences")
        check_weight(weight)
        self.request_id = request_id
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.adapter = adapter
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.beam_search: object | None = None  # a BeamSearchState while use_beam_search (engine/beam_search.py)
        self.tenant = tenant
        self.weight = float(weight)
        self.tenant_state: object | None = None  # the scheduler's record of the tenant (fairness.TenantState)
        self.num_charged_prompt_tokens = 0  # prompt positions charged to the tenant (a recompute charges no more)

    @classmethod
    def from_prompt(cls, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, adapter: object | None = None,
                    extra_key: Hashable | None = None, tenant: str | None = None,
                    weight: float = 1.0) -> "SequenceGroup":
        """A one-sequence request; ``extra_key`` salts its prefix-cache hashes (pass the adapter id)."""
        return cls(request_id, [Sequence(next(_seq_ids), request_id, prompt_token_ids, extra_key)], sampling_params,
                   arrival_time, adapter, tenant, weight)

    @property
    def seq(self) -> Sequence:
        """The only sequence (n == 1)."""
        return self.seqs[0]

    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    def add_seq(self, seq: Sequence) -> None:
        """Add a forked sequence (parallel sampling, a new beam)."""
        if seq.request_id != self.request_id:
            raise ValueError(f"sequence of request {seq.request_id!r} added to request {self.request_id!r}")
        if any(s.seq_id == seq.seq_id for s in self.seqs):
            raise ValueError(f"sequence {seq.seq_id} is already in request {self.request_id!r}")
        self.seqs.append(seq)

    def remove_seq(self, seq: Sequence) -> None:
        """Drop a sequence (a pruned beam); its blocks must have been freed."""
        self.seqs.remove(seq)

    def best_seqs(self, n: int) -> list[Sequence]:
        """The ``n`` finished sequences with the highest ``cumulative_logprob`` (best_of), best first; ties keep
        sequence order."""
        done = [s for s in self.seqs if s.status.is_finished]
        return sorted(done, key=lambda s: -s.cumulative_logprob)[:n]

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={len(self.seqs)}, finished={self.is_finished()})"
