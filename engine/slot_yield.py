"""Which running groups give up their sequence slots to a waiting tenant below them in the virtual token counters:
the fair policy's slot preemption (torch-free; the scheduler preempts what ``plan`` returns).

A waiting request R of tenant A (counter c_A, weight w_A, holding s_A slots) needs m = R's ``num_sequences`` slots
and all ``max_num_seqs`` = S are held. W is the sum of the active tenants' weights (A's included), so a tenant's
weighted share of the slots is S * w / W. A running group G of tenant V (counter c_V, weight w_V, holding s_V
slots, G's g among them) yields its slots to R by one of two rules:

    share rule, when A holds nothing and asks at most its share (s_A = 0 and m / w_A <= S / W):
        lead:   c_V >= c_A                  V received at least as much service as A: no gap
        share:  s_V > ceil(S * w_V / W)     V holds more than its share in whole slots (recounted before each
                                            further group)
    gap rule, otherwise:
        gap:    c_V - c_A > vtc_preempt_gap             V received more service than A, by more than the knob
        share:  (s_V - g) / w_V >= (s_A + m) / w_A      after the move V keeps at least A's slots (over weight),
                or s_A = 0 and s_V / w_V > m / w_A      or A holds none and V more than A will
    either:     G was not admitted or swapped in during this step

The share rule is tried first, the gap rule if it frees too few slots. Victims: tenants from the largest counter
down while the lead (or gap) holds, each tenant's latest groups first; a whole group always (a forked n > 1 /
best_of / beam request reserves all its slots together). A plan is all or nothing: if the qualifying groups cannot
free enough slots, nothing is preempted.

    slots    V ########|##  (s_V, G last)        A ##|#  (s_A, then + m)
             share rule: V yields G while it holds more than ceil(S * w_V / W), to an A that holds none
             gap rule:   V yields G while it keeps no fewer than A will have; s_V is recounted before each group

Why the share rule. A newcomer is lifted to the floor, level with a tenant that holds every slot; under the gap
rule alone it then waits until that tenant's lead passes the gap, about gap / (its service per step) + 1 steps (a
heavy tenant's 256 decoding sequences add 512 a step at weight 1: 3 steps for the default gap of 1024), on top of
the step in flight. Under the share rule it is admitted by the first schedule() after its arrival: its wait is the
rest of the step in flight when it arrives (about half a step on average, one at most), then its own prefill step
(engine/scheduler.py ranks a tenant decoding many sequences behind one level with it that decodes none, so the
tie at the floor does not hold it back either). The gap keeps its meaning for a tenant that holds slots, and for
a request larger than its tenant's share.

Why it cannot thrash. Share rule: afterwards A holds m <= S * w_A / W, within its share, so no share-rule yield
takes slots from A while the active tenants stay the same, and taking them back by the gap rule needs what the
argument below says. Each share-rule yield lowers the total excess sum_t max(0, s_t - ceil(S * w_t / W)) (A's
stays 0, V's falls): share-rule yields only follow admissions into free slots that left a tenant above its share
while another holds nothing, and a tenant takes slots this way only up to its share. Shares are counted in whole
slots on the victim's side, so when many tenants share the slots (a weight-1 tenant's share below one slot) a
tenant holding one slot never yields by this rule; an asker needs a share of at least its request. Gap rule: the
gap condition alone bounds preemptions between two tenants by their relative service (a reversal needs 2 * gap of
it; recompute charges nothing). Its share condition forbids the reversal outright until admissions into free slots
change the balance: for G (g slots) to come back, V would need (s_A + m - m') / w_A >= (s_V - g + g) / w_V for some
group of A of m' >= 1 slots, but (s_A + m) / w_A <= (s_V - g) / w_V < s_V / w_V; by the exception, V would hold
none, so g = s_V and m / w_A > s_V / w_V, the opposite of what let G go. Among tenants with equal shares, +-1 slot
of difference never moves a group.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

from loraplex.engine.sequence import SequenceGroup


def far_enough(lead: float, gap: float, share_rule: bool) -> bool:
    """The lead condition on a tenant ``lead`` counter units above a waiting one (slots or budget): more than
    ``gap``, or, under the share rule (module docstring), not negative."""
    return lead >= 0 if share_rule else lead > gap


class SlotYield:
    """The running groups of one scheduling step, per tenant, as slot-preemption candidates. Built once per step
    (O(running sequences)), the first time a waiting request lacks slots; ``admit`` counts the slots of groups
    admitted after that. ``share``: slots per unit of weight, ``max_num_seqs`` over the active tenants' weights."""

    def __init__(self, running: Iterable[SequenceGroup], gap: float, fresh: set[str], share: float) -> None:
        self.gap = gap
        self.share = share
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
        if not have and num_slots / weight <= self.share:
            chosen = self._plan(tenant, counter, (have + num_slots) / weight, have, shortfall, share_rule=True)
            if chosen:
                return chosen
        return self._plan(tenant, counter, (have + num_slots) / weight, have, shortfall, share_rule=False)

    def _plan(self, tenant: Hashable, counter: float, mine: float, have: int, shortfall: int,
              share_rule: bool) -> list[SequenceGroup]:
        chosen: list[SequenceGroup] = []
        freed = 0
        for victim in self._order:
            if not far_enough(self._counters[victim] - counter, self.gap, share_rule):
                break
            if victim == tenant:
                continue
            groups, held, w = self._groups[victim], self._slots[victim], self._weights[victim]
            above = math.ceil(self.share * w)  # the share rule: V's share in whole slots
            for g in reversed(groups):
                size = g.sampling_params.num_sequences
                if share_rule:
                    qualifies = held > above
                else:
                    qualifies = (held - size) / w >= mine or (not have and held / w > mine)
                if freed >= shortfall or not qualifies:
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
