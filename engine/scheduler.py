"""Continuous batching in the vLLM-v1 manner: no prefill and decode phases, only ``num_computed_tokens``.

Every step takes, under one token budget (``max_num_batched_tokens``) and ``max_num_seqs``:

    1. running sequences in FCFS (arrival) order: a decode gets 1 token, an unfinished prefill a chunk;
       out of blocks -> preempt the latest-arrived running *group* (all its sequences; it may be the asker's
       own): by swapping its blocks to the CPU pool or by recompute (``preemption_mode``)
    2. then swapped groups, front first, all of a group's blocks at once, unless this step preempted
    3. then waiting ones, front first (prefix hit first), while the budget lasts, nothing was preempted and no
       group is swapped out; with ``max_loras`` set, admission keeps the running set within that many adapters

    waiting (deque) --admit--> running (sorted by arrival) --update: stop/length--> finished, blocks freed
        ^                        |   ^     |
        +-- preempt: recompute --+   |     +-- preempt: swap --> swapped (FCFS) --swap in (whole group)--+
            blocks freed, num_computed_tokens = 0, outputs kept  +----------------------------------------+

A request with ``num_sequences > 1`` enters as one sequence. At its first sampled step the runner draws
``num_sequences`` tokens from the one logits row and ``update`` forks the children, which share every block
(copy-on-write on the next write). A beam-search request's beams step together once each has its log-prob row
(``BeamSearchState``): forks join the running list, pruned beams leave it.

Chunked prefill is nothing but scheduling fewer tokens than ``num_tokens - num_computed_tokens``.

Overlapped decode steps (engine/step_pipeline.py): ``update_launched`` gives each sequence of a launched step a
pending token (counted, value on the device), so ``schedule()`` plans the next step before the values arrive;
a sequence whose pending token reaches ``max_tokens`` / ``max_model_len`` is not scheduled again (it finishes
when the value arrives). ``update_resolved`` writes the values in and runs the stop checks, finishing a
sequence wherever it is by then (running, or preempted meanwhile: waiting or swapped).

Adapters (``adapter_slots``, the AdapterManager). A waiting request whose adapter is not resident on the GPU:

    absent/loading ──ensure_loading()──▶ skipped, keeps its place (others go on; the load runs off the loop)
    ready (on CPU) ──activate(in_use)──▶ its copy starts in free GPU memory, or in memory of LRU unpinned
                                    │    adapters no running request uses: skipped until ``is_ready``, then admitted
                                    └──▶ no room (memory held by adapters in use or pinned): the "slot head"
    failed         ──▶ skipped; the engine finishes it with the error

No starvation (slots are granted in queue order): in the step a request first becomes the slot head, younger
requests for adapters already running may still join the batch; from the next step until it has its slot, no
younger request that needs an adapter is admitted (base-model requests still are). Running requests then drain,
their slot frees, and the head takes it: its wait is bounded by the longest remaining generation among running
requests (plus its load).
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from loraplex.engine.kv_cache import PREEMPTION_MODES, KVCacheManager, choose_preemption_mode
from loraplex.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from loraplex.engine.beam_search import BeamSearchState


@dataclass
class SchedulerConfig:
    """Step limits. ``max_loras``: distinct adapters (by identity; None = base, which is free) allowed among
    running requests, or None for no limit. ``preemption_mode``: "recompute", "swap" (when the CPU pool has
    room, else recompute) or "auto" (``kv_cache.swap.choose_preemption_mode``)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    eos_token_ids: list[int] = field(default_factory=list)
    max_loras: int | None = None
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_loras is not None and (isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int)
                                           or self.max_loras < 1):
            raise ValueError(f"max_loras must be None (no limit) or an integer >= 1, got {self.max_loras!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must "
                             f"be >= max_model_len ({self.max_model_len}): a whole prompt goes in one step; "
                             f"raise it or enable chunked prefill")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        self.eos_token_ids = list(self.eos_token_ids)


class AdapterSlots(Protocol):
    """What the scheduler asks of the adapter manager (``loraplex.engine.lora.manager.AdapterManager``)."""

    def slot_of(self, adapter) -> int | None: ...           # resident on the GPU (its copy may be in flight)
    def ensure_loading(self, adapter) -> str: ...           # "ready" (CPU or GPU) | "loading" | "failed"
    def activate(self, adapter, in_use: set) -> int | None: ...  # resident now or copy started; None: no room
    def is_ready(self, adapter) -> bool: ...                # resident and its copy complete (never blocks);
                                                            # optional: absent means activation completes at once


class Scheduler:
    """Decides each step's work; owns the waiting queue, the running list and the swapped queue; asks ``kv``
    for blocks.

    ``can_admit(group) -> bool`` (optional) is consulted before admitting a waiting request, e.g. "is its
    adapter resident"; a request it refuses is skipped this step and keeps its place in the queue.
    ``adapter_slots`` (optional) makes admission load and activate adapters (see the module docstring).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 can_admit: Callable[[SequenceGroup], bool] | None = None,
                 adapter_slots: AdapterSlots | None = None) -> None:
        self.config = config
        self.kv = kv
        self.can_admit = can_admit
        self.adapter_slots = adapter_slots
        self._slot_head: str | None = None  # request id refused a slot in the previous step
        self.waiting: deque[Sequence] = deque()  # a group's waiting sequences stay adjacent
        self.running: list[Sequence] = []  # sorted by (arrival, request order, seq_id): FCFS, victims at the end
        self.swapped: list[SequenceGroup] = []  # swapped-out groups, FCFS
        self._groups: dict[str, SequenceGroup] = {}
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._beam_rows: dict[str, dict[int, Any]] = {}  # request id -> {seq_id: log-prob row} awaiting siblings
        self.num_preemptions = 0
        self.num_swap_outs = 0

    # ---- requests --------------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        """Queue a request. ValueError if it can never run: empty prompt, prompt of ``max_model_len`` tokens or
        more, more blocks than the whole pool (every one of its ``num_sequences`` sequences counted unshared), more
        sequences than ``max_num_seqs``, a request id already in flight, or a group that is not one fresh sequence.
        """
        if group.request_id in self._groups:
            raise ValueError(f"request id {group.request_id!r} is already in flight; use a unique id")
        if len(group.seqs) != 1:
            raise ValueError(f"request {group.request_id!r} has {len(group.seqs)} sequences; add it with one (n > 1 "
                             f"forks from it at the first sampled token)")
        params = group.sampling_params
        seq = group.seqs[0]
        n_prompt = seq.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError(f"request {group.request_id!r} has an empty prompt; give at least one token")
        if n_prompt >= self.config.max_model_len:
            raise ValueError(f"prompt of {n_prompt} tokens leaves no room to generate: it must be shorter than "
                             f"max_model_len={self.config.max_model_len}")
        num_seqs = params.num_sequences
        if num_seqs > self.config.max_num_seqs:
            raise ValueError(f"request {group.request_id!r} runs {num_seqs} sequences (n / best_of / beam_width) "
                             f"but max_num_seqs is {self.config.max_num_seqs}; lower them")
        max_len = min(n_prompt + params.max_tokens, self.config.max_model_len)
        need = num_seqs * self.kv.num_blocks_for(max_len)
        if need > self.kv.num_blocks:
            seqs = f" for {num_seqs} sequences" if num_seqs > 1 else ""
            raise ValueError(f"request needs up to {need} KV blocks ({max_len} tokens{seqs}) but the cache has only "
                             f"{self.kv.num_blocks}; lower max_tokens, n / best_of / beam_width or the prompt length")
        if params.use_beam_search:
            from loraplex.engine.beam_search import BeamSearchState  # torch: only for beam requests

            stops = list(params.stop_token_ids) + ([] if params.ignore_eos else self.config.eos_token_ids)
            BeamSearchState(group, params.beam_width, stop_token_ids=stops,
                            max_new_tokens=max_len - n_prompt, length_penalty=params.length_penalty,
                            early_stopping=params.early_stopping)
        seq.status = SequenceStatus.WAITING
        self._groups[group.request_id] = group
        self._order[group.request_id] = next(self._counter)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Finish a request now, wherever it is, freeing its blocks. False if unknown or already finished."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.kv.free(seq)
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
        if group in self.swapped:
            self.swapped.remove(group)
        self._forget(group)
        group.finished_time = time.monotonic()
        return True

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> SequenceGroup | None:
        """End one running sequence now (the engine matched a stop string): free its blocks. Returns its group
        when that was the group's last unfinished sequence (the group is then finished and forgotten)."""
        group = self._groups.get(seq.request_id)
        if group is None or seq.status.is_finished:
            return None
        if not status.is_finished:
            raise ValueError(f"finish_seq needs a finished status, got {status.name}")
        finished: list[SequenceGroup] = []
        self._finish(seq, group, status, time.monotonic(), finished)
        return finished[0] if finished else None

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating, swapping and copying their blocks."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        # 1. running, FCFS; self.running may shrink from the end while we walk it (preemption of whole groups)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0 or (seq.num_pending_tokens and self._reaches_length_limit(seq)):
                i += 1  # a beam whose log-probs wait for its siblings; a pending token that is the last one
                continue
            hit, n_hit = self._prefix_hit(seq)
            if hit:
                n = min(seq.num_tokens - n_hit, budget)
            while not self.kv.allocate_slots(seq, n, hit):
                victim = self._groups[self.running[-1].request_id]
                budget += self._preempt_group(victim, out)
                if victim.request_id == seq.request_id:
                    break
            else:
                if hit:
                    self.kv.record_prefix_query(seq.num_tokens, n_hit)
                out.scheduled.append(self._scheduled(seq, n))
                budget -= n
                i += 1

        # 2. swapped groups, front first: all of a group's blocks come back, in no step that preempted
        while self.swapped and budget > 0 and not out.preempted:
            group = self.swapped[0]
            seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
            # room for the next tokens too, unless nothing else runs (then the pool is all theirs)
            extra = sum(self.kv.num_blocks_for(s.num_tokens) - self.kv.num_blocks_for(s.num_computed_tokens) + 1
                        for s in seqs) if self.running else 0
            if (self._num_reserved_seqs() + group.sampling_params.num_sequences > cfg.max_num_seqs
                    or not self.kv.can_swap_in(group, extra)
                    or self._admissible(group, self._running_adapters(), False) != "admit"):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.kv.swap_in(group))
            for s in seqs:
                s.status = SequenceStatus.RUNNING
                bisect.insort(self.running, s, key=self._priority)
                n = min(s.num_tokens - s.num_computed_tokens, budget)
                if n > 0 and self.kv.allocate_slots(s, n):  # else: the running pass of a later step asks again
                    out.scheduled.append(self._scheduled(s, n))
                    budget -= n

        # 3. waiting, front first; no admission in a step that had to preempt, nor while groups are swapped out
        skipped: list[Sequence] = []
        adapters = self._running_adapters()
        slot_head: str | None = None   # this step's oldest request refused a slot
        barrier = False                # it was refused last step too: slots go to it first
        while (self.waiting and budget > 0 and not out.preempted and not self.swapped
               and self._num_reserved_seqs() < cfg.max_num_seqs):
            seq = self.waiting[0]
            group = self._groups[seq.request_id]
            if self._num_reserved_seqs() + group.sampling_params.num_sequences > cfg.max_num_seqs:
                break
            verdict = self._admissible(group, adapters, barrier)
            if verdict != "admit":
                if verdict == "no_slot" and slot_head is None:
                    slot_head = group.request_id
                    barrier = slot_head == self._slot_head
                while self.waiting and self.waiting[0].request_id == group.request_id:
                    skipped.append(self.waiting.popleft())
                continue
            admitted = self._admit_group(group, budget, out)
            if admitted is None:
                break
            budget -= admitted
            if group.adapter is not None and group.adapter not in adapters:
                adapters.append(group.adapter)
        self.waiting.extendleft(reversed(skipped))
        if not out.preempted:  # a preempting step admits nobody: the head keeps its standing
            self._slot_head = slot_head

        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]],
               logprobs: dict[int, list] | None = None,
               beam_logprobs: dict[int, Any] | None = None) -> list[SequenceGroup]:
        """Apply a finished step: advance computed tokens, cache full blocks, append sampled tokens (by seq_id;
        a list of ``num_samples`` tokens at a fork step: the parent takes the first, a forked child each other),
        step beam searches whose beams all have their log-prob rows, stop finished sequences and free their
        blocks. ``logprobs[seq_id]``: entries (``TokenLogprob`` or None) parallel to the sampled tokens; their
        logprob accumulates into ``cumulative_logprob``. Returns the requests that finished in this step."""
        finished: list[SequenceGroup] = []
        now = time.monotonic()
        logprobs = logprobs or {}
        beam_groups: list[SequenceGroup] = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted, finished or preempted since schedule()
                continue
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(seq)
            if not s.sample:
                continue
            group = self._groups[seq.request_id]
            if group.first_token_time is None:
                group.first_token_time = now
            if s.beam:
                rows = self._beam_rows.setdefault(group.request_id, {})
                rows[seq.seq_id] = beam_logprobs[seq.seq_id]
                if group not in beam_groups:
                    beam_groups.append(group)
                continue
            tokens = sampled[seq.seq_id]
            tokens = tokens if isinstance(tokens, list) else [tokens]
            entries = logprobs.get(seq.seq_id) or [None] * len(tokens)
            children = [seq.fork() for _ in tokens[1:]]  # forks share every block (copy-on-write later)
            for child in children:
                self.kv.fork(seq, child)
                group.add_seq(child)
                bisect.insort(self.running, child, key=self._priority)
            for target, token, entry in zip([seq] + children, tokens, entries):
                target.append_token(token, entry.logprob if entry is not None else 0.0)
                status = self._stop_status(target, group, token)
                if status is not None:
                    self._finish(target, group, status, now, finished)
        for group in beam_groups:
            self._beam_step(group, now, finished)
        return finished

    # ---- overlapped steps (engine/step_pipeline.py) -----------------------------------------------------
    def update_launched(self, out: SchedulerOutput) -> None:
        """An overlapped decode step was launched: each of its still-running sequences has its input token
        computed (stream order makes that true for every later step) and gains a pending token (its sampled
        token, value still on the device). Sequences that finished since ``schedule()`` are left alone: their
        row of the step is discarded. Call once the previous step's pending tokens are resolved, so the full
        blocks hashed here hold real tokens only."""
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if s.num_new_tokens != 1 or not s.sample or s.num_samples != 1 or s.beam or seq.num_pending_tokens:
                raise ValueError(f"sequence {seq.seq_id} is not a plain decode with a known input token; it "
                                 f"cannot be overlapped")
            seq.num_computed_tokens += 1
            self.kv.cache_full_blocks(seq)
            seq.append_pending_token()

    def update_resolved(self, out: SchedulerOutput, sampled: dict[int, int]) -> tuple[list[Sequence],
                                                                                      list[SequenceGroup]]:
        """The pending tokens of an overlapped step arrived (``sampled``: seq_id -> token): write them in, then
        stop checks as in ``update``. A sequence may have been preempted since (waiting or swapped out): it
        finishes from there. Aborted sequences drop their token. Returns (sequences whose token counts, the
        requests that finished)."""
        finished: list[SequenceGroup] = []
        accepted: list[Sequence] = []
        now = time.monotonic()
        for s in out.scheduled:
            seq = s.seq
            if not seq.num_pending_tokens:
                continue  # finished before the step's launch was recorded: its row is discarded
            token = sampled[seq.seq_id]
            seq.resolve_pending_token(token)
            group = self._groups.get(seq.request_id)
            if group is None or seq.status.is_finished:
                continue  # aborted while the step ran
            accepted.append(seq)
            if group.first_token_time is None:
                group.first_token_time = now
            status = self._stop_status(seq, group, token)
            if status is not None:
                self._finish(seq, group, status, now, finished)
        return accepted, finished

    # ---- helpers ---------------------------------------------------------------------------------------
    def _finish(self, seq: Sequence, group: SequenceGroup, status: SequenceStatus, now: float,
                finished: list[SequenceGroup]) -> None:
        """End ``seq`` wherever it is: running, or (a pending token resolved after a preemption) waiting for
        recompute or swapped out."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if group.is_finished():
            if group in self.swapped:
                self.swapped.remove(group)
            group.finished_time = now
            self._forget(group)
            finished.append(group)

    def _beam_step(self, group: SequenceGroup, now: float, finished: list[SequenceGroup]) -> None:
        state: BeamSearchState = group.beam_search  # type: ignore[assignment]
        rows = self._beam_rows.get(group.request_id, {})
        if any(s.seq_id not in rows for s in state.running):
            return  # a sibling is still computing (chunked recompute); step once all rows are in
        result = state.step_rows([rows[s.seq_id] for s in state.running], self.kv)
        self._beam_rows.pop(group.request_id, None)
        for s in result.freed:
            if s in self.running:
                self.running.remove(s)
        for s in result.forked:
            bisect.insort(self.running, s, key=self._priority)
        if result.done:
            group.finished_time = now
            self._forget(group)
            finished.append(group)

    def _forget(self, group: SequenceGroup) -> None:
        self._groups.pop(group.request_id, None)
        self._order.pop(group.request_id, None)
        self._beam_rows.pop(group.request_id, None)

    def _stop_status(self, seq: Sequence, group: SequenceGroup, token: int) -> SequenceStatus | None:
        params = group.sampling_params
        if not params.ignore_eos and token in self.config.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if self._reaches_length_limit(seq):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _reaches_length_limit(self, seq: Sequence) -> bool:
        """``max_tokens`` or ``max_model_len`` reached (by count: a pending token counts)."""
        params = self._groups[seq.request_id].sampling_params
        return seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len

    def _prefix_hit(self, seq: Sequence) -> tuple[list[int], int]:
        """A prefix hit for a sequence that has no blocks yet (a recomputed forked sequence finds the prompt
        blocks a sibling computed); none for requests that want prompt logprobs (they need every position)."""
        if seq.block_ids or seq.num_computed_tokens or self._groups[seq.request_id].sampling_params.prompt_logprobs \
                is not None:
            return [], 0
        return self.kv.get_computed_blocks(seq, record=False)

    def _admit_group(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int | None:
        """Move the group's waiting sequences (adjacent at the queue's front) to running, scheduling as many as
        the budget allows; the first must get blocks, else nothing changes and None is returned. Returns the
        tokens scheduled."""
        seqs: list[Sequence] = []
        while len(seqs) < len(self.waiting) and self.waiting[len(seqs)].request_id == group.request_id:
            seqs.append(self.waiting[len(seqs)])
        used = 0
        for k, seq in enumerate(seqs):
            hit_blocks, n_hit = self._prefix_hit(seq)
            n = seq.num_tokens - n_hit
            if n > budget - used:
                if not self.config.enable_chunked_prefill:
                    if k == 0:
                        return None
                    break
                n = budget - used
            if n <= 0 or not self.kv.allocate_slots(seq, n, hit_blocks):
                if k == 0:
                    return None
                break  # the rest of the group joins running without blocks: later steps schedule it
            self.kv.record_prefix_query(seq.num_tokens, n_hit)
            out.scheduled.append(self._scheduled(seq, n))
            used += n
        for seq in seqs:
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._priority)
        return used

    def _preempt_group(self, group: SequenceGroup, out: SchedulerOutput) -> int:
        """Preempt every unfinished sequence of ``group`` (the latest arrival among running groups): swap its
        blocks to the CPU pool, or drop them for recompute. Entries of the group already scheduled in this step
        are withdrawn; returns their tokens (back into the budget)."""
        seqs = [s for s in self.running if s.request_id == group.request_id]
        refund = sum(s.num_new_tokens for s in out.scheduled if s.seq.request_id == group.request_id)
        out.scheduled = [s for s in out.scheduled if s.seq.request_id != group.request_id]
        for s in seqs:
            self.running.remove(s)
        mode = choose_preemption_mode(self.config.preemption_mode, num_seqs=len(seqs),
                                      num_computed_tokens=sum(s.num_computed_tokens for s in seqs),
                                      can_swap_out=self.kv.can_swap_out(group))
        if mode == "swap":
            out.blocks_to_swap_out.extend(self.kv.swap_out(group))
            for s in seqs:
                s.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=lambda g: self._group_priority(g.request_id))
            self.num_swap_outs += 1
        else:
            for s in reversed(seqs):
                self.kv.free(s)
                s.num_computed_tokens = 0
                s.status = SequenceStatus.WAITING
                self.waiting.appendleft(s)
            self._beam_rows.pop(group.request_id, None)
        out.preempted.append(group.request_id)
        self.num_preemptions += 1
        return refund

    def _group_priority(self, request_id: str) -> tuple[float, int]:
        return (self._groups[request_id].arrival_time, self._order[request_id])

    def _priority(self, seq: Sequence) -> tuple[float, int, int]:
        return (*self._group_priority(seq.request_id), seq.seq_id)

    def _num_reserved_seqs(self) -> int:
        """Sequence slots held by running groups: each reserves its ``num_sequences`` (forks come later)."""
        ids = {s.request_id for s in self.running}
        return sum(self._groups[r].sampling_params.num_sequences for r in ids)

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSequence:
        group = self._groups[seq.request_id]
        params = group.sampling_params
        sample = seq.num_computed_tokens + n == seq.num_tokens
        beam = params.use_beam_search
        fork = (not beam and params.num_sequences > 1 and len(group.seqs) == 1 and seq.num_output_tokens == 0)
        covers_prompt = params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens - 1
        return ScheduledSequence(seq=seq, num_new_tokens=n, block_ids=list(seq.block_ids), sample=sample,
                                 num_samples=params.num_sequences if fork and sample else 1, beam=beam,
                                 prompt_logprobs=params.prompt_logprobs if covers_prompt else None)

    def _running_adapters(self) -> list[object]:
        """Adapters of running and swapped-out requests (a swapped group keeps its slot for its return)."""
        adapters: list[object] = []
        groups = [self._groups[s.request_id] for s in self.running] + self.swapped
        for g in groups:
            a = g.adapter
            if a is not None and a not in adapters:  # equality: two equal AdapterRefs are one adapter
                adapters.append(a)
        return adapters

    def _admissible(self, group: SequenceGroup, adapters: list[object], barrier: bool) -> str:
        """"admit", "wait" (not now: its adapter is loading from disk or still being copied to the GPU; skipped,
        it keeps its place) or "no_slot" (its adapter is on CPU but GPU memory cannot be made for it now: every
        byte is held by adapters in use or pinned). Starting an adapter's copy to the GPU happens here; a copy in
        flight never holds back requests behind it whose adapters are resident."""
        if self.can_admit is not None and not self.can_admit(group):
            return "wait"
        a, gate = group.adapter, self.adapter_slots
        if a is None:
            return "admit"
        running = a in adapters
        if barrier:
            if gate is not None and not running and gate.slot_of(a) is None:
                gate.ensure_loading(a)  # prefetch while it waits its turn
            return "wait"
        if not running and self.config.max_loras is not None and len(adapters) >= self.config.max_loras:
            if gate is not None and gate.slot_of(a) is None and gate.ensure_loading(a) != "ready":
                return "wait"
            return "no_slot"
        if gate is None:
            return "admit"
        if not running and gate.slot_of(a) is None and gate.ensure_loading(a) != "ready":
            return "wait"
        # a hit for a resident adapter (running ones always are), else its copy into free or evictable memory
        if gate.activate(a, set(adapters)) is None:
            return "wait" if gate.ensure_loading(a) == "failed" else "no_slot"  # failed: the engine ends it
        ready = getattr(gate, "is_ready", None)  # optional: a manager whose activation completes at once omits it
        return "admit" if ready is None or ready(a) else "wait"
