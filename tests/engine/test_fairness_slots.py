"""Slot preemption of the tenant-fair policy on the pure scheduler (fake model): a light tenant's request beside a
heavy tenant's n=8 request that holds every sequence slot is admitted once the heavy tenant's counter leads by
``vtc_preempt_gap``; the heavy group resumes and finishes with the very tokens it gets alone and no block leaks;
FCFS and a gap of None keep the old order (the light request waits for the slots to free). The planner's rules
(gap, weighted slot share, all or nothing, latest group first, no group admitted in the same step) and random
arrivals (every request finishes, every token charged once, with recompute, swap and overlapped steps)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplex.engine.fairness import DEFAULT_PREEMPT_GAP, VirtualTokenCounters
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import SchedulerConfig
from loraplex.engine.sequence import SequenceGroup
from loraplex.engine.slot_yield import SlotYield
from tests.engine.test_fairness import PROPERTY, Ledger, group, make, overlapped_run, step

HEAVY_TOKENS, LIGHT_TOKENS, ARRIVAL = 40, 4, 3
GAP = 40.0  # heavy's 8 sequences add 8 * 2 = 16 per step: the gap is crossed in the third step after the arrival


def heavy_beside_light(policy: str, gap: float | None, light: bool = True):
    """Heavy: one n=8 request filling max_num_seqs=8; light: one request added before step ARRIVAL. Returns
    (events: (step, what) in order, {request id: step it finished}, heavy's output tokens, the scheduler)."""
    sched = make(policy, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=256, vtc_preempt_gap=gap)
    free_at_start = sched.kv.num_free_blocks
    heavy = group("heavy", 8, HEAVY_TOKENS, n=8, rid="heavy")
    sched.add(heavy)
    events: list[tuple[int, str]] = []
    done: dict[str, int] = {}
    k = 0
    while sched.has_unfinished():
        if k == ARRIVAL and light:
            sched.add(group("light", 4, LIGHT_TOKENS, rid="light"))
            events.append((k, "light arrives"))
        out = sched.schedule()
        events += [(k, f"{rid} preempted") for rid in out.preempted]
        if any(s.seq.request_id == "light" for s in out.scheduled) and not any(e[1] == "light runs" for e in events):
            events.append((k, "light runs"))
        for g in step(sched, out):
            done[g.request_id] = k
            events.append((k, f"{g.request_id} finished"))
        sched.kv.check_invariants()
        k += 1
        assert k < 1000
    assert sched.kv.num_free_blocks == free_at_start == sched.kv.num_blocks  # nothing leaked
    tokens = sorted(tuple(s.output_token_ids) for s in heavy.seqs)
    assert len(tokens) == 8 and all(len(t) == HEAVY_TOKENS for t in tokens)
    return [what for _, what in events], events, done, tokens, sched


def test_light_request_takes_slots_from_the_heavy_n8_request():
    order, events, done, tokens, sched = heavy_beside_light("vtc", GAP)
    alone = heavy_beside_light("vtc", GAP, light=False)[3]
    assert order == ["light arrives", "heavy preempted", "light runs", "light finished", "heavy finished"]
    ran = next(k for k, what in events if what == "light runs")
    # light is lifted to heavy's counter on arrival; heavy gains 16 per step: the gap of 40 is crossed within
    # ceil(40 / 16) steps, and light runs in the step it is crossed
    assert ran - ARRIVAL <= -(-GAP // 16) + 1
    assert done["light"] - ran == LIGHT_TOKENS - 1 and done["light"] < done["heavy"]
    assert sched.num_slot_preemptions == 1 and sched.num_preemptions == 1
    assert tokens == alone  # the preempted group recomputes and continues losslessly


@pytest.mark.parametrize("policy, gap", [("fcfs", GAP), ("vtc", None)])
def test_without_slot_preemption_the_light_request_waits_for_the_slots(policy, gap):
    order, _, done, tokens, sched = heavy_beside_light(policy, gap)
    assert order == ["light arrives", "heavy finished", "light runs", "light finished"]
    assert sched.num_preemptions == 0 == sched.num_slot_preemptions
    assert tokens == heavy_beside_light(policy, gap, light=False)[3]


def test_a_gap_not_yet_reached_preempts_nothing():
    """The heavy request runs 40 tokens: its counter lead over the light tenant never exceeds 8 * 2 * 40."""
    order, _, _, _, sched = heavy_beside_light("vtc", 8 * 2 * HEAVY_TOKENS + 1.0)
    assert order[:2] == ["light arrives", "heavy finished"] and sched.num_slot_preemptions == 0


def budget_run(policy: str, gap: float | None, light: bool = True):
    """Heavy's n=8 request decodes 8 tokens a step in a budget of 8 (slots to spare); light arrives before step
    ARRIVAL. Returns (order of events, {request id: step it finished}, heavy's tokens, the scheduler)."""
    sched = make(policy, max_num_seqs=16, max_num_batched_tokens=8, num_blocks=256, vtc_preempt_gap=gap)
    heavy = group("heavy", 8, HEAVY_TOKENS, n=8, rid="heavy")
    sched.add(heavy)
    events: list[tuple[int, str]] = []
    done: dict[str, int] = {}
    k = 0
    while sched.has_unfinished():
        if k == ARRIVAL and light:
            sched.add(group("light", 4, LIGHT_TOKENS, rid="light"))
            events.append((k, "light arrives"))
        out = sched.schedule()
        if any(s.seq.request_id == "light" for s in out.scheduled) and not any(e[1] == "light runs" for e in events):
            events.append((k, "light runs"))
        for g in step(sched, out):
            done[g.request_id] = k
            events.append((k, f"{g.request_id} finished"))
        sched.kv.check_invariants()
        k += 1
        assert k < 1000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and sched.num_preemptions == 0
    return events, done, sorted(tuple(s.output_token_ids) for s in heavy.seqs), sched


def test_light_request_takes_budget_from_the_heavy_decodes():
    """No slot is short, the budget is: once heavy leads by the gap its latest decodes wait a step for light's
    prompt, then light's decodes go first (smallest counter) while the budget cannot hold all of them."""
    events, done, tokens, sched = budget_run("vtc", GAP)
    order = [what for _, what in events]
    assert order == ["light arrives", "light runs", "light finished", "heavy finished"]
    ran = next(k for k, what in events if what == "light runs")
    assert ran - ARRIVAL <= -(-GAP // 16) + 1 and done["light"] - ran == LIGHT_TOKENS - 1
    assert sched.num_budget_yields == 4  # light's 4 prompt tokens, once
    assert tokens == budget_run("vtc", GAP, light=False)[2]


@pytest.mark.parametrize("policy, gap", [("fcfs", GAP), ("vtc", None)])
def test_without_the_gap_knob_heavy_decodes_keep_the_budget(policy, gap):
    events, done, tokens, sched = budget_run(policy, gap)
    assert [what for _, what in events] == ["light arrives", "heavy finished", "light runs", "light finished"]
    assert sched.num_budget_yields == 0


def backlogged_pair(gap: float | None) -> tuple[int, float]:
    """Tenant a's six n=4 requests fill the 8 slots, then b's six arrive: (slot preemptions, the largest counter
    lead between them while both have requests waiting)."""
    sched = make(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=512, vtc_preempt_gap=gap)
    for i in range(6):
        sched.add(group("a", 6, 12, n=4, rid=f"a{i}", seed=i))
    lead = 0.0
    k = 0
    while sched.has_unfinished():
        if k == 2:
            for i in range(6):
                sched.add(group("b", 6, 12, n=4, rid=f"b{i}", seed=10 + i))
        step(sched, sched.schedule())
        loads = sched.tenant_loads()
        if all(loads.get(t, {}).get("waiting") for t in "ab"):
            lead = max(lead, abs(sched.counters.get("a").counter - sched.counters.get("b").counter))
        k += 1
        assert k < 1000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return sched.num_slot_preemptions, lead


def test_two_backlogged_tenants_stay_within_the_gap_without_thrashing():
    """Slots freed by a finished request go to the smaller counter (plain VTC), which may then hold all 8; the
    other falls behind and takes a group back once the lead passes the gap. The lead stays within the gap plus
    one step's service (8 decodes and one admitted prompt); without slot preemption it grows to a request's
    length of service. A larger gap trades lead for fewer preemptions, never more than one per request."""
    step_cost = 8 * 2.0 + 6 * 1.0
    runs = {gap: backlogged_pair(gap) for gap in (16.0, 64.0, None)}
    for gap in (16.0, 64.0):
        assert runs[gap][1] <= gap + step_cost
    assert runs[None] == (0, runs[None][1]) and runs[None][1] > 64.0 + step_cost
    assert 1 <= runs[64.0][0] < runs[16.0][0] <= 12


def test_config_knob():
    assert SchedulerConfig().vtc_preempt_gap == DEFAULT_PREEMPT_GAP
    assert SchedulerConfig(vtc_preempt_gap=None).vtc_preempt_gap is None
    for bad in (-1.0, float("inf"), True, "7"):
        with pytest.raises(ValueError, match="vtc_preempt_gap must be None"):
            SchedulerConfig(vtc_preempt_gap=bad)


# ---- the planner ------------------------------------------------------------------------------------------------
def running_groups(counters: VirtualTokenCounters, spec: list[tuple[str, int, float]]) -> list[SequenceGroup]:
    """Groups in arrival order from (tenant, num_sequences, weight); each tenant's counter set by the caller."""
    groups = []
    for i, (tenant, n, weight) in enumerate(spec):
        g = SequenceGroup.from_prompt(f"{tenant}{i}", [1, 2, 3], SamplingParams(n=n, temperature=1.0, max_tokens=4),
                                      arrival_time=float(i), tenant=tenant, weight=weight)
        g.tenant_state = counters.activate(tenant, weight)
        groups.append(g)
    return groups


def test_planner_rules():
    counters = VirtualTokenCounters()
    groups = running_groups(counters, [("h", 2, 1.0), ("m", 1, 1.0), ("h", 2, 1.0), ("h", 1, 1.0), ("m", 2, 1.0)])
    counters.get("h").counter, counters.get("m").counter = 100.0, 60.0
    plan = SlotYield(groups, gap=30.0, fresh=set())
    # latest groups of the largest counter first: h3 then h2
    assert [g.request_id for g in plan.plan("light", 20.0, 1.0, 2, 2)] == ["h3", "h2"]
    # gap: m (40 above) qualifies, h (80 above) too; at 50 only h does
    assert [g.request_id for g in plan.plan("light", 50.0, 1.0, 1, 1)] == ["h3"]
    assert plan.plan("light", 70.0, 1.0, 1, 1) == []  # 30 below h: not more than the gap
    # share: h holds 5, m 3. A request of 4 for a tenant holding none: h gives h3 (keeps 4 >= 4), not h2 too
    # (would keep 2 < 4, and holds 4, not more than 4); m gives nothing: 1 of 4 slots, so nothing at all
    assert plan.plan("light", 0.0, 1.0, 4, 4) == []
    assert plan.plan("m", 60.0, 1.0, 2, 2) == []  # m would hold 3 + 2 = 5, h keep 4: no overshoot
    assert [g.request_id for g in plan.plan("light", 0.0, 1.0, 4, 1)] == ["h3"]  # 3 of them free already
    # weight: a tenant of weight 4 asking for 1 counts 1/4 against h's slots over weight 1
    assert [g.request_id for g in plan.plan("big", 0.0, 4.0, 1, 3)] == ["h3", "h2"]
    # one whole group holding every slot yields to a tenant with nothing running, not to one with a request running
    lone = VirtualTokenCounters()
    whole = running_groups(lone, [("x", 4, 1.0), ("y", 1, 1.0)])
    lone.get("x").counter = 100.0
    assert [g.request_id for g in SlotYield(whole, 30.0, set()).plan("new", 0.0, 1.0, 1, 1)] == ["x0"]
    assert SlotYield(whole, 30.0, set()).plan("y", 0.0, 1.0, 1, 1) == []
    # fresh groups (admitted this step) are never candidates; take() removes planned ones
    plan = SlotYield(groups, gap=30.0, fresh={"h3"})
    chosen = plan.plan("light", 0.0, 1.0, 1, 1)
    assert [g.request_id for g in chosen] == ["h2"]
    plan.take(chosen)
    assert [g.request_id for g in plan.plan("light", 0.0, 1.0, 1, 1)] == ["h0"]


# ---- random arrivals ---------------------------------------------------------------------------------------------
ARRIVAL_SPEC = st.tuples(st.integers(0, 60), st.sampled_from(["a", "b", "c"]), st.integers(1, 16),
                         st.integers(1, 10), st.sampled_from([1, 1, 2, 3]))


@PROPERTY
@given(arrivals=st.lists(ARRIVAL_SPEC, min_size=6, max_size=30), mode=st.sampled_from(["recompute", "swap"]),
       gap=st.sampled_from([0.0, 8.0, 64.0]), overlap=st.booleans(), num_blocks=st.integers(28, 64),
       budget=st.sampled_from([3, 24]))
def test_slot_preemption_finishes_everything_and_charges_once(arrivals, mode, gap, overlap, num_blocks, budget):
    """Tenants compete for 4 sequence slots with slot preemption on (a gap of 0 preempts as often as the rules
    allow), in a pool tight enough for block preemption too, and a budget of 24 or of 3 (fewer than the
    decodes: budget yields and decodes by counter): every request finishes with all its tokens, each
    tenant record is charged exactly the prompts and outputs of the requests it was charged for (once: recompute
    and swap-in charge nothing), no block leaks."""
    sched = make(max_num_seqs=4, max_num_batched_tokens=budget, num_blocks=num_blocks, block_size=4, num_cpu_blocks=24,
                 preemption_mode=mode, max_model_len=64, vtc_preempt_gap=gap)
    by_step: dict[int, list[SequenceGroup]] = {}
    groups = []
    for idx, (at, tenant, plen, mtok, n) in enumerate(arrivals):
        g = group(tenant, plen, mtok, n=n, seed=idx, rid=f"r{idx}")
        if n * sched.kv.num_blocks_for(plen + mtok) > num_blocks:
            continue
        by_step.setdefault(at, []).append(g)
        groups.append(g)
    ledger = Ledger()
    if overlap:
        overlapped_run(sched, ledger, by_step)
    else:
        k = 0
        while k <= max(by_step, default=0) or sched.has_unfinished():
            for g in by_step.get(k, []):
                sched.add(g)
            k += 1
            if sched.has_unfinished():
                out = sched.schedule()
                assert not out.is_empty, "scheduler stalled with unfinished requests"
                step(sched, out, ledger)
                sched.kv.check_invariants()
            assert k < 20_000
    for g in groups:
        assert g.is_finished() and all(s.num_output_tokens == g.sampling_params.max_tokens for s in g.seqs)
    states = {id(g.tenant_state): g.tenant_state for g in groups}  # a record forgotten while idle is made anew
    for key, state in states.items():
        mine = [g for g in groups if id(g.tenant_state) == key]
        assert state.input_tokens == sum(g.seqs[0].num_prompt_tokens for g in mine)
        assert state.output_tokens == sum(s.num_output_tokens for g in mine for s in g.seqs)
    for tenant in {g.tenant for g in groups}:
        assert ledger.output[tenant] == sum(s.num_output_tokens for g in groups if g.tenant == tenant for s in g.seqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
