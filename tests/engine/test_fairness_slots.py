"""Slot and budget yields of the tenant-fair policy on the pure scheduler (fake model). A light tenant holding no
slot is admitted at the schedule right after its arrival beside a heavy tenant whose n=8 request, or n=64 requests,
hold every sequence slot (or whose decodes fill the step budget), plain and with overlapped steps; a tenant with a
request running waits until the heavy tenant's counter leads by ``vtc_preempt_gap``. The heavy groups resume and
finish with the very tokens they get alone, nothing is preempted twice and no block leaks; FCFS and a gap of None
keep the old order (the light request waits for the slots to free). The planner's rules (gap, no gap for a tenant
holding nothing, weighted slot share, all or nothing, latest group first, no group admitted in the same step) and
random arrivals (every request finishes, every token charged once, with recompute, swap and overlapped steps)."""
from __future__ import annotations

from types import SimpleNamespace

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
GAP = 40.0  # heavy's 8 sequences add 8 * 2 = 16 per step: a gap of 40 is crossed in the third step


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


@pytest.mark.parametrize("gap", [GAP, DEFAULT_PREEMPT_GAP, 8 * 2 * HEAVY_TOKENS + 1.0])
def test_light_request_takes_slots_from_the_heavy_n8_request(gap):
    """Light is lifted level with heavy on arrival and holds no slot: whatever the gap (even one heavy's whole
    request never reaches), heavy's group yields in the schedule right after the arrival."""
    order, events, done, tokens, sched = heavy_beside_light("vtc", gap)
    alone = heavy_beside_light("vtc", gap, light=False)[3]
    assert order == ["light arrives", "heavy preempted", "light runs", "light finished", "heavy finished"]
    assert next(k for k, what in events if what == "light runs") == ARRIVAL
    assert done["light"] == ARRIVAL + LIGHT_TOKENS - 1 < done["heavy"]
    assert sched.num_slot_preemptions == 1 and sched.num_preemptions == 1
    assert tokens == alone  # the preempted group recomputes and continues losslessly


@pytest.mark.parametrize("policy, gap", [("fcfs", GAP), ("vtc", None)])
def test_without_slot_preemption_the_light_request_waits_for_the_slots(policy, gap):
    order, _, done, tokens, sched = heavy_beside_light(policy, gap)
    assert order == ["light arrives", "heavy finished", "light runs", "light finished"]
    assert sched.num_preemptions == 0 == sched.num_slot_preemptions
    assert tokens == heavy_beside_light(policy, gap, light=False)[3]


def light_running_run(gap: float | None, light: bool = True) -> SimpleNamespace:
    """Heavy's two n=4 requests and light's long one (60 tokens) fill max_num_seqs=9; light's short request arrives
    before step ARRIVAL, its tenant holding a slot. Returns ``leads`` {step: heavy's counter - light's before that
    step's schedule}, ``ran`` (the step light's short request is first scheduled), ``preempted`` {step: ids},
    heavy's ``tokens``, ``sched``."""
    sched = make(max_num_seqs=9, max_num_batched_tokens=64, num_blocks=256, vtc_preempt_gap=gap)
    heavy = [group("heavy", 8, HEAVY_TOKENS, n=4, rid=f"heavy-{i}", seed=i) for i in range(2)]
    for g in heavy:
        sched.add(g)
    sched.add(group("light", 4, 60, rid="light-long"))
    run = SimpleNamespace(leads={}, ran=None, preempted={}, sched=sched)
    k = 0
    while sched.has_unfinished():
        if k == ARRIVAL and light:
            sched.add(group("light", 4, LIGHT_TOKENS, rid="light"))
        if all(sched.counters.get(t) for t in ("heavy", "light")):
            run.leads[k] = sched.counters.get("heavy").counter - sched.counters.get("light").counter
        out = sched.schedule()
        if out.preempted:
            run.preempted[k] = list(out.preempted)
        if run.ran is None and any(s.seq.request_id == "light" for s in out.scheduled):
            run.ran = k
        step(sched, out)
        sched.kv.check_invariants()
        k += 1
        assert k < 1000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    run.tokens = [sorted(tuple(s.output_token_ids) for s in g.seqs) for g in heavy]
    return run


def test_a_tenant_with_a_request_running_waits_for_the_gap():
    """Light holds a slot, so the gap applies: heavy (8 slots, 16 a step) leads light (1 slot, 2 a step) by 14 more
    each step; heavy's latest group yields in the first step that starts with a lead over the gap, not before, and
    only once (the share rule: heavy keeps 4 >= light's 2). With a gap heavy never reaches, light's short request
    waits for heavy's slots to free."""
    gap = 100.0
    run = light_running_run(gap)
    crossed = next(k for k in sorted(run.leads) if k >= ARRIVAL and run.leads[k] > gap)
    assert crossed > ARRIVAL and run.leads[crossed - 1] <= gap  # a real wait: the gap decides
    assert run.ran == crossed and run.preempted == {crossed: ["heavy-1"]}
    assert run.sched.num_slot_preemptions == 1 and run.sched.num_budget_yields == 0
    assert run.tokens == light_running_run(gap, light=False).tokens
    never = light_running_run(8 * 2 * HEAVY_TOKENS + 1.0)
    assert never.preempted == {} and never.ran >= HEAVY_TOKENS  # heavy's groups free their slots after 40 steps


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
    """No slot is short, the budget is, and heavy's decodes fill it: light (holding no slot) takes the entries of
    heavy's latest decodes for its prompt right after its arrival, then light's decodes go first (smallest
    counter) while the budget cannot hold all of them."""
    events, done, tokens, sched = budget_run("vtc", GAP)
    order = [what for _, what in events]
    assert order == ["light arrives", "light runs", "light finished", "heavy finished"]
    ran = next(k for k, what in events if what == "light runs")
    assert ran == ARRIVAL and done["light"] - ran == LIGHT_TOKENS - 1
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


def test_two_backlogged_tenants_share_the_slots_without_thrashing():
    """b arrives holding nothing while a's n=4 groups hold all 8 slots: a's latest group yields at once, whatever
    the gap. From then on each holds 4; slots a finished request frees go to the smaller counter plus this step's
    decodes, which holds 4 and takes 4, so neither is left with nothing: no further yield, and the lead stays within
    one step's service (8 decodes and one admitted prompt). Without yields (gap None) b waits for a's groups to
    finish and the lead grows to a request's length of service."""
    step_cost = 8 * 2.0 + 6 * 1.0
    runs = {gap: backlogged_pair(gap) for gap in (0.0, 16.0, 64.0, DEFAULT_PREEMPT_GAP, None)}
    for gap in (0.0, 16.0, 64.0, DEFAULT_PREEMPT_GAP):
        assert runs[gap][0] == 1 and runs[gap][1] <= step_cost
    assert runs[None] == (0, runs[None][1]) and runs[None][1] > 64.0 + step_cost


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


def test_planner_gap_rule():
    """A share of 0.2 slots per weight (say 8 slots, active weights summing to 40): no request here is within its
    tenant's share, so the gap rule decides."""
    counters = VirtualTokenCounters()
    groups = running_groups(counters, [("h", 2, 1.0), ("m", 1, 1.0), ("h", 2, 1.0), ("h", 1, 1.0), ("m", 2, 1.0)])
    counters.get("h").counter, counters.get("m").counter = 100.0, 60.0
    plan = SlotYield(groups, gap=30.0, fresh=set(), share=0.2)
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
    assert [g.request_id for g in SlotYield(whole, 30.0, set(), 0.2).plan("new", 0.0, 1.0, 1, 1)] == ["x0"]
    assert SlotYield(whole, 30.0, set(), 0.2).plan("y", 0.0, 1.0, 1, 1) == []
    # fresh groups (admitted this step) are never candidates; take() removes planned ones
    plan = SlotYield(groups, gap=30.0, fresh={"h3"}, share=0.2)
    chosen = plan.plan("light", 0.0, 1.0, 1, 1)
    assert [g.request_id for g in chosen] == ["h2"]
    plan.take(chosen)
    assert [g.request_id for g in plan.plan("light", 0.0, 1.0, 1, 1)] == ["h0"]


def test_planner_share_rule():
    """A share of 2 slots per weight (say 8 slots, active weights summing to 4): a tenant holding nothing that asks
    at most 2 slots per weight takes them, with no gap, from tenants at or above its counter that hold more than
    2 per weight, each down to its share (h holds 5, m 3)."""
    counters = VirtualTokenCounters()
    groups = running_groups(counters, [("h", 2, 1.0), ("m", 1, 1.0), ("h", 2, 1.0), ("h", 1, 1.0), ("m", 2, 1.0)])
    counters.get("h").counter, counters.get("m").counter = 100.0, 60.0
    plan = SlotYield(groups, gap=30.0, fresh=set(), share=2.0)
    assert [g.request_id for g in plan.plan("light", 100.0, 1.0, 1, 1)] == ["h3"]  # level with h: no gap needed
    assert plan.plan("light", 100.5, 1.0, 1, 1) == []  # above everyone
    # h yields while it holds more than 2: h3 and h2 (then it holds 2); m, 60 >= 60, gives m4 (it holds 3)
    assert [g.request_id for g in plan.plan("light", 60.0, 1.0, 2, 2)] == ["h3", "h2"]
    assert [g.request_id for g in plan.plan("light", 60.0, 1.0, 2, 4)] == ["h3", "h2", "m4"]
    assert plan.plan("light", 60.0, 1.0, 2, 6) == []  # all or nothing
    # beyond its share (3 > 2) the gap rule decides: h is 25 above, not more than the gap of 30
    assert [g.request_id for g in plan.plan("light", 75.0, 1.0, 2, 1)] == ["h3"]
    assert plan.plan("light", 75.0, 1.0, 3, 1) == []
    assert [g.request_id for g in plan.plan("big", 75.0, 2.0, 3, 1)] == ["h3"]  # 3 over weight 2 is within it
    # a tenant holding slots never gets the share rule: m (3 slots) 20 below h waits for the gap
    assert plan.plan("m", 80.0, 1.0, 1, 1) == []
    # nobody above the share: the gap rule still applies (h 80 above, the exception for a tenant holding none)
    high = SlotYield(groups, gap=30.0, fresh=set(), share=5.0)
    assert [g.request_id for g in high.plan("light", 20.0, 1.0, 1, 1)] == ["h3"]
    assert high.plan("light", 75.0, 1.0, 1, 1) == []


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


# ---- a tenant with nothing running beside n=64 groups holding every slot -----------------------------------------
FLOOD_N, FLOOD_PROMPT, FLOOD_TOKENS = 64, 12, 24
NEW_PROMPT, NEW_TOKENS, NEW_ARRIVAL = 16, 4, 3


def flood_run(light: bool, budget: int = 256, max_num_seqs: int = 2 * FLOOD_N) -> SimpleNamespace:
    """Heavy floods with four n=64 requests; a new light tenant's one-sequence request arrives before step
    NEW_ARRIVAL, at the default gap (heavy's 128 decodes add 256 a step: the gap alone would hold it for 4
    steps). Returns ``preempted`` {step: request ids}, ``light_steps`` [(step, tokens scheduled for light)],
    ``done`` {request id: step it finished}, ``tokens`` {heavy request id: its tokens}, ``at_arrival`` (slots
    held, sequences waiting) just before light's arrival, ``sched``."""
    sched = make(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_blocks=2048)
    heavy = [group("heavy", FLOOD_PROMPT, FLOOD_TOKENS, n=FLOOD_N, rid=f"heavy-{i}", seed=i) for i in range(4)]
    for g in heavy:
        sched.add(g)
    run = SimpleNamespace(preempted={}, light_steps=[], done={}, at_arrival=None, sched=sched)
    k = 0
    while sched.has_unfinished():
        if k == NEW_ARRIVAL and light:
            run.at_arrival = (sched._num_reserved_seqs(), sched.num_waiting)
            sched.add(group("light", NEW_PROMPT, NEW_TOKENS, rid="light"))
        out = sched.schedule()
        if out.preempted:
            run.preempted[k] = list(out.preempted)
        run.light_steps += [(k, s.num_new_tokens) for s in out.scheduled if s.seq.request_id == "light"]
        for g in step(sched, out):
            run.done[g.request_id] = k
        sched.kv.check_invariants()
        k += 1
        assert k < 1000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks  # nothing leaked
    run.tokens = {g.request_id: sorted(tuple(s.output_token_ids) for s in g.seqs) for g in heavy}
    assert all(len(t) == FLOOD_N and all(len(x) == FLOOD_TOKENS for x in t) for t in run.tokens.values())
    return run


def test_a_new_tenant_is_admitted_beside_n64_groups_at_the_next_schedule():
    """Two of heavy's n=64 groups hold all 128 slots, two wait. The light tenant holds no slot: heavy's latest
    running group yields at once (no gap for a tenant with nothing running), light's whole prompt is scheduled in
    the schedule() right after its arrival, and nothing is preempted again: heavy's group recomputes once light's
    slot is free, light never yields back."""
    run = flood_run(True)
    assert run.at_arrival == (2 * FLOOD_N, 2)
    assert run.light_steps[0] == (NEW_ARRIVAL, NEW_PROMPT)
    assert [k for k, _ in run.light_steps] == list(range(NEW_ARRIVAL, NEW_ARRIVAL + NEW_TOKENS))  # a token a step
    assert run.preempted == {NEW_ARRIVAL: ["heavy-1"]}  # one group, once, the latest; light never preempted
    sched = run.sched
    assert sched.num_slot_preemptions == 1 == sched.num_preemptions and sched.num_budget_yields == 0
    assert run.done["light"] == NEW_ARRIVAL + NEW_TOKENS - 1 < run.done["heavy-0"]
    assert run.tokens == flood_run(False).tokens  # heavy's seeded tokens: the yielded group recomputes losslessly


def test_a_new_tenant_takes_the_budget_of_n64_decodes_at_the_next_schedule():
    """One n=64 group runs in 65 slots (one to spare), three wait; the budget is exactly its 64 decodes. Light's
    prompt takes their entries at once (budget yield, nothing preempted); then light's decode goes first (smallest
    counter) while the budget cannot hold all decodes."""
    run = flood_run(True, budget=FLOOD_N, max_num_seqs=FLOOD_N + 1)
    assert run.at_arrival == (FLOOD_N, 3)
    assert run.light_steps[0] == (NEW_ARRIVAL, NEW_PROMPT)
    assert [k for k, _ in run.light_steps] == list(range(NEW_ARRIVAL, NEW_ARRIVAL + NEW_TOKENS))
    sched = run.sched
    assert sched.num_budget_yields == NEW_PROMPT and sched.num_preemptions == 0 and not run.preempted
    assert run.tokens == flood_run(False, budget=FLOOD_N, max_num_seqs=FLOOD_N + 1).tokens


def overlapped_flood(arrival: int | None) -> SimpleNamespace:
    """Heavy's eight plain requests hold all 8 slots and decode in overlapped steps (a step in flight while the
    next is scheduled); light's request arrives before step ``arrival`` (None: never). Returns ``outs`` [(output, a
    step was in flight)], heavy's ``tokens``, the ``ledger`` and ``sched``."""
    sched = make(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=256)
    heavy = [group("heavy", 8, 30, rid=f"heavy-{i}", seed=i) for i in range(8)]
    arrivals = {0: heavy}
    if arrival is not None:
        arrivals[arrival] = [group("light", NEW_PROMPT, NEW_TOKENS, rid="light")]
    run = SimpleNamespace(outs=[], ledger=Ledger(), sched=sched)
    overlapped_run(sched, run.ledger, arrivals, run.outs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    run.tokens = [g.seqs[0].output_token_ids for g in heavy]
    return run


def test_a_yield_decided_while_a_step_is_in_flight_takes_effect_at_that_schedule():
    """Light arrives before a schedule planned while heavy's previous decode step is in flight: heavy's latest
    request yields its slot there (its pending token resolves into the preempted sequence, which recomputes), light's
    whole prompt is in that very step, nothing else is ever preempted, every token is charged once and heavy's
    tokens are those of its run without light."""
    alone = overlapped_flood(None)
    arrival = next(k for k, (_, in_flight) in enumerate(alone.outs) if in_flight)
    run = overlapped_flood(arrival)
    out, in_flight = run.outs[arrival]
    assert in_flight and out.preempted == ["heavy-7"]
    assert [s.num_new_tokens for s in out.scheduled if s.seq.request_id == "light"] == [NEW_PROMPT]
    assert [o.preempted for o, _ in run.outs if o.preempted] == [["heavy-7"]]
    assert sum(flag for _, flag in run.outs[arrival + 1:]) > 0  # overlapped steps after the yield too
    sched = run.sched
    assert sched.num_slot_preemptions == 1 == sched.num_preemptions
    assert run.ledger.output == {"heavy": 8 * 30, "light": NEW_TOKENS}
    assert run.ledger.input == {"heavy": 8 * 8, "light": NEW_PROMPT}  # the recompute charged nothing
    assert run.tokens == alone.tokens
