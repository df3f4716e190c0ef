"""The proposer interface: what every way of drafting tokens (n-gram lookup, a draft model with per-adapter draft
LoRAs, an EAGLE-style head on the target's hidden states, replay) gets and returns.

    batch = [SpecSequence(seq, request_id, adapter, params, generator, num_draft_tokens=k_i, hidden_states=...)]
    proposals = proposer.propose(batch)      # one Proposal (or None: no draft this step) per entry, same order
        Proposal.token_ids   up to k_i draft tokens
        Proposal.probs       [len(token_ids), V] float32: the distribution each draft was drawn from, for
                             rejection sampling; None = deterministic drafts (q one-hot), which the rule handles
    ... one target forward verifies every sequence's drafts ...
    proposer.observe([Verified(seq_id, adapter, draft_token_ids, num_accepted, token_ids)])
    proposer.release(seq_id)                 # the sequence finished, was aborted or preempted: drop its state

The proposer is called once per engine step, before scheduling, with the running sequences that may speculate:
decodes (one token left to compute, no pending token) of requests that did not opt out
(``SamplingParams.speculative``), one sequence each (no n > 1, best_of or beam search), with room for at least one
draft under ``max_tokens`` and ``max_model_len``. ``num_draft_tokens`` is that room capped at the engine's k. A
proposal may be shorter than k_i; the scheduler may cut it further (token budget, KV blocks), never lengthen it.

Hidden states. A proposer with ``needs_hidden_states = True`` (a draft head on the target's features) gets in
``SpecSequence.hidden_states`` the target's final hidden states (after the last norm, the input of ``lm_head``)
[n, H] of the positions ``hidden_start .. hidden_start + n - 1`` of that sequence computed since it was last
proposed for, accepted tokens only (rejected drafts' rows are dropped), or None when there are none; the engine
then runs every step holding such a sequence through the speculative executor, which keeps those rows. A proposer
that also sets ``aux_layer_ids`` (EAGLE-3) gets instead the target's residual stream entering each of those layers
(hidden + residual; the id L: the last layer's output before the final norm), concatenated in layer order:
[n, len(aux_layer_ids) * H].

Randomness: a proposer that samples (``probs`` set) draws with ``SpecSequence.generator`` (the request's own, None:
unseeded), so seeded requests stay reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.sequence import Sequence


@dataclass
class SpecSequence:
    """One sequence the proposer may draft for (read-only: never change ``seq``)."""

    seq: "Sequence"                  # token ids: seq.prompt_token_ids, seq.output_token_ids, seq.token_ids_slice
    request_id: str
    adapter: Any                     # the request's AdapterRef, or None (base model)
    params: "SamplingParams"
    generator: "torch.Generator | None"
    num_draft_tokens: int            # k for this sequence this step (>= 1)
    hidden_states: "torch.Tensor | None" = None  # needs_hidden_states only (module docstring)
    hidden_start: int = 0

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


@dataclass
class Proposal:
    """Draft tokens for one sequence. ``probs`` [len(token_ids), V] (the target's vocabulary; float32, any device)
    or None for deterministic drafts. ``planned_num_accepted`` / ``planned_tokens``: the replay proposer's forced
    outcome (benchmarks only; every other proposer leaves them None)."""

    token_ids: list[int]
    probs: "torch.Tensor | None" = None
    planned_num_accepted: int | None = None
    planned_tokens: list[int] | None = None


@dataclass
class Verified:
    """The outcome of one sequence's verification: ``num_accepted`` of ``draft_token_ids`` were accepted and
    ``token_ids`` (the accepted drafts, then the target's own token; cut at a stop) were appended."""

    seq_id: int
    adapter: Any
    draft_token_ids: list[int]
    num_accepted: int
    token_ids: list[int]


class Proposer:
    """Base class: override ``propose``; the rest are optional."""

    name = "proposer"
    needs_hidden_states = False
    aux_layer_ids: tuple[int, ...] = ()  # with needs_hidden_states: hidden rows are these layers' inputs (below)

    def propose(self, batch: list[SpecSequence]) -> list[Proposal | None]:
        raise NotImplementedError

    def observe(self, verified: list[Verified]) -> None:
        """Called after each verify step with the outcome of every verified sequence."""

    def release(self, seq_id: int) -> None:
        """The sequence left the running set (finished, aborted, preempted): drop what is kept for it."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


# name -> factory(config: SpeculativeConfig, engine_context: ProposerContext) -> Proposer
PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(method: str, factory: Callable[..., Proposer]) -> None:
    """Make ``SpeculativeConfig.method == method`` build its proposer with ``factory(config, context)``."""
    PROPOSERS[method] = factory


@dataclass
class ProposerContext:
    """What a proposer factory may use of the engine: the target runner (device, dtype, model config, block size),
    the scheduler limits and the vocabulary size."""

    runner: Any
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
