"""Continuous batching in the vLLM-v1 manner: no prefill and decode phases, only ``num_computed_tokens``.

Every step takes, under one token budget (``max_num_batched_tokens``) and ``max_num_seqs``:

    1. running sequences in FCFS (arrival) order: a decode gets 1 token, an unfinished prefill a chunk;
       out of blocks -> preempt a running *group* (all its sequences; it may be the asker's own): by swapping
       its blocks to the CPU pool or by recompute (``preemption_mode``)
    2. then swapped groups, front first, all of a group's blocks at once, unless this step preempted
    3. then waiting ones, front first (prefix hit first), while the budget lasts, nothing was preempted and no
       group is swapped out; with ``max_loras`` set, admission keeps the running set within that many adapters

    waiting (per tenant) --admit--> running (sorted by arrival) --update: stop/length--> finished, blocks freed
        ^                             |   ^     |
        +--- preempt: recompute ------+   |     +-- preempt: swap --> swapped --swap in (whole group)--+
             blocks freed, num_computed_tokens = 0, outputs kept  +------------------------------------+

Policies (``SchedulerConfig.policy``). "fcfs": the steps above in arrival order; the victim of a preemption is
the latest-arrived running group. "vtc" (the default): tenant-fair, by the virtual token counters of
engine/fairness.py (each tenant's weighted service over its weight). While one tenant is active it schedules
exactly as FCFS. With several:

    1. running sequences that decode (one token left) in FCFS order (smallest tenant counter first when the
       budget cannot hold them all and ``vtc_preempt_gap`` is set); prefill chunks wait for step 3
    2. swapped groups, smallest tenant counter first
    3. prefill work shared between tenants: repeatedly the tenant with the smallest counter (plus this step's
       service to it: one output token per decode entry of step 1, the prompt tokens given in this pass) takes
       its next item, its oldest running prefill chunk first, then
       its oldest waiting request, as much of it as the budget allows; a tenant whose request cannot be
       admitted for lack of blocks stops admission for the step (running prefills go on)
    victim of a preemption: the latest running group of the tenant with the largest counter (ties: the
    latest arrival), never simply the latest arrival

Slot and budget yields (``vtc_preempt_gap``, default engine/fairness.py DEFAULT_PREEMPT_GAP; None: off). A
waiting request of tenant A that lacks sequence slots takes them from running groups of other tenants
(engine/slot_yield.py: largest counter first, each tenant's latest groups first, whole groups, never a group
admitted or swapped in during the step, all or nothing) by one of two rules. Share rule, when A holds no slot
and asks at most its weighted share of ``max_num_seqs`` among the active tenants: from tenants at or above A's
counter (no gap) that hold more than their share in whole slots. Gap rule, otherwise: from tenants whose counter
exceeds A's by more than the gap, while the victim keeps at least A's slots over weight after the move (or A has
none running and the victim more than A will). They are preempted by recompute whatever
``preemption_mode`` says: their full blocks stay in the prefix cache, so resuming is mostly prefix hits, and a
swapped group would hold back admission. A waiting request that would get none of its prompt (budget spent;
without chunked prefill, too little for the whole prompt) takes this step's decode entries of tenants more than
the gap above it instead, or, under the share rule and while no prefill work got tokens in this step (the decodes
alone fill it), of tenants at or above it: they stay running and decode in the next step. Otherwise the request
stops admission, as before. Never under "fcfs" nor with one active tenant, so both keep their schedules exactly.

    slots: H H H H H H H H   (heavy, n=8: two n=4 groups, counter 90)   light (counter 90, arrived, holds none)
           -> share 8 * 1 / 2 = 4 each: heavy's latest group yields by recompute; light is admitted in the same
              step, the schedule() right after its arrival (step 3 ranks heavy, 8 decodes this step, behind it)

A yield decided while an overlapped step is in flight takes effect in the step being scheduled: the yielding
sequences' pending tokens resolve into them where they are then (waiting, for recompute), and the admitted
prompt makes the step not overlappable, so the engine resolves the step in flight before running it.

Progress under "vtc". Order running groups by key = (tenant counter, arrival). A preemption takes the group of
largest key, so the group of smallest key is never taken by another's ask, and with the pool to itself it
always fits (``add`` refuses requests that could not). Counters rise only with first-time service (a token is
charged once: recomputing a preempted prompt or swapping back in charges nothing), and every request's service
is finite, so the system cannot go round in preemptions without finishing work:

    key ->   A(c=90)  B(c=40)  C(c=40, later)         C asks for a block: victim = A (largest counter)
             [ ....victim ]    [ never taken while its key is smallest: runs, its counter rises ]

Gap-rule yields keep this: a group yields only to a tenant more than the gap below its own, so the group of
smallest key never yields, and recompute charges nothing, so the counters still rise only with first-time
service. A share-rule yield goes to a tenant that holds nothing, at or below the victim's counter, and admits its
request within its share, after which that request is no share-rule victim while the active tenants stay the
same (engine/slot_yield.py); a tenant gets slots this way only up to its share, so the yields stop once every
tenant holding nothing has its request in or nobody holds more than its share.

Admission cannot starve a request R of tenant T either: T's counter does not grow while R waits (only T's
running requests, which finish, charge it); every other tenant served grows; a newcomer is lifted to the
smallest active counter and loses ties to older arrivals. So T's counter becomes the smallest, R leads the
admission order, and while R does not fit nothing else is admitted: running requests drain until it does.

A request with ``num_sequences > 1`` enters as one sequence. At its first sampled step the runner draws
``num_sequences`` tokens from the one logits row and ``update`` forks the children, which share every block
(copy-on-write on the next write). A beam-search request's beams step together once each has its log-prob row
(``BeamSearchState``): forks join the running list, pruned beams leave it. Every sequence counts against
``max_num_seqs`` and its tokens against its tenant's counter.

Chunked prefill is nothing but scheduling fewer tokens than ``num_tokens - num_computed_tokens``.

Speculative decoding (engine/spec_decode/): a decode whose sequence carries drafts (``spec_token_ids``) is scheduled
with 1 + k tokens, k cut to the budget and dropped altogether when the pool lacks their blocks (speculation never
preempts). ``update`` appends the accepted drafts and the target's token with the stop checks after each, counts
their K/V as computed (accepted tokens only, so only they reach the prefix cache) and releases the trailing blocks
that held rejected drafts (``KVCacheManager.trim``); each appended token is charged to the tenant once.

Overlapped decode steps (engine/step_pipeline.py): ``update_launched`` gives each sequence of a launched step a
pending token (counted, value on the device), so ``schedule()`` plans the next step before the values arrive;
a sequence whose pending token reaches ``max_tokens`` / ``max_model_len`` is not scheduled again (it finishes
when the value arrives). ``update_resolved`` writes the values in and runs the stop checks, finishing a
sequence wherever it is by then (running, or preempted meanwhile: waiting or swapped). A pending token is
charged to its tenant when it resolves, never at launch.

Adapters (``adapter_slots``, the AdapterManager). A waiting request whose adapter is not resident on the GPU:

    absent/loading ──ensure_loading()──▶ skipped, keeps its place (others go on; the load runs off the loop)
    ready (on CPU) ──activate(in_use)──▶ its copy starts in free GPU memory, or in memory of LRU unpinned
                                    │    adapters no running request uses: skipped until ``is_ready``, then admitted
                                    └──▶ no room (memory held by adapters in use or pinned): the "slot head"
    failed         ──▶ skipped; the engine finishes it with the error

No starvation (slots are granted in admission order): in the step a request first becomes the slot head,
later requests for adapters already running may still join the batch; from the next step until it has its
slot, no later request that needs an adapter is admitted (base-model requests still are). Running requests
then drain, their slot frees, and the head takes it: its wait is bounded by the longest remaining generation
among running requests (plus its load). The policy decides the order; ``_admissible`` decides residency.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from loraplex.engine.fairness import (DEFAULT_INPUT_WEIGHT, DEFAULT_OUTPUT_WEIGHT, DEFAULT_PREEMPT_GAP, TenantHeap,
                                      VirtualTokenCounters, check_cost_weight, check_preempt_gap)
from loraplex.engine.kv_cache import PREEMPTION_MODES, KVCacheManager, choose_preemption_mode
from loraplex.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from loraplex.engine.slot_yield import SlotYield, far_enough
from loraplex.engine.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from loraplex.engine.beam_search import BeamSearchState

POLICIES = ("fcfs", "vtc")


@dataclass
class SchedulerConfig:
    """Step limits. ``max_loras``: distinct adapters (by identity; None = base, which is free) allowed among
    running requests, or None for no limit. ``preemption_mode``: "recompute", "swap" (when the CPU pool has
    room, else recompute) or "auto" (``kv_cache.swap.choose_preemption_mode``).

    ``policy``: "vtc" (tenant-fair, the default) or "fcfs" (module docstring). ``vtc_input_weight`` /
    ``vtc_output_weight``: what a prompt token and an output token add to their tenant's counter (before the
    division by the tenant's weight); the default 1 : 2 prices an output token at two prompt tokens.
    ``vtc_preempt_gap``: how far (in counter units) a tenant's counter must exceed a waiting tenant's before its
    running groups yield sequence slots to that tenant's request (engine/slot_yield.py); None: never."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    eos_token_ids: list[int] = field(default_factory=list)
    max_loras: int | None = None
    preemption_mode: str = "recompute"
    policy: str = "vtc"
    vtc_input_weight: float = DEFAULT_INPUT_WEIGHT
    vtc_output_weight: float = DEFAULT_OUTPUT_WEIGHT
    vtc_preempt_gap: float | None = DEFAULT_PREEMPT_GAP

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
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check_cost_weight("vtc_input_weight", self.vtc_input_weight)
        check_cost_weight("vtc_output_weight", self.vtc_output_weight)
        check_preempt_gap(self.vtc_preempt_gap)
        self.eos_token_ids = list(self.eos_token_ids)


class AdapterSlots(Protocol):
    """What the scheduler asks of the adapter manager (``loraplex.engine.lora.manager.AdapterManager``)."""

    def slot_of(self, adapter) -> int | None: ...           # resident on the GPU (its copy may be in flight)
    def ensure_loading(self, adapter) -> str: ...           # "ready" (CPU or GPU) | "loading" | "failed"
    def activate(self, adapter, in_use: set) -> int | None: ...  # resident now or copy started; None: no room
    def is_ready(self, adapter) -> bool: ...                # resident and its copy complete (never blocks);
                                                            # optional: absent means activation completes at once


class Scheduler:
    """Decides each step's work; owns the waiting queues, the running list and the swapped list; asks ``kv``
    for blocks.

    ``can_admit(group) -> bool`` (optional) is consulted before admitting a waiting request, e.g. "is its
    adapter resident"; a request it refuses is skipped this step and keeps its place in the queue.
    ``adapter_slots`` (optional) makes admission load and activate adapters (see the module docstring).
    ``counters`` (policy "vtc") holds the tenants' virtual token counters.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 can_admit: Callable[[SequenceGroup], bool] | None = None,
                 adapter_slots: AdapterSlots | None = None) -> None:
        self.config = config
        self.kv = kv
        self.can_admit = can_admit
        self.adapter_slots = adapter_slots
        self._slot_head: str | None = None  # request id refused a slot in the previous step
        self.waiting = WaitingQueue()  # per tenant ("vtc") or one queue ("fcfs"); a group's sequences adjacent
        self.running: list[Sequence] = []  # sorted by (arrival, request order, seq_id): FCFS
        self.swapped: list[SequenceGroup] = []  # swapped-out groups, FCFS
        self._groups: dict[str, SequenceGroup] = {}
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._beam_rows: dict[str, dict[int, Any]] = {}  # request id -> {seq_id: log-prob row} awaiting siblings
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_slot_preemptions = 0  # groups that yielded sequence slots to a tenant below them (fair policy)
        self.num_budget_yields = 0  # decode entries withdrawn for a step's budget, for a tenant below them
        self._fresh: set[str] = set()  # request ids admitted or swapped in during the current step
        self._ceiling: float | None = None  # the largest active counter, once per step (schedule() charges nothing)
        self.counters: VirtualTokenCounters | None = None
        self._tenant_heap: TenantHeap | None = None  # tenants with waiting requests, smallest counter first
        if config.policy == "vtc":
            self.counters = VirtualTokenCounters(config.vtc_input_weight, config.vtc_output_weight)
            self._tenant_heap = TenantHeap(self._waiting_rank)
            self.waiting.on_head = self._tenant_heap.push

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
            field = _widest_field(params)
            raise ValueError(f"{field}={num_seqs} asks for {num_seqs} sequences (n / best_of / beam_width) but this "
                             f"engine runs at most max_num_seqs={self.config.max_num_seqs} at once; lower {field}")
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
        if self.counters is not None:
            group.tenant_state = self.counters.activate(group.tenant, group.weight)
        self.waiting.append(self._key(group), seq)

    def abort(self, request_id: str) -> bool:
        """Finish a request now, wherever it is, freeing its blocks. False if unknown or already finished."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        key = self._key(group)
        for seq in group.seqs:
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(key, seq)
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

    def tenant_loads(self) -> dict[Hashable, dict[str, int]]:
        """Per tenant: unfinished ``requests`` and ``running`` / ``waiting`` / ``swapped`` sequences. Reads copies
        of the lists, so another thread may call it (engine_stats does)."""
        groups = self._groups.copy()
        loads: dict[Hashable, dict[str, int]] = {}

        def load(tenant: Hashable) -> dict[str, int]:
            entry = loads.get(tenant)
            if entry is None:
                loads[tenant] = entry = {"requests": 0, "running": 0, "waiting": 0, "swapped": 0}
            return entry

        for group in groups.values():
            load(group.tenant)["requests"] += 1
        for state, seqs in (("running", list(self.running)), ("waiting", self.waiting.snapshot())):
            for seq in seqs:
                group = groups.get(seq.request_id)
                if group is not None:
                    load(group.tenant)[state] += 1
        for group in list(self.swapped):
            load(group.tenant)["swapped"] += sum(s.status is SequenceStatus.SWAPPED for s in list(group.seqs))
        return loads

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating, swapping and copying their blocks."""
        cfg = self.config
        out = SchedulerOutput()
        self._fresh.clear()
        self._ceiling = None
        fair = self.counters is not None and self.counters.num_active > 1
        prefills: list[Sequence] | None = [] if fair else None
        budget = self._schedule_running(out, cfg.max_num_batched_tokens, prefills)
        budget = self._schedule_swapped(out, budget, fair)
        if fair:
            budget = self._schedule_shared(out, budget, prefills)
        else:
            budget = self._admit_in_order(out, budget)
        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefills: list[Sequence] | None) -> int:
        """1. Running sequences in FCFS order. With ``prefills`` (the fair policy), sequences with more than one
        token left are collected there instead, for the shared pass; and with ``vtc_preempt_gap`` set, decodes
        that need more than the budget go smallest tenant counter first (ties: arrival), so a tenant far ahead
        is the one whose decodes wait a step."""
        if prefills is not None and self.config.vtc_preempt_gap is not None:
            decodes = self._split_running(prefills)
            if sum(1 + len(s.spec_token_ids) for s in decodes) > budget:
                decodes.sort(key=lambda s: (self._groups[s.request_id].tenant_state.counter, self._priority(s)))
            return self._schedule_decodes(out, budget, decodes)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = seq.num_tokens - seq.num_computed_tokens
            if left == 0 or (seq.num_pending_tokens and self._reaches_length_limit(seq)):
                i += 1  # a beam whose log-probs wait for its siblings; a pending token that is the last one
                continue
            if prefills is not None and left > 1:
                prefills.append(seq)
                i += 1
                continue
            used, refund, preempted = self._schedule_seq(seq, budget, out)
            budget += refund - used
            # preemption may take groups anywhere in the list (the fair policy's victims): go on after seq
            i = bisect.bisect_right(self.running, self._priority(seq), key=self._priority) if preempted else i + 1
        return budget

    def _split_running(self, prefills: list[Sequence]) -> list[Sequence]:
        """Running sequences to schedule, FCFS: those with more than one token left into ``prefills``, the decodes
        returned (skipped: a beam waiting for its siblings' rows, a pending token that is the last one)."""
        decodes = []
        for seq in self.running:
            left = seq.num_tokens - seq.num_computed_tokens
            if left == 0 or (seq.num_pending_tokens and self._reaches_length_limit(seq)):
                continue
            (prefills if left > 1 else decodes).append(seq)
        return decodes

    def _schedule_decodes(self, out: SchedulerOutput, budget: int, decodes: list[Sequence]) -> int:
        """Schedule ``decodes`` in their order while the budget lasts, preempting for blocks as the FCFS pass does
        (a victim's sequences later in the list are skipped, its entries earlier in it withdrawn)."""
        for seq in decodes:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for another's blocks in this step
            used, refund, _ = self._schedule_seq(seq, budget, out)
            budget += refund - used
        return budget

    def _schedule_seq(self, seq: Sequence, budget: int, out: SchedulerOutput) -> tuple[int, int, bool]:
        """Schedule up to ``budget`` tokens of running ``seq`` (after its prefix hit, if any), preempting groups
        while the pool lacks blocks (seq's own group last of all, then nothing is scheduled). Returns (tokens
        scheduled, tokens refunded by withdrawn entries of preempted groups, whether anything was preempted)."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        hit, n_hit = self._prefix_hit(seq)
        if hit:
            n = min(seq.num_tokens - n_hit, budget)
        refund, preempted = 0, False
        k = self._num_drafts(seq, n, budget)
        if k and not self.kv.allocate_slots(seq, n + k):
            k = 0  # speculation never preempts: without room for its drafts the decode runs alone
        while not k and not self.kv.allocate_slots(seq, n, hit):
            victim = self._victim()
            refund += self._preempt_group(victim, out)
            preempted = True
            if victim.request_id == seq.request_id:
                return 0, refund, True
        if hit:
            self.kv.record_prefix_query(seq.num_tokens, n_hit)
        out.scheduled.append(self._scheduled(seq, n, k))
        return n + k, refund, preempted

    @staticmethod
    def _num_drafts(seq: Sequence, n: int, budget: int) -> int:
        """Speculative drafts to verify with this decode: as many of ``seq.spec_token_ids`` as the budget holds."""
        if not seq.spec_token_ids or n != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
            return 0
        return max(0, min(len(seq.spec_token_ids), budget - n))

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, fair: bool) -> int:
        """2. Swapped groups, FCFS (fair: smallest tenant counter first): all of a group's blocks come back, in
        no step that preempted."""
        if not self.swapped or budget <= 0 or out.preempted:
            return budget
        cfg = self.config
        order = list(self.swapped)
        if fair:
            order.sort(key=lambda g: (g.tenant_state.counter, self._group_priority(g.request_id)))
        reserved = self._num_reserved_seqs()
        for group in order:
            if budget <= 0:
                break
            seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
            # room for the next tokens too, unless nothing else runs (then the pool is all theirs)
            extra = sum(self.kv.num_blocks_for(s.num_tokens) - self.kv.num_blocks_for(s.num_computed_tokens) + 1
                        for s in seqs) if self.running else 0
            if (reserved + group.sampling_params.num_sequences > cfg.max_num_seqs
                    or not self.kv.can_swap_in(group, extra)
                    or self._admissible(group, self._running_adapters(), False) != "admit"):
                break
            self.swapped.remove(group)
            self._fresh.add(group.request_id)
            reserved += group.sampling_params.num_sequences
            out.blocks_to_swap_in.extend(self.kv.swap_in(group))
            for s in seqs:
                s.status = SequenceStatus.RUNNING
                bisect.insort(self.running, s, key=self._priority)
                n = min(s.num_tokens - s.num_computed_tokens, budget)
                if n > 0 and self.kv.allocate_slots(s, n):  # else: the running pass of a later step asks again
                    out.scheduled.append(self._scheduled(s, n))
                    budget -= n
        return budget

    def _admit_in_order(self, out: SchedulerOutput, budget: int) -> int:
        """3. Waiting requests, front first (FCFS, or the fair policy with one active tenant: one queue either
        way); no admission in a step that had to preempt, nor while groups are swapped out."""
        cfg = self.config
        skipped: list[tuple[Hashable, list[Sequence]]] = []
        slot_head: str | None = None   # this step's first request refused a slot
        barrier = False                # it was refused last step too: slots go to it first
        if self.waiting and budget > 0 and not out.preempted and not self.swapped:
            adapters = self._running_adapters()
            reserved = self._num_reserved_seqs()
            queues = iter(self.waiting.keys())
            key = next(queues)
            while budget > 0 and reserved < cfg.max_num_seqs:
                seq = self.waiting.head(key)
                if seq is None:
                    key = next(queues, None)
                    if key is None:
                        break
                    continue
                group = self._groups[seq.request_id]
                if reserved + group.sampling_params.num_sequences > cfg.max_num_seqs:
                    break
                verdict = self._admissible(group, adapters, barrier)
                if verdict != "admit":
                    if verdict == "no_slot" and slot_head is None:
                        slot_head = group.request_id
                        barrier = slot_head == self._slot_head
                    skipped.append((key, self._pop_group(key, group.request_id)))
                    continue
                admitted = self._admit_group(group, key, budget, out)
                if admitted is None:
                    break
                budget -= admitted
                reserved += group.sampling_params.num_sequences
                if group.adapter is not None and group.adapter not in adapters:
                    adapters.append(group.adapter)
        for key, seqs in reversed(skipped):
            self.waiting.extendleft(key, seqs)
        if not out.preempted:  # a preempting step admits nobody: the head keeps its standing
            self._slot_head = slot_head
        return budget

    def _schedule_shared(self, out: SchedulerOutput, budget: int, prefills: list[Sequence]) -> int:
        """3. (fair policy, several active tenants) Prefill work shared between tenants: repeatedly the tenant
        of smallest (counter + this step's prompt tokens for it, priority of its next item) takes its next item,
        its oldest running prefill first, then its oldest waiting request. Admission as in FCFS otherwise: not
        in a step that preempted nor while groups are swapped out, and a request that cannot get its first blocks
        stops admission for the step. One that lacks sequence slots takes them from running groups of tenants
        far above it (``_yield_slots``), else it stops admission too."""
        cfg = self.config
        admitting = bool(self.waiting) and not out.preempted and not self.swapped
        reserved = self._num_reserved_seqs() if admitting else 0
        yielding = admitting and cfg.vtc_preempt_gap is not None
        admitting = admitting and (reserved < cfg.max_num_seqs or yielding)
        block_preempted = bool(out.preempted)
        candidates: list[SlotYield | None] = [None]  # built the first time a request lacks slots
        decodes: list[list[ScheduledSequence] | None] = [None]  # built the first time a request lacks budget
        yielded: set[str] = set()  # groups that gave up their slots in this step: not admitted again in it
        work: dict[Hashable, deque[Sequence]] = {}  # each tenant's running prefills, FCFS
        for seq in prefills:
            work.setdefault(self._groups[seq.request_id].tenant, deque()).append(seq)
        # counter rise of this step's decode entries, per tenant: it orders tenants only when several compete
        decoded = self._decode_gains(out) if admitting or len(work) > 1 else {}
        gained: dict[Hashable, float] = {}  # counter rise of this step's prompt tokens, per tenant
        prompt_given = False  # some prefill work got tokens in this pass

        def next_item(tenant: Hashable) -> Sequence | None:
            queue = work.get(tenant)
            while queue:
                s = queue[0]
                if s.status is SequenceStatus.RUNNING and s.num_tokens > s.num_computed_tokens:
                    return s
                queue.popleft()  # preempted (or finished) since it was collected
            return self.waiting.head(tenant) if admitting else None

        def rank(tenant: Hashable) -> tuple | None:
            s = next_item(tenant)
            if s is None:
                return None
            group = self._groups[s.request_id]
            return (group.tenant_state.counter + gained.get(tenant, 0.0) + decoded.get(tenant, 0.0),
                    self._group_priority(s.request_id))

        taken = TenantHeap(rank)  # tenants with work in this step, lazily re-ranked as they are served
        members: set[Hashable] = set(work)
        for tenant in work:
            taken.push(tenant)
        skipped: list[tuple[Hashable, list[Sequence]]] = []
        adapters = self._running_adapters() if admitting else []
        slot_head: str | None = None
        barrier = False
        theirs = self._tenant_heap.peek(members) if admitting else None  # fixed until a tenant joins `members`
        while budget > 0 or (yielding and admitting):
            mine = taken.peek()
            if theirs is not None and admitting and (mine is None or theirs[0] < mine[0]):
                members.add(theirs[1])  # a waiting tenant joins this step's work
                taken.push(theirs[1])
                theirs = self._tenant_heap.peek(members)
                continue
            if mine is None:
                break
            tenant = mine[1]
            seq = next_item(tenant)
            group = self._groups[seq.request_id]
            counter = group.tenant_state.counter + gained.get(tenant, 0.0)  # the gaps are measured from here
            # a tenant holding nothing takes decodes' budget without the gap while no prefill got tokens this step
            share_rule = seq.status is not SequenceStatus.RUNNING and not prompt_given and self._within_share(group)
            if budget <= 0 and (seq.status is SequenceStatus.RUNNING
                                or not far_enough(self._counter_ceiling() - counter, cfg.vtc_preempt_gap,
                                                  share_rule)):
                break  # the budget is spent; only a waiting request far below a tenant takes its decodes' tokens
            if seq.status is SequenceStatus.RUNNING:  # its running prefill: a chunk
                work[tenant].popleft()
                used, refund, preempted = self._schedule_seq(seq, budget, out)
                budget += refund - used
                if preempted:
                    admitting = False
                    block_preempted = True
                if used:
                    gained[tenant] = gained.get(tenant, 0.0) + group.tenant_state.input_cost(used)
                    prompt_given = True
                continue
            num_slots = group.sampling_params.num_sequences
            shortfall = reserved + num_slots - cfg.max_num_seqs
            victims: list[SequenceGroup] = []
            if shortfall > 0:
                if not yielding or group.request_id in yielded:
                    admitting = False
                    continue
                victims = self._yield_slots(group, counter, shortfall, candidates)
                if not victims:
                    admitting = False
                    continue
            verdict = self._admissible(group, adapters, barrier)
            if verdict != "admit":
                if verdict == "no_slot" and slot_head is None:
                    slot_head = group.request_id
                    barrier = slot_head == self._slot_head
                skipped.append((tenant, self._pop_group(tenant, group.request_id)))
                continue
            if victims:
                candidates[0].take(victims)
                for victim in victims:
                    budget += self._preempt_group(victim, out, mode="recompute")
                    reserved -= victim.sampling_params.num_sequences
                    yielded.add(victim.request_id)
                self.num_slot_preemptions += len(victims)
            want = seq.num_tokens - seq.num_computed_tokens
            if yielding and (budget <= 0 or (want > budget and not cfg.enable_chunked_prefill)):
                budget += self._yield_budget(counter, share_rule, want - budget, out, decodes)
                if budget <= 0:
                    admitting = False
                    continue
            admitted = self._admit_group(group, tenant, budget, out)
            if admitted is None:
                admitting = False
                continue
            budget -= admitted
            reserved += num_slots
            self._fresh.add(group.request_id)
            if candidates[0] is not None:
                candidates[0].admit(tenant, num_slots)
            gained[tenant] = gained.get(tenant, 0.0) + group.tenant_state.input_cost(admitted)
            prompt_given = prompt_given or admitted > 0
            if reserved >= cfg.max_num_seqs and not yielding:
                admitting = False
            if group.adapter is not None and group.adapter not in adapters:
                adapters.append(group.adapter)
        for tenant, seqs in reversed(skipped):
            self.waiting.extendleft(tenant, seqs)
        for tenant in members:  # back into the admission order with their real counters
            self._tenant_heap.push(tenant)
        if len(self._tenant_heap) > 2 * self.waiting.num_keys + 64:
            self._tenant_heap.rebuild(self.waiting.keys())
        if not block_preempted:
            self._slot_head = slot_head
        return budget

    def _decode_gains(self, out: SchedulerOutput) -> dict[Hashable, float]:
        """Per tenant, the counter rise of the output tokens this step's entries so far will sample (one per
        sample): the shared pass ranks tenants by their counter plus it, so a tenant decoding many sequences ranks
        behind one level with it that decodes none."""
        samples: dict[Hashable, int] = {}
        states = {}
        last, tenant = None, None
        for s in out.scheduled:
            if s.sample:
                if s.seq.request_id != last:
                    last = s.seq.request_id
                    state = self._groups[last].tenant_state
                    tenant = state.tenant
                    states[tenant] = state
                samples[tenant] = samples.get(tenant, 0) + s.num_samples
        return {t: states[t].output_cost(n) for t, n in samples.items()}

    def _counter_ceiling(self) -> float:
        if self._ceiling is None:
            self._ceiling = self.counters.ceiling()
        return self._ceiling

    def _within_share(self, group: SequenceGroup) -> bool:
        """The share rule applies to waiting ``group`` (engine/slot_yield.py): every unfinished request of its tenant
        waits (none running or swapped: it holds no slot) and it asks at most the tenant's weighted share of
        ``max_num_seqs`` among the active tenants."""
        state = group.tenant_state
        return (group.sampling_params.num_sequences * self.counters.active_weight
                <= self.config.max_num_seqs * state.weight
                and state.num_requests == self.waiting.num_requests(group.tenant))

    def _yield_budget(self, counter: float, share_rule: bool, shortfall: int, out: SchedulerOutput,
                      decodes: list[list[ScheduledSequence] | None]) -> int:
        """Withdraw this step's decode entries of tenants far enough above ``counter`` (engine/slot_yield.py
        ``far_enough``: more than ``vtc_preempt_gap`` above, or, with ``share_rule``, at or above it), largest counter
        first, latest first, for up to ``shortfall`` tokens, for a waiting request that would get none of its prompt
        (budget spent; without chunked prefill: too little left for the whole prompt); returns the tokens withdrawn.
        ``share_rule``: the asker is within the share rule (``_within_share``) and no prefill work got tokens in this
        step (the decodes filled it). The
        sequences stay running with their blocks (nothing is preempted): they decode in the next step.
        ``decodes[0]`` is built on first use, once per step: entries with one token left (decodes, with their
        drafts), not of groups admitted in this step."""
        gap = self.config.vtc_preempt_gap
        if not far_enough(self._counter_ceiling() - counter, gap, share_rule):
            return 0
        if decodes[0] is None:
            found = [(self._groups[s.seq.request_id].tenant_state.counter, i, s) for i, s in enumerate(out.scheduled)
                     if s.seq.num_tokens - s.seq.num_computed_tokens == 1 and s.seq.request_id not in self._fresh]
            found.sort(key=lambda e: e[:2])
            decodes[0] = [s for _, _, s in found]  # pop() gives the largest counter's latest entry
        pool, drop, freed = decodes[0], set(), 0
        while pool and freed < shortfall:
            s = pool[-1]
            if not far_enough(self._groups[s.seq.request_id].tenant_state.counter - counter, gap, share_rule):
                break
            pool.pop()
            if s.seq.status is SequenceStatus.RUNNING:  # else preempted for slots in this step: entry gone already
                drop.add(id(s))
                freed += s.num_new_tokens
        if drop:
            out.scheduled = [s for s in out.scheduled if id(s) not in drop]
            self.num_budget_yields += len(drop)
        return freed

    def _yield_slots(self, group: SequenceGroup, counter: float, shortfall: int,
                     candidates: list[SlotYield | None]) -> list[SequenceGroup]:
        """Running groups to preempt so that waiting ``group`` (its tenant at ``counter`` in this step) gets
        ``shortfall`` more sequence slots: those of tenants far enough above it (more than ``vtc_preempt_gap``; at
        or above it when its tenant holds no slot) that keep at least its weighted slot count
        (engine/slot_yield.py); [] if they do not free enough. ``candidates[0]`` is built on first use, once per
        step."""
        gap = self.config.vtc_preempt_gap
        if not far_enough(self._counter_ceiling() - counter, gap, self._within_share(group)):
            return []  # nobody is far enough above: skip building the candidates
        if candidates[0] is None:
            seen: set[str] = set()
            running = []
            for s in self.running:
                if s.request_id not in seen:
                    seen.add(s.request_id)
                    running.append(self._groups[s.request_id])
            candidates[0] = SlotYield(running, gap, self._fresh,
                                      self.config.max_num_seqs / self.counters.active_weight)
        return candidates[0].plan(group.tenant, counter, group.tenant_state.weight,
                                  group.sampling_params.num_sequences, shortfall)

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]],
               logprobs: dict[int, list] | None = None,
               beam_logprobs: dict[int, Any] | None = None) -> list[SequenceGroup]:
        """Apply a finished step: advance computed tokens, cache full blocks, append sampled tokens (by seq_id;
        a list of ``num_samples`` tokens at a fork step: the parent takes the first, a forked child each other),
        step beam searches whose beams all have their log-prob rows, stop finished sequences and free their
        blocks. ``logprobs[seq_id]``: entries (``TokenLogprob`` or None) parallel to the sampled tokens; their
        logprob accumulates into ``cumulative_logprob``. Charges the step's new prompt and output tokens to their
        tenants' counters. Returns the requests that finished in this step."""
        finished: list[SequenceGroup] = []
        now = time.monotonic()
        logprobs = logprobs or {}
        beam_groups: list[SequenceGroup] = []
        fair = self.counters is not None
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted, finished or preempted since schedule()
                continue
            if s.draft_token_ids:
                self._update_verified(s, sampled[seq.seq_id], logprobs.get(seq.seq_id), now, finished)
                continue
            seq.num_computed_tokens += s.num_new_tokens
            if fair and not seq.output_token_ids:  # prompt positions only (with outputs, the prompt is charged)
                self._charge_prompt(seq)
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
            if fair:
                group.tenant_state.output_tokens += len(tokens)  # charged (TenantState.counter)
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

    def _update_verified(self, s: ScheduledSequence, tokens: list[int], entries: list | None, now: float,
                         finished: list[SequenceGroup]) -> None:
        """A speculative verify of ``s``: ``tokens`` are the accepted drafts then the target's own token. Its input
        token and the accepted drafts have their K/V computed; each token is appended (and charged) with the stop
        checks after it; the blocks past the sequence's tokens (rejected drafts' slots) are released. Full blocks
        are cached only over accepted tokens."""
        seq = s.seq
        group = self._groups[seq.request_id]
        if group.first_token_time is None:
            group.first_token_time = now
        seq.num_computed_tokens += len(tokens)
        n, status = self._verified_stop(seq, group, tokens)
        logprobs = [e.logprob if e is not None else 0.0 for e in entries[:n]] if entries else None
        seq.append_tokens(tokens[:n], logprobs)
        if self.counters is not None:
            group.tenant_state.output_tokens += n
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        self.kv.cache_full_blocks(seq)
        if status is not None:
            self._finish(seq, group, status, now, finished)
        else:
            self.kv.trim(seq)

    # ---- overlapped steps (engine/step_pipeline.py) -----------------------------------------------------
    def update_launched(self, out: SchedulerOutput) -> None:
        """An overlapped decode step was launched: each of its still-running sequences has its input token
        computed (stream order makes that true for every later step) and gains a pending token (its sampled
        token, value still on the device). Sequences that finished since ``schedule()`` are left alone: their
        row of the step is discarded. Call once the previous step's pending tokens are resolved, so the full
        blocks hashed here hold real tokens only. A pending token is not charged yet: it counts when it resolves
        (the prompt position of a one-token prompt, computed by this step, is charged here)."""
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if s.num_new_tokens != 1 or not s.sample or s.num_samples != 1 or s.beam or seq.num_pending_tokens:
                raise ValueError(f"sequence {seq.seq_id} is not a plain decode with a known input token; it "
                                 f"cannot be overlapped")
            seq.num_computed_tokens += 1
            if self.counters is not None and not seq.output_token_ids:
                self._charge_prompt(seq)  # a one-token prompt's prefill looks like a decode: charged as it runs
            self.kv.cache_full_blocks(seq)
            seq.append_pending_token()

    def update_resolved(self, out: SchedulerOutput, sampled: dict[int, int]) -> tuple[list[Sequence],
                                                                                      list[SequenceGroup]]:
        """The pending tokens of an overlapped step arrived (``sampled``: seq_id -> token): write them in, then
        stop checks as in ``update``. A sequence may have been preempted since (waiting or swapped out): it
        finishes from there. Aborted sequences drop their token. Returns (sequences whose token counts, the
        requests that finished); each token that counts is charged to its tenant."""
        finished: list[SequenceGroup] = []
        accepted: list[Sequence] = []
        now = time.monotonic()
        fair = self.counters is not None
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
            if fair:
                group.tenant_state.output_tokens += 1
            if group.first_token_time is None:
                group.first_token_time = now
            status = self._stop_status(seq, group, token)
            if status is not None:
                self._finish(seq, group, status, now, finished)
        return accepted, finished

    # ---- helpers ---------------------------------------------------------------------------------------
    def _key(self, group: SequenceGroup) -> Hashable:
        """The waiting queue of a group: its tenant under "vtc", one shared queue under "fcfs"."""
        return group.tenant if self.counters is not None else None

    def _waiting_rank(self, tenant: Hashable) -> tuple | None:
        """Admission rank of a tenant: (its counter, priority of its first waiting request); None: none waits."""
        seq = self.waiting.head(tenant)
        if seq is None:
            return None
        return self._groups[seq.request_id].tenant_state.counter, self._group_priority(seq.request_id)

    def _charge_prompt(self, seq: Sequence) -> None:
        """Charge the prompt positions ``seq`` computed for the first time in its request (a recompute, or a
        fork's shared prompt, charges nothing)."""
        group = self._groups[seq.request_id]
        covered = min(seq.num_computed_tokens, len(seq.prompt_token_ids))
        if covered > group.num_charged_prompt_tokens:
            group.tenant_state.charge_input(covered - group.num_charged_prompt_tokens)
            group.num_charged_prompt_tokens = covered

    def _victim(self) -> SequenceGroup:
        """The group to preempt. FCFS (or one active tenant): the latest-arrived running group. Fair: the latest
        running group of the tenant with the largest counter (ties: the latest arrival)."""
        last = self._groups[self.running[-1].request_id]
        if self.counters is None or self.counters.num_active < 2:
            return last
        best, best_counter, seen = last, last.tenant_state.counter, {last.tenant}
        for s in reversed(self.running):  # each tenant's latest group comes first
            group = self._groups[s.request_id]
            if group.tenant in seen:
                continue
            seen.add(group.tenant)
            if group.tenant_state.counter > best_counter:
                best, best_counter = group, group.tenant_state.counter
            if len(seen) >= self.counters.num_active:
                break
        return best

    def _pop_group(self, key: Hashable, request_id: str) -> list[Sequence]:
        """Take a group's waiting sequences off the front of queue ``key`` (they are adjacent there)."""
        seqs = []
        while (head := self.waiting.head(key)) is not None and head.request_id == request_id:
            seqs.append(self.waiting.popleft(key))
        return seqs

    def _finish(self, seq: Sequence, group: SequenceGroup, status: SequenceStatus, now: float,
                finished: list[SequenceGroup]) -> None:
        """End ``seq`` wherever it is: running, or (a pending token resolved after a preemption) waiting for
        recompute or swapped out."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(self._key(group), seq)
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
        if self.counters is not None:
            group.tenant_state.charge_output(len(state.running))  # one token per live beam
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
        if self._groups.pop(group.request_id, None) is not None and group.tenant_state is not None:
            self.counters.deactivate(group.tenant_state)
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

    def _verified_stop(self, seq: Sequence, group: SequenceGroup,
                       tokens: list[int]) -> tuple[int, SequenceStatus | None]:
        """``_stop_status`` after each of ``tokens`` appended in turn to ``seq``, without appending them: (tokens to
        append, up to and including the first that stops; the status it stops with, None: all, no stop)."""
        params = group.sampling_params
        # the length limit holds once n tokens are in, n >= room (at least the first token is appended)
        room = max(1, min(params.max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens))
        eos = () if params.ignore_eos else self.config.eos_token_ids
        stops = params.stop_token_ids
        for i, token in enumerate(tokens[:room]):
            if token in eos or token in stops:
                return i + 1, SequenceStatus.FINISHED_STOPPED
        if room <= len(tokens):
            return room, SequenceStatus.FINISHED_LENGTH
        return len(tokens), None

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

    def _admit_group(self, group: SequenceGroup, key: Hashable, budget: int, out: SchedulerOutput) -> int | None:
        """Move the group's waiting sequences (adjacent at the front of queue ``key``) to running, scheduling as
        many as the budget allows; the first must get blocks, else nothing changes and None is returned. Returns
        the tokens scheduled."""
        queue = self.waiting.queue(key)
        seqs: list[Sequence] = []
        while len(seqs) < len(queue) and queue[len(seqs)].request_id == group.request_id:
            seqs.append(queue[len(seqs)])
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
            self.waiting.popleft(key)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._priority)
        return used

    def _preempt_group(self, group: SequenceGroup, out: SchedulerOutput, mode: str | None = None) -> int:
        """Preempt every unfinished sequence of ``group`` (``_victim``'s or ``_yield_slots``' choice): swap its
        blocks to the CPU pool, or drop them for recompute (``mode`` overrides ``preemption_mode``). Entries of
        the group already scheduled in this step are withdrawn; returns their tokens (back into the budget)."""
        seqs = [s for s in self.running if s.request_id == group.request_id]
        refund = sum(s.num_new_tokens for s in out.scheduled if s.seq.request_id == group.request_id)
        out.scheduled = [s for s in out.scheduled if s.seq.request_id != group.request_id]
        for s in seqs:
            self.running.remove(s)
        mode = choose_preemption_mode(mode or self.config.preemption_mode, num_seqs=len(seqs),
                                      num_computed_tokens=sum(s.num_computed_tokens for s in seqs),
                                      can_swap_out=self.kv.can_swap_out(group))
        if mode == "swap":
            out.blocks_to_swap_out.extend(self.kv.swap_out(group))
            for s in seqs:
                s.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=lambda g: self._group_priority(g.request_id))
            self.num_swap_outs += 1
        else:
            for s in seqs:
                self.kv.free(s)
                s.num_computed_tokens = 0
                s.status = SequenceStatus.WAITING
            self.waiting.extendleft(self._key(group), seqs)
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

    def _scheduled(self, seq: Sequence, n: int, num_drafts: int = 0) -> ScheduledSequence:
        group = self._groups[seq.request_id]
        params = group.sampling_params
        sample = seq.num_computed_tokens + n == seq.num_tokens
        beam = params.use_beam_search
        fork = (not beam and params.num_sequences > 1 and len(group.seqs) == 1 and seq.num_output_tokens == 0)
        covers_prompt = params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens - 1
        return ScheduledSequence(seq=seq, num_new_tokens=n + num_drafts, block_ids=list(seq.block_ids), sample=sample,
                                 num_samples=params.num_sequences if fork and sample else 1, beam=beam,
                                 prompt_logprobs=params.prompt_logprobs if covers_prompt else None,
                                 draft_token_ids=list(seq.spec_token_ids[:num_drafts]))

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


def _widest_field(params) -> str:
    """The sampling field that sets a request's sequence count (``SamplingParams.num_sequences``), for errors."""
    if params.use_beam_search and params.beam_width is not None:
        return "beam_width"
    return "best_of" if params.best_of is not None and params.best_of > params.n else "n"
