"""Continuous batching in the vLLM-v1 manner: no prefill and decode phases, only ``num_computed_tokens``.

Every step takes, under one token budget (``max_num_batched_tokens``) and ``max_num_seqs``:

    1. running sequences in FCFS (arrival) order: a decode gets 1 token, an unfinished prefill a chunk;
       out of blocks -> preempt the latest-arrived running sequence by recompute (it may be the asker itself)
    2. then waiting ones, front first (prefix hit first), while the budget lasts and nothing was preempted;
       with ``max_loras`` set, admission keeps the running set within that many distinct adapters

    waiting (deque) --admit--> running (sorted by arrival) --update: stop/length--> finished, blocks freed
        ^                            |
        +---- preempt (front) -------+   blocks freed, num_computed_tokens = 0, outputs kept

Chunked prefill is nothing but scheduling fewer tokens than ``num_tokens - num_computed_tokens``.

Adapters (``adapter_slots``, the AdapterManager). A waiting request whose adapter is not in a GPU slot:

    absent/loading ──ensure_loading()──▶ skipped, keeps its place (others go on; the load runs off the loop)
    ready (on CPU) ──activate(in_use)──▶ a free slot, or the LRU unpinned slot no running request uses: admitted
                                    └──▶ no slot: it is the "slot head"
    failed         ──▶ skipped; the engine finishes it with the error

No starvation (slots are granted in queue order): in the step a request first becomes the slot head, younger
requests for adapters already running may still join the batch; from the next step until it has its slot, no
younger request that needs an adapter is admitted (base-model requests still are). Running requests then drain,
their slot frees, and the head takes it: its wait is bounded by the longest remaining generation among running
requests (plus its load).
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SchedulerConfig:
    """Step limits. ``max_loras``: distinct adapters (by identity; None = base, which is free) allowed among
    running requests, or None for no limit."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    eos_token_ids: list[int] = field(default_factory=list)
    max_loras: int | None = None

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
        self.eos_token_ids = list(self.eos_token_ids)


class AdapterSlots(Protocol):
    """What the scheduler asks of the adapter manager (``loraplex.engine.lora.manager.AdapterManager``)."""

    def slot_of(self, adapter) -> int | None: ...
    def ensure_loading(self, adapter) -> str: ...           # "ready" | "loading" | "failed"
    def activate(self, adapter, in_use: set) -> int | None: ...


class Scheduler:
    """Decides each step's work; owns the waiting queue and running list; asks ``kv`` for blocks.

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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by (arrival_time, seq_id): FCFS order, victims at the end
        self._groups: dict[str, SequenceGroup] = {}
        self.num_preemptions = 0

    # ---- requests --------------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        """Queue a request. ValueError if it can never run: empty prompt, prompt of ``max_model_len`` tokens or
        more, more blocks than the whole pool, a request id already in flight, or n != 1."""
        if group.request_id in self._groups:
            raise ValueError(f"request id {group.request_id!r} is already in flight; use a unique id")
        if len(group.seqs) != 1:
            raise ValueError(f"request {group.request_id!r} has {len(group.seqs)} sequences; only 1 is supported")
        seq = group.seqs[0]
        n_prompt = seq.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError(f"request {group.request_id!r} has an empty prompt; give at least one token")
        if n_prompt >= self.config.max_model_len:
            raise ValueError(f"prompt of {n_prompt} tokens leaves no room to generate: it must be shorter than "
                             f"max_model_len={self.config.max_model_len}")
        max_len = min(n_prompt + group.sampling_params.max_tokens, self.config.max_model_len)
        need = self.kv.num_blocks_for(max_len)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks ({max_len} tokens) but the cache has only "
                             f"{self.kv.num_blocks}; lower max_tokens or the prompt length")
        seq.status = SequenceStatus.WAITING
        self._groups[group.request_id] = group
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Finish a request now, wherever it is, freeing its blocks. False if unknown or already finished."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.kv.free(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
        group.finished_time = time.monotonic()
        return True

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their blocks."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        # 1. running, FCFS; self.running may shrink from the end while we walk it (preemption)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()  # latest arrival: never one already scheduled (those are < i)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, n))
                budget -= n
                i += 1

        # 2. waiting, front first; no admission in a step that had to preempt
        skipped: list[Sequence] = []
        adapters = self._running_adapters()
        slot_head: str | None = None   # this step's oldest request refused a slot
        barrier = False                # it was refused last step too: slots go to it first
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            group = self._groups[seq.request_id]
            verdict = self._admissible(group, adapters, barrier)
            if verdict != "admit":
                if verdict == "no_slot" and slot_head is None:
                    slot_head = group.request_id
                    barrier = slot_head == self._slot_head
                skipped.append(self.waiting.popleft())
                continue
            hit_blocks, n_hit = self.kv.get_computed_blocks(seq, record=False)
            n = seq.num_tokens - n_hit
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            if not self.kv.allocate_slots(seq, n, hit_blocks):
                break
            self.kv.record_prefix_query(seq.num_tokens, n_hit)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._priority)
            if group.adapter is not None and group.adapter not in adapters:
                adapters.append(group.adapter)
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if not out.preempted:  # a preempting step admits nobody: the head keeps its standing
            self._slot_head = slot_head

        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[SequenceGroup]:
        """Apply a finished step: advance computed tokens, cache full blocks, append sampled tokens (by seq_id),
        stop finished sequences and free their blocks. Returns the requests that finished in this step."""
        finished: list[SequenceGroup] = []
        now = time.monotonic()
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted since schedule()
                continue
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(seq)
            if not s.sample:
                continue
            group = self._groups[seq.request_id]
            token = sampled[seq.seq_id]
            seq.append_token(token)
            if group.first_token_time is None:
                group.first_token_time = now
            status = self._stop_status(seq, group, token)
            if status is None:
                continue
            seq.status = status
            self.running.remove(seq)
            self.kv.free(seq)
            if group.is_finished():
                group.finished_time = now
                del self._groups[group.request_id]
                finished.append(group)
        return finished

    # ---- helpers ---------------------------------------------------------------------------------------
    def _stop_status(self, seq: Sequence, group: SequenceGroup, token: int) -> SequenceStatus | None:
        params = group.sampling_params
        if not params.ignore_eos and token in self.config.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its K/V, keep its tokens, back to the front of the queue."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _priority(self, seq: Sequence) -> tuple[float, int]:
        return (self._groups[seq.request_id].arrival_time, seq.seq_id)

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSequence:
        return ScheduledSequence(seq=seq, num_new_tokens=n, block_ids=list(seq.block_ids),
                                 sample=seq.num_computed_tokens + n == seq.num_tokens)

    def _running_adapters(self) -> list[object]:
        adapters: list[object] = []
        for seq in self.running:
            a = self._groups[seq.request_id].adapter
            if a is not None and a not in adapters:  # equality: two equal AdapterRefs are one adapter
                adapters.append(a)
        return adapters

    def _admissible(self, group: SequenceGroup, adapters: list[object], barrier: bool) -> str:
        """"admit", "wait" (not now; e.g. its adapter is loading) or "no_slot" (its adapter is ready but no
        slot can be had). Activating an adapter into a slot happens here."""
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
        # a slot hit for a resident adapter (running ones always are), else a load into a free/evictable slot
        return "admit" if gate.activate(a, set(adapters)) is not None else "no_slot"
