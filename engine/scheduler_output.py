"""What the scheduler hands the model runner for one step, and what the runner hands back: plain data.

    scheduled[i]: compute seq.all_token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]
                  into the slots of block_ids; if sample, the step's last token of that sequence yields logits:
                  num_samples draws from them (n > 1 at the fork step), or, for a beam, its log-prob row
                  with draft_token_ids (speculative decoding): num_new_tokens = 1 + len(draft_token_ids), the
                  decode's token then the drafts, each position yielding logits for verification
    before the forward pass, in this order:  blocks_to_swap_out (GPU -> CPU), blocks_to_swap_in (CPU -> GPU),
                                             blocks_to_copy (GPU -> GPU, copy-on-write)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any

from loraplex.engine.sequence import Sequence

if TYPE_CHECKING:
    from loraplex.engine.logprobs import TokenLogprob


@dataclass
class ScheduledSequence:
    """One sequence's share of a step. ``block_ids`` is its full block table after allocation (a copy)."""

    seq: Sequence
    num_new_tokens: int
    block_ids: list[int]
    sample: bool  # True iff num_computed_tokens + num_new_tokens - len(draft_token_ids) == seq.num_tokens
    num_samples: int = 1  # tokens drawn from the sampled row: n / best_of at a parallel-sampling fork step
    beam: bool = False    # the row becomes beam-search log-probs instead of a drawn token
    prompt_logprobs: int | None = None  # top-n of the prompt positions in this chunk (None: not asked)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative drafts verified after its last token

    @property
    def start(self) -> int:
        """Position of the first new token (== seq.num_computed_tokens before ``Scheduler.update``)."""
        return self.seq.num_computed_tokens

    @property
    def is_prefill_chunk(self) -> bool:
        return self.num_new_tokens - len(self.draft_token_ids) > 1 or not self.sample


@dataclass
class SchedulerOutput:
    """One step: the sequences to run (running ones first, FCFS), the tokens in all, and side effects."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)               # request ids preempted this step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) GPU; copy-on-write
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, gpu)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelStepOutput:
    """What the model runner returns for one step, keyed by sequence id.

    ``sampled[seq_id]``: the drawn tokens (one, or ``num_samples`` at a fork step: the parent's first, then one
    per child to fork); ``logprobs[seq_id]``: their entries where the params ask for logprobs or ``best_of > n``
    (else None); ``beam_logprobs[seq_id]``: a beam's next-token log-prob row [V]; ``prompt_logprobs[seq_id]``:
    ``(start, entries)`` of the prompt positions this step computed (``logprobs.prompt_logprobs``).
    """

    sampled: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list["TokenLogprob | None"]] = field(default_factory=dict)
    beam_logprobs: dict[int, Any] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list["TokenLogprob | None"]]] = field(default_factory=dict)
