"""Virtual token counters: the bookkeeping of the tenant-fair scheduling policy (torch-free).

The policy is the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI '24), weighted. Each tenant t has a counter of the service it received, in cost units per unit of weight:

    counter[t] += (input_weight * prompt tokens + output_weight * output tokens) / weight[t]

    charged once:  a prompt position when it is first computed (cached prefix hits included; a recompute after
                   preemption, a swap-in or a fork's shared prompt adds nothing); an output token when its value
                   is appended (an overlapped step's pending token when it resolves), once per sequence, so an
                   ``n``/``best_of``/beam request pays for every sequence it runs
    lift:          a tenant that becomes active (its first unfinished request arrives) starts at
                   max(its own counter, floor); floor = the smallest counter among active tenants, or, while none
                   is active, the counter of the last tenant to leave. Idle time is not banked (a returning
                   tenant is not owed what others received meanwhile) and debt is not forgiven by leaving.

The scheduler (engine/scheduler.py) serves the active tenant with the smallest counter first and preempts from
the one with the largest. A backlogged tenant's counter grows by its service over its weight, so serving the
smallest first keeps backlogged tenants' counters within a bounded gap of each other: their services converge
to shares ``weight[t] / sum(weight)``.

    counter
      ^            B (weight 1) ___/          A and B backlogged: whoever is lower is served next, so the
      |          ____/   ___/   A (weight 2)  two curves stay within one request's cost of each other; A's
      |    _____/   ____/                     tokens grow twice as fast as B's for the same counter rise
      |___/ ___/       C arrives here -> lifted to min(A, B), not 0
      +----------------------------------------------------------> time

Counters order admission and pick preemption victims; they also decide who yields sequence slots and budget.
Slots (``max_num_seqs``) are held for a request's whole generation, so without more, a tenant holding them all
(n=64 requests, say) keeps every other tenant waiting however far ahead its counter runs. Two rules bound that
(engine/slot_yield.py has them in full, with why they cannot thrash):

    share rule:  a waiting request of a tenant A that holds no slot and asks at most its weighted share of the
                 slots (max_num_seqs * weight[A] / the active tenants' weights) takes slots from tenants at or
                 above its counter that hold more than their share in whole slots, and, while decodes alone fill
                 the step, the budget for its prompt from their decodes: no gap
    gap rule:    otherwise, running groups of tenant V yield to a waiting request of tenant A when
                 counter[V] - counter[A] > vtc_preempt_gap and, for slots, V keeps at least A's slots / weight
                 after the move (or A has none running and V more than A will)
    how:         slots: V's latest whole groups are preempted by recompute (engine/slot_yield.py);
                 budget (A's request would get no token): V's decode entries of the step are withdrawn

``vtc_preempt_gap`` (``DEFAULT_PREEMPT_GAP`` = 1024 counter units: one long prompt, or 512 output tokens, at weight
1; None: no yields at all, neither rule) is the gap rule's knob. A newcomer starts at the floor, level with a tenant
that holds every slot; by the gap rule alone it would wait until the gap builds at that tenant's service rate (a
slot-holding tenant's 256 decoding sequences add 512 a step at weight 1): gap / that rate + 1 steps (3 here). The
share rule admits it at the next schedule instead. A smaller gap lets routine jumps of the counters (a prompt is
charged at once when it is computed) trigger yields among backlogged tenants that hold slots: with 16 tenants
backlogged beside 256 running sequences (benchmarks/engine/bench_scheduler_policy.py's load), a gap of 512 moved a
group every three to four steps, 1024 about once in a hundred. Neither rule lets a yield overshoot, so a group that
yielded cannot take its slots straight back.

The floor never falls (a newcomer joins at the floor, counters only grow, and a tenant leaving can only raise
the minimum), so an inactive tenant whose counter is at or below the floor is forgotten: it would be lifted to
the floor anyway. The records kept are the active tenants and the inactive ones still above the floor.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable

DEFAULT_INPUT_WEIGHT = 1.0
DEFAULT_OUTPUT_WEIGHT = 2.0
DEFAULT_PREEMPT_GAP = 1024.0  # counter lead over a waiting tenant beyond which running groups yield slots to it
MAX_TENANT_WEIGHT = 1e6
_PRUNE_SLACK = 256  # inactive records beyond those above the floor before a pruning pass


def check_weight(weight: object) -> None:
    """ValueError unless a tenant's ``weight`` is a number in (0, MAX_TENANT_WEIGHT]."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_TENANT_WEIGHT:
        raise ValueError(f"tenant weight must be a number in (0, {MAX_TENANT_WEIGHT:g}], got {weight!r}")


def check_cost_weight(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_preempt_gap(gap: object) -> None:
    """ValueError unless ``gap`` (``vtc_preempt_gap``) is None (no slot preemption) or a finite number >= 0."""
    if gap is None:
        return
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < math.inf:
        raise ValueError(f"vtc_preempt_gap must be None (never preempt for sequence slots) or a finite number >= 0, "
                         f"got {gap!r}")


class TenantState:
    """One tenant's counter and load. ``num_requests``: its unfinished requests (0: inactive);
    ``input_tokens`` / ``output_tokens``: tokens charged to it since its record was created.

    Charging is an integer increment (``state.output_tokens += n`` in the scheduler's per-token loop); ``counter``
    adds their cost to the value committed at the last lift or weight change."""

    __slots__ = ("tenant", "weight", "num_requests", "input_tokens", "output_tokens", "_base", "_base_input",
                 "_base_output", "_input_cost", "_output_cost")

    def __init__(self, tenant: Hashable, weight: float, counter: float, input_weight: float,
                 output_weight: float) -> None:
        self.tenant = tenant
        self.num_requests = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self._base, self._base_input, self._base_output = float(counter), 0, 0
        self.weight = float(weight)
        self._input_cost = input_weight / self.weight
        self._output_cost = output_weight / self.weight

    @property
    def counter(self) -> float:
        return (self._base + (self.input_tokens - self._base_input) * self._input_cost
                + (self.output_tokens - self._base_output) * self._output_cost)

    @counter.setter
    def counter(self, value: float) -> None:
        self._base, self._base_input, self._base_output = float(value), self.input_tokens, self.output_tokens

    def set_weight(self, weight: float, input_weight: float, output_weight: float) -> None:
        """From now on, tokens cost ``input_weight`` / ``output_weight`` over ``weight`` (earlier ones keep their
        cost)."""
        self.counter = self.counter
        self.weight = float(weight)
        self._input_cost = input_weight / self.weight
        self._output_cost = output_weight / self.weight

    def charge_input(self, num_tokens: int) -> None:
        self.input_tokens += num_tokens

    def charge_output(self, num_tokens: int) -> None:
        self.output_tokens += num_tokens

    def input_cost(self, num_tokens: int) -> float:
        """The counter rise ``num_tokens`` prompt tokens would cause."""
        return num_tokens * self._input_cost

    def output_cost(self, num_tokens: int) -> float:
        """The counter rise ``num_tokens`` output tokens would cause."""
        return num_tokens * self._output_cost

    def __repr__(self) -> str:
        return (f"TenantState({self.tenant!r}, weight={self.weight:g}, counter={self.counter:.1f}, "
                f"requests={self.num_requests})")


class VirtualTokenCounters:
    """The counters of all tenants the scheduler knows (module docstring). Not thread-safe: the engine thread
    owns it; ``snapshot`` is what other threads read."""

    def __init__(self, input_weight: float = DEFAULT_INPUT_WEIGHT,
                 output_weight: float = DEFAULT_OUTPUT_WEIGHT) -> None:
        check_cost_weight("input_weight", input_weight)
        check_cost_weight("output_weight", output_weight)
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self._tenants: dict[Hashable, TenantState] = {}
        self._active: dict[Hashable, TenantState] = {}
        self._active_weight = 0.0  # the sum of the active tenants' weights
        self._last_left = 0.0  # the floor while no tenant is active
        self._prune_at = _PRUNE_SLACK  # inactive records kept before a pass forgets those at or below the floor

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def active_weight(self) -> float:
        """The sum of the active tenants' weights (0 while none is active)."""
        return self._active_weight

    def get(self, tenant: Hashable) -> TenantState | None:
        return self._tenants.get(tenant)

    def floor(self) -> float:
        """The smallest counter among active tenants; while none is active, the last one's to leave."""
        if not self._active:
            return self._last_left
        return min(s.counter for s in self._active.values())

    def ceiling(self) -> float:
        """The largest counter among active tenants (the floor while none is active)."""
        if not self._active:
            return self._last_left
        return max(s.counter for s in self._active.values())

    def activate(self, tenant: Hashable, weight: float) -> TenantState:
        """A request of ``tenant`` arrived: count it, take ``weight`` as the tenant's weight from now on, and
        lift the counter of a tenant that had no unfinished request."""
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) - len(self._active) > self._prune_at:
                self._forget_below(self.floor())
            state = TenantState(tenant, weight, self.floor(), self.input_weight, self.output_weight)
            self._tenants[tenant] = state
        elif state.weight != weight:
            if state.num_requests:
                self._active_weight += weight - state.weight
            state.set_weight(weight, self.input_weight, self.output_weight)
        if state.num_requests == 0:
            state.counter = max(state.counter, self.floor())
            self._active[tenant] = state
            self._active_weight += state.weight
        state.num_requests += 1
        return state

    def deactivate(self, state: TenantState) -> None:
        """One of the tenant's requests finished (or was aborted)."""
        state.num_requests -= 1
        if state.num_requests == 0:
            self._active.pop(state.tenant, None)
            self._active_weight -= state.weight
            if not self._active:
                self._last_left = max(self._last_left, state.counter)
                self._active_weight = 0.0  # no drift left over from the sums

    def _forget_below(self, floor: float) -> None:
        for tenant in [t for t, s in self._tenants.items() if not s.num_requests and s.counter <= floor]:
            del self._tenants[tenant]
        self._prune_at = 2 * (len(self._tenants) - len(self._active)) + _PRUNE_SLACK  # amortised: O(1) per arrival

    def snapshot(self) -> list[dict]:
        """One plain dict per known tenant (``tenant``, ``weight``, ``counter``, ``active``, ``input_tokens``,
        ``output_tokens``); safe to call from another thread (the dict is copied in one C-level step)."""
        states = list(self._tenants.copy().values())
        return [{"tenant": s.tenant, "weight": s.weight, "counter": s.counter, "active": s.num_requests > 0,
                 "input_tokens": s.input_tokens, "output_tokens": s.output_tokens} for s in states]


class TenantHeap:
    """Tenants in admission order, smallest ``rank(tenant)`` first, e.g. (counter, priority of its first waiting
    request); ``rank`` returns None for a tenant with nothing waiting.

    A lazy min-heap: an entry's stored rank is a lower bound of the tenant's rank (counters only grow; whoever
    changes a tenant's first waiting request to one that may rank earlier calls ``push``), so ``peek`` re-ranks
    a stale top instead of trusting it, and drops entries of tenants with nothing waiting. A tenant may have
    several entries; ``exclude`` hides tenants the caller has taken out for the current step."""

    def __init__(self, rank: Callable[[Hashable], tuple | None]) -> None:
        self._rank = rank
        self._heap: list[tuple[tuple, int, Hashable]] = []
        self._tiebreak = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, tenant: Hashable) -> None:
        rank = self._rank(tenant)
        if rank is not None:
            self._tiebreak += 1
            heapq.heappush(self._heap, (rank, self._tiebreak, tenant))

    def peek(self, exclude: set | frozenset = frozenset()) -> tuple[tuple, Hashable] | None:
        """(rank, tenant) of the smallest tenant not in ``exclude``, or None. Entries of excluded tenants are
        dropped: the caller pushes them back when it is done with them."""
        heap = self._heap
        while heap:
            stored, _, tenant = heap[0]
            rank = None if tenant in exclude else self._rank(tenant)
            if rank is None:
                heapq.heappop(heap)
            elif rank != stored:
                self._tiebreak += 1
                heapq.heapreplace(heap, (rank, self._tiebreak, tenant))
            else:
                return rank, tenant
        return None

    def rebuild(self, tenants: Iterable[Hashable]) -> None:
        """One fresh entry per tenant (drops duplicates and stale entries)."""
        self._heap = []
        for tenant in tenants:
            rank = self._rank(tenant)
            if rank is not None:
                self._tiebreak += 1
                self._heap.append((rank, self._tiebreak, tenant))
        heapq.heapify(self._heap)
