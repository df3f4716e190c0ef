"""What the scheduler hands the model runner for one step: plain data, no tensors.

    scheduled[i]: compute seq.all_token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]
                  into the slots of block_ids; if sample, the step's last token of that sequence yields logits
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.sequence import Sequence


@dataclass
class ScheduledSequence:
    """One sequence's share of a step. ``block_ids`` is its full block table after allocation (a copy)."""

    seq: Sequence
    num_new_tokens: int
    block_ids: list[int]
    sample: bool  # True iff num_computed_tokens + num_new_tokens == seq.num_tokens

    @property
    def start(self) -> int:
        """Position of the first new token (== seq.num_computed_tokens before ``Scheduler.update``)."""
        return self.seq.num_computed_tokens

    @property
    def is_prefill_chunk(self) -> bool:
        return self.num_new_tokens > 1 or not self.sample


@dataclass
class SchedulerOutput:
    """One step: the sequences to run (running ones first, FCFS), the tokens in all, and side effects."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)               # request ids preempted this step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst); copy-on-write, later

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
