"""Which running groups give up their sequence slots to a waiting tenant far below them in the virtual token
counters: the fair policy's slot preemption (torch-free; the scheduler preempts what ``plan`` returns).

A waiting request R of tenant A (counter c_A, weight w_A) needs m = R's ``num_sequences`` slots and all
``max_num_seqs`` are held. A running group G of tenant V (counter c_V, weight w_V, holding s_V slots) yields its
g slots to R only if

    gap:    c_V - c_A > vtc_preempt_gap            V received more service than A, by more than the knob
    share:  (s_V - g) / w_V >= (s_A + m) / w_A     after the move V keeps at least A's slots (over weight),
            or s_A = 0 and s_V / w_V > m / w_A      or A holds none and V more than A will
    fresh:  G was not admitted or swapped in during this step

Victims: tenants from the largest counter down while the gap holds, each tenant's latest groups first; a whole
group always (a forked n > 1 / best_of / beam request reserves all its slots together). A plan is all or
nothing: if the qualifying groups cannot free enough slots, nothing is preempted.

    slots    V ########|##  (s_V, G last)        A ##|#  (s_A, then + m)
             V yields G while it keeps no fewer than A will have; s_V is recounted before each further group;
             the exception lets a tenant with nothing running in beside one whole group that holds every slot

Why it cannot thrash. The gap condition alone bounds preemptions between two tenants by their relative service
(a reversal needs 2 * gap of it; recompute charges nothing). The share condition forbids the reversal outright
until admissions into free slots change the balance: for G (g slots) to come back, V would need
(s_A + m - m') / w_A >= (s_V - g + g) / w_V for some group of A of m' >= 1 slots, but (s_A + m) / w_A <=
(s_V - g) / w_V < s_V / w_V; by the exception, V would hold none, so g = s_V and m / w_A > s_V / w_V, the
opposite of what let G go. Among tenants with equal shares, +-1 slot of difference never moves a group.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable

from loraplex.engine.sequence import SequenceGroup


class SlotYield:
    """The running groups of one scheduling step, per tenant, as slot-preemption candidates. Built once per step
    (O(running sequences)), the first time a waiting request lacks slots; ``admit`` counts the slots of groups
    admitted after that."""

    def __init__(self, running: Iterable[SequenceGroup], gap: float, fresh: set[str]) -> None:
        self.gap = gap
        self._slots: dict[Hashable, int] = {}
        self._groups: dict[Hashable, list[SequenceGroup]] = {}  # arrival order: the latest last
        self._counters: dict[Hashable, float] = {}
        self._weights: dict[Hashable, float] = {}
        for g in running:
            t = g.tenant
            self._slots[t] = self._slots.get(t, 0) + g.sampling_params.num_sequences
            if t not in self._groups:
                self._groups[t] = []
                self._counters[t] = g.tenant_state.counter
                self._weights[t] = g.tenant_state.weight
            if g.request_id not in fresh:
                self._groups[t].append(g)
        self._order = sorted(self._groups, key=self._counters.__getitem__, reverse=True)  # largest counter first

    def admit(self, tenant: Hashable, num_slots: int) -> None:
        """A group of ``tenant`` holding ``num_slots`` slots was admitted (it is never a candidate in this step)."""
        self._slots[tenant] = self._slots.get(tenant, 0) + num_slots

    def plan(self, tenant: Hashable, counter: float, weight: float, num_slots: int,
             shortfall: int) -> list[SequenceGroup]:
        """Groups to preempt so that ``tenant`` (at ``counter``, ``weight``) can admit a request of ``num_slots``
        sequences, ``shortfall`` of which are not free: they free at least ``shortfall`` slots, or the list is
        empty (nothing qualifies; module docstring). Changes nothing: ``take`` the plan to commit it."""
        have = self._slots.get(tenant, 0)
        mine = (have + num_slots) / weight
        chosen: list[SequenceGroup] = []
        freed = 0
        for victim in self._order:
            if self._counters[victim] - counter <= self.gap:
                break
            if victim == tenant:
                continue
            groups, held, w = self._groups[victim], self._slots[victim], self._weights[victim]
            for g in reversed(groups):
                size = g.sampling_params.num_sequences
                if freed >= shortfall or not ((held - size) / w >= mine or (not have and held / w > mine)):
                    break
                chosen.append(g)
                held -= size
                freed += size
            if freed >= shortfall:
                return chosen
        return []

    def take(self, chosen: list[SequenceGroup]) -> None:
        """The groups of a ``plan`` are being preempted: they stop being candidates and holding slots."""
        for g in chosen:
            self._slots[g.tenant] -= g.sampling_params.num_sequences
            groups = self._groups[g.tenant]
            if groups[-1] is g:  # a plan takes each tenant's latest groups, latest first
                groups.pop()
            else:
                groups.remove(g)
