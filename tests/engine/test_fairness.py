"""The tenant-fair (VTC) policy on the pure scheduler, driven by a fake model: counters and their lift, weighted
shares of backlogged tenants, no starvation, single-tenant VTC == FCFS, preemption victims, and every token
charged once under recompute, swap and overlapped (pending-token) steps. Property tests use hypothesis,
derandomized, no example database.

Bounds checked (engine/fairness.py, engine/scheduler.py):
  - backlogged tenants' normalised service (cost / weight) never differs by more than
    GAP = max_num_seqs * R_max / w_min, R_max = w_in * max prompt + w_out * max_tokens (one request's cost): a
    tenant is admitted only while its counter is the smallest, and then holds at most max_num_seqs requests
  - service shares after a run differ from weight / sum(weights) by at most 2 * GAP * sum(w) / total service
    (the bound that follows from the gap) and by at most SHARE_TOLERANCE: 2% after 300 steps, 1% after 3,000
    (observed: at most 0.34% and 0.02%)
"""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.fairness import TenantHeap, VirtualTokenCounters
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.scheduler_output import SchedulerOutput
from loraplex.engine.sequence import SequenceGroup, SequenceStatus

EOS = 0
W_IN, W_OUT = 1.0, 2.0
SHARE_TOLERANCE = {300: 0.02, 3000: 0.01}  # steps -> largest share error allowed
PROPERTY = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
SHARES = settings(PROPERTY, max_examples=30)  # 300 steps each
_ids = itertools.count()


def fake_token(token_ids: list[int]) -> int:
    """The 'model': a function of the stream (a recomputed sequence continues as before); never EOS (0)."""
    return 1 + (sum((i + 1) * t for i, t in enumerate(token_ids)) * 7919) % 997


def make(policy="vtc", num_blocks=512, block_size=4, num_cpu_blocks=0, **cfg) -> Scheduler:
    cfg.setdefault("eos_token_ids", [EOS])
    cfg.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(policy=policy, **cfg), KVCacheManager(num_blocks, block_size,
                                                                            num_cpu_blocks=num_cpu_blocks))


def group(tenant, prompt_len=8, max_tokens=4, weight=1.0, rid=None, n=1, arrival=None, seed=0) -> SequenceGroup:
    rng = random.Random(seed * 1000 + prompt_len)
    prompt = [rng.randrange(1, 997) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    return SequenceGroup.from_prompt(rid or f"{tenant}-{next(_ids)}", prompt, params,
                                     arrival_time=float(next(_ids)) if arrival is None else arrival,
                                     tenant=tenant, weight=weight)


class Ledger:
    """Independent accounting of the service each tenant received, from the steps themselves: prompt positions
    computed for the first time (per request) and output tokens appended."""

    def __init__(self) -> None:
        self.input: dict = {}
        self.output: dict = {}
        self._prompt_hw: dict[str, int] = {}

    def cost(self, tenant, weight=1.0) -> float:
        return (W_IN * self.input.get(tenant, 0) + W_OUT * self.output.get(tenant, 0)) / weight

    def prompt(self, seq, tenant, start: int, end: int) -> None:
        covered = min(end, seq.num_prompt_tokens)
        hw = self._prompt_hw.get(seq.request_id, 0)
        if covered > hw:
            self.input[tenant] = self.input.get(tenant, 0) + covered - hw
            self._prompt_hw[seq.request_id] = covered

    def outputs(self, tenant, n: int) -> None:
        self.output[tenant] = self.output.get(tenant, 0) + n


def step(sched: Scheduler, out: SchedulerOutput, ledger: Ledger | None = None) -> list[SequenceGroup]:
    """Check the step as the runner would use it, sample where asked, update."""
    sampled = {}
    for s in out.scheduled:
        seq = s.seq
        assert s.num_new_tokens >= 1 and seq.num_computed_tokens + s.num_new_tokens <= seq.num_tokens
        assert s.block_ids == seq.block_ids
        group = sched.get_group(seq.request_id)
        if ledger is not None:
            ledger.prompt(seq, group.tenant, seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens)
        if s.sample:
            toks = [fake_token(seq.all_token_ids + [k]) for k in range(s.num_samples)]
            sampled[seq.seq_id] = toks if s.num_samples > 1 else toks[0]
            if ledger is not None:
                ledger.outputs(group.tenant, s.num_samples)
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    return sched.update(out, sampled)


def drain(sched: Scheduler, max_steps=20_000, ledger: Ledger | None = None) -> dict[str, int]:
    """Run to completion; {request id: step it finished}."""
    done = {}
    for k in range(max_steps):
        if not sched.has_unfinished():
            return done
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with unfinished requests"
        for g in step(sched, out, ledger):
            done[g.request_id] = k
        sched.kv.check_invariants()
    raise AssertionError("requests did not finish")


# ---- counters --------------------------------------------------------------------------------------------------
def test_counters_charge_lift_and_forget():
    c = VirtualTokenCounters(input_weight=1.0, output_weight=2.0)
    a = c.activate("a", 2.0)
    a.charge_input(10)
    a.charge_output(5)
    assert a.counter == pytest.approx((10 + 2 * 5) / 2) and (a.input_tokens, a.output_tokens) == (10, 5)
    b = c.activate("b", 1.0)
    assert b.counter == a.counter == c.floor()  # a newcomer starts at the smallest active counter, not 0
    b.charge_output(50)
    c.deactivate(a)
    assert c.floor() == b.counter and c.num_active == 1
    a2 = c.activate("a", 2.0)  # back from idle: lifted to the floor, its idle time is not banked
    assert a2 is a and a.counter == b.counter
    c.deactivate(a2)
    c.deactivate(b)
    assert c.num_active == 0 and c.floor() == b.counter  # none active: the last one to leave sets the floor
    late = c.activate("late", 1.0)
    assert late.counter == b.counter
    with pytest.raises(ValueError, match="input_weight must be a finite number > 0"):
        VirtualTokenCounters(input_weight=0)
    with pytest.raises(ValueError, match="tenant weight must be a number in"):
        SequenceGroup.from_prompt("x", [1], SamplingParams(), weight=0)


def test_counters_keep_bounded_records_of_idle_tenants():
    c = VirtualTokenCounters()
    hot = c.activate("hot", 1.0)
    for i in range(5000):
        s = c.activate(f"t{i}", 1.0)
        c.deactivate(s)   # gone at the floor: forgetting it changes nothing (it would be lifted anyway)
        hot.charge_output(1)
    assert len(c.snapshot()) < 600
    assert c.get("hot") is hot


def test_tenant_heap_reranks_stale_entries():
    counters = {"a": 0.0, "b": 1.0, "c": 2.0}
    heap = TenantHeap(lambda t: None if counters[t] is None else (counters[t], t))
    for t in counters:
        heap.push(t)
    counters["a"] = 5.0   # grew since it was pushed: the heap must not trust its old entry
    assert heap.peek() == ((1.0, "b"), "b")
    counters["b"] = None  # nothing waiting any more
    assert heap.peek() == ((2.0, "c"), "c")
    assert heap.peek(exclude={"c"}) == ((5.0, "a"), "a")


def test_config_validation():
    with pytest.raises(ValueError, match="policy must be one of fcfs, vtc"):
        SchedulerConfig(policy="lottery")
    with pytest.raises(ValueError, match="vtc_output_weight must be a finite number > 0"):
        SchedulerConfig(vtc_output_weight=-1)
    assert SchedulerConfig().policy == "vtc"


# ---- shares ----------------------------------------------------------------------------------------------------
def backlogged_run(weights: list[float], steps: int, seed: int, max_num_seqs=6, max_prompt=20, max_tokens=12,
                   num_blocks=512):
    """Every tenant keeps requests waiting (more unfinished than sequence slots) for ``steps`` steps; returns
    (ledger, worst normalised gap, {tenant: cost served})."""
    sched = make(max_num_seqs=max_num_seqs, max_num_batched_tokens=32, num_blocks=num_blocks, block_size=4)
    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(len(weights))]
    weight = dict(zip(tenants, weights))
    pending = {t: 0 for t in tenants}
    owner: dict[str, str] = {}
    ledger = Ledger()
    worst = 0.0
    for _ in range(steps):
        for t in tenants:
            while pending[t] < max_num_seqs + 3:
                g = group(t, rng.randint(2, max_prompt), rng.randint(1, max_tokens), weight[t], seed=rng.random())
                sched.add(g)
                owner[g.request_id] = t
                pending[t] += 1
        out = sched.schedule()
        assert not out.is_empty
        for g in step(sched, out, ledger):
            pending[owner[g.request_id]] -= 1
        norm = [ledger.cost(t, weight[t]) for t in tenants]
        worst = max(worst, max(norm) - min(norm))
    return ledger, worst, {t: ledger.cost(t) for t in tenants}


@SHARES
@given(weights=st.lists(st.sampled_from([1.0, 2.0, 3.0, 4.0]), min_size=2, max_size=4),
       seed=st.integers(0, 10_000))
def test_backlogged_tenants_share_by_weight(weights, seed):
    max_num_seqs, max_prompt, max_tokens = 6, 20, 12
    ledger, worst, served = backlogged_run(weights, 300, seed, max_num_seqs, max_prompt, max_tokens)
    gap = max_num_seqs * (W_IN * max_prompt + W_OUT * max_tokens) / min(weights)
    assert worst <= gap
    total = sum(served.values())
    tolerance = min(2 * gap * sum(weights) / total, SHARE_TOLERANCE[300])
    for (t, cost), w in zip(served.items(), weights):
        assert abs(cost / total - w / sum(weights)) <= tolerance, (t, cost / total, w / sum(weights))


def test_shares_converge_to_weights_in_a_long_run():
    weights = [1.0, 2.0, 4.0]
    ledger, worst, served = backlogged_run(weights, 3000, seed=7)
    total = sum(served.values())
    shares = [cost / total for cost in served.values()]
    assert all(abs(s - w / sum(weights)) <= SHARE_TOLERANCE[3000] for s, w in zip(shares, weights)), shares


# ---- starvation ------------------------------------------------------------------------------------------------
ARRIVAL = st.tuples(st.integers(0, 120), st.sampled_from(["a", "b", "c", None]), st.integers(1, 24),
                    st.integers(1, 10), st.sampled_from([1, 1, 1, 2, 3]))


@PROPERTY
@given(arrivals=st.lists(ARRIVAL, min_size=8, max_size=40), mode=st.sampled_from(["recompute", "swap"]),
       num_blocks=st.integers(24, 48), chunked=st.booleans())
def test_every_request_finishes_under_random_arrivals(arrivals, mode, num_blocks, chunked):
    """Random arrivals of several tenants into a pool tight enough to preempt: the scheduler never stalls, every
    request finishes, and none waits longer than all the work ever added (each step computes a token)."""
    budget = 32 if chunked else 64
    sched = make(max_num_seqs=6, max_num_batched_tokens=budget, num_blocks=num_blocks, block_size=4,
                 num_cpu_blocks=16, preemption_mode=mode, enable_chunked_prefill=chunked, max_model_len=64)
    by_step: dict[int, list] = {}
    for k, (at, tenant, plen, mtok, n) in enumerate(arrivals):
        by_step.setdefault(at, []).append((tenant, plen, mtok, n, k))
    arrived: dict[str, int] = {}
    work = 0
    done: dict[str, int] = {}
    k = 0
    while k <= max(by_step) or sched.has_unfinished():
        for tenant, plen, mtok, n, idx in by_step.get(k, []):
            g = group(tenant, plen, mtok, n=n, seed=idx, rid=f"r{idx}")
            try:
                sched.add(g)
            except ValueError:
                continue  # cannot fit the pool at all: refused at add, never queued
            arrived[g.request_id] = k
            work += (plen + mtok) * n
        if sched.has_unfinished():
            out = sched.schedule()
            assert not out.is_empty, "scheduler stalled with unfinished requests"
            for g in step(sched, out):
                done[g.request_id] = k
            sched.kv.check_invariants()
        k += 1
        assert k < 20_000
    assert set(done) == set(arrived)
    assert all(done[r] - arrived[r] <= 4 * work + 10 for r in arrived)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_flood_never_starves_another_tenants_request():
    """Two tenants add a request every step forever; a third's one request arrives late and finishes within
    the bound: a freed sequence slot goes to the smallest counter, at most one tie later (2 x the longest
    generation), plus its own prefill and generation."""
    max_tokens = 10
    sched = make(max_num_seqs=4, max_num_batched_tokens=32)
    light = None
    for k in range(400):
        for t in ("flood-1", "flood-2"):
            sched.add(group(t, 12, max_tokens))
        if k == 50:
            light = group("light", 12, max_tokens, rid="light")
            sched.add(light)
        out = sched.schedule()
        if any(g.request_id == "light" for g in step(sched, out)):
            break
    assert light is not None and light.is_finished()
    assert k - 50 <= 2 * max_tokens + max_tokens + 2


def test_a_large_request_is_not_starved_by_small_ones():
    """A request needing every sequence slot (n = max_num_seqs) beside a stream of small requests of other
    tenants: once its tenant has the smallest counter it stops admission until running requests drain."""
    sched = make(max_num_seqs=4, max_num_batched_tokens=64)
    big = None
    for k in range(400):
        for t in ("s1", "s2"):
            sched.add(group(t, 4, 6))
        if k == 5:
            big = group("big", 8, 6, n=4, rid="big")
            sched.add(big)
        out = sched.schedule()
        if any(g.request_id == "big" for g in step(sched, out)):
            break
    assert big is not None and big.is_finished()
    assert k - 5 <= 4 * 6 + 10


# ---- the light tenant beside n = 64 ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_short_request_beside_an_n64_tenant(policy):
    """Heavy sends two n=64 requests (its concurrency quota of two); light's 8-token request arrives after. With
    vtc it joins as soon as a sequence slot is free (here at once: 64 + 1 fit, 128 do not); with fcfs it waits
    behind heavy's second request, i.e. until heavy's first has finished."""
    sched = make(policy, max_num_seqs=72, max_num_batched_tokens=256, num_blocks=2048)
    heavy = [group("heavy", 16, 24, n=64, rid=f"heavy-{i}") for i in range(2)]
    for g in heavy:
        sched.add(g)
    done = {}
    k = 0
    while sched.has_unfinished():
        if k == 3:
            sched.add(group("light", 8, 8, rid="light"))
        for g in step(sched, sched.schedule()):
            done[g.request_id] = k
        k += 1
    if policy == "vtc":
        assert done["light"] - 3 <= 8 + 2 and done["light"] < done["heavy-0"]
    else:
        assert done["light"] > done["heavy-0"]


# ---- single tenant: VTC is FCFS ---------------------------------------------------------------------------------
def trace(out: SchedulerOutput, sched: Scheduler) -> tuple:
    def pos(seq):
        return seq.request_id, sched.get_group(seq.request_id).seqs.index(seq)

    return (tuple((pos(s.seq), s.num_new_tokens, s.sample, s.num_samples, tuple(s.block_ids)) for s in out.scheduled),
            tuple(out.preempted), tuple(out.blocks_to_swap_in), tuple(out.blocks_to_swap_out),
            tuple(out.blocks_to_copy))


@PROPERTY
@given(arrivals=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20), st.integers(1, 8),
                                   st.sampled_from([1, 1, 2])), min_size=4, max_size=16),
       mode=st.sampled_from(["recompute", "swap"]), num_blocks=st.integers(16, 40),
       tenant=st.sampled_from([None, "solo"]), chunked=st.booleans())
def test_single_tenant_vtc_schedules_exactly_as_fcfs(arrivals, mode, num_blocks, tenant, chunked):
    budget = 16 if chunked else 64
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=budget, num_blocks=num_blocks, num_cpu_blocks=12,
               preemption_mode=mode, enable_chunked_prefill=chunked, max_model_len=64)
    scheds = {p: make(p, **cfg) for p in ("fcfs", "vtc")}
    k = 0
    while k <= 30 or any(s.has_unfinished() for s in scheds.values()):
        traces = {}
        for policy, sched in scheds.items():
            for idx, (at, plen, mtok, n) in enumerate(arrivals):
                if at == k:
                    try:
                        sched.add(group(tenant, plen, mtok, n=n, seed=idx, rid=f"r{idx}", arrival=float(idx)))
                    except ValueError:
                        pass
            out = sched.schedule()
            traces[policy] = trace(out, sched)
            step(sched, out)
        assert traces["vtc"] == traces["fcfs"], f"step {k}"
        k += 1
        assert k < 5000


# ---- preemption victims -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_preemption_takes_from_the_tenant_furthest_above_its_share(policy):
    """A pool of 21 blocks of 4: heavy's n=3 request (arrived first) and light's (arrived later) decode until the
    pool runs out. Heavy's three sequences raise its counter three times as fast, so vtc preempts heavy (the
    larger counter) although it arrived first; fcfs preempts light (the later arrival)."""
    sched = make(policy, num_blocks=21, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    heavy = group("heavy", 8, 20, rid="heavy", n=3, arrival=1.0)
    light = group("light", 4, 20, rid="light", arrival=2.0)
    sched.add(heavy)
    step(sched, sched.schedule())
    sched.add(light)
    preempted = []
    for _ in range(40):
        counters = {t: sched.counters.get(t).counter for t in ("heavy", "light")} if sched.counters else None
        out = sched.schedule()
        preempted += out.preempted
        step(sched, out)
        if preempted:
            break
    assert sched.num_preemptions >= 1
    if policy == "vtc":
        assert counters["heavy"] > counters["light"] and preempted[0] == "heavy"
    else:
        assert preempted[0] == "light"
    drain(sched)


# ---- tokens counted once ---------------------------------------------------------------------------------------
def overlapped_run(sched: Scheduler, ledger: Ledger, arrivals: dict[int, list[SequenceGroup]],
                   outs: list[tuple[SchedulerOutput, bool]] | None = None) -> None:
    """Drive ``sched`` as LLMEngine does with overlapped scheduling: a plain-decode step is launched (pending
    tokens) and resolved after the next one is scheduled; any other step drains the one in flight first.
    ``outs`` collects each step's (output, whether a step was in flight when it was scheduled): entry k is the
    schedule that follows the arrivals of step k."""
    inflight = None
    k = 0

    def resolve(out):
        values = {}
        for s in out.scheduled:
            if s.seq.num_pending_tokens:
                values[s.seq.seq_id] = fake_token(s.seq.all_token_ids[:-1])
        accepted, _ = sched.update_resolved(out, values)
        for seq in accepted:
            ledger.outputs(owner[seq.request_id], 1)

    owner = {g.request_id: g.tenant for gs in arrivals.values() for g in gs}
    while k <= max(arrivals) or sched.has_unfinished() or inflight is not None:
        for g in arrivals.get(k, []):
            sched.add(g)
        k += 1
        out = sched.schedule()
        if outs is not None:
            outs.append((out, inflight is not None))
        plain = (out.scheduled and not (out.blocks_to_swap_in or out.blocks_to_swap_out or out.blocks_to_copy)
                 and all(s.num_new_tokens == 1 and s.sample and s.num_samples == 1 and not s.seq.num_pending_tokens
                         and sched.get_group(s.seq.request_id).sampling_params.n == 1 for s in out.scheduled))
        if plain:
            prev, inflight = inflight, out
            if prev is not None:
                resolve(prev)
            sched.update_launched(out)
            continue
        if inflight is not None:
            resolve(inflight)
            inflight = None
            out.scheduled = [s for s in out.scheduled if s.seq.status is SequenceStatus.RUNNING]
        step(sched, out, ledger)
        sched.kv.check_invariants()
        assert k < 20_000


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("overlap", [False, True])
def test_every_token_is_charged_once(mode, overlap):
    """Preemption (recompute re-runs prompts and outputs, swap moves them), parallel sampling (forks share the
    prompt) and overlapped steps (a pending token resolves later, maybe after its sequence was preempted): each
    tenant is charged exactly the prompt positions and output tokens it got, and its counter is their cost over
    its weight."""
    sched = make(num_blocks=20, block_size=4, num_cpu_blocks=24, preemption_mode=mode, max_num_seqs=6,
                 max_num_batched_tokens=24, max_model_len=64)
    arrivals: dict[int, list[SequenceGroup]] = {}
    weights = {"a": 1.0, "b": 3.0}
    for i in range(12):  # the first two run longest: both tenants stay active throughout (no lift)
        tenant = "ab"[i % 2]
        arrivals.setdefault(0 if i < 2 else i * 3, []).append(
            group(tenant, 6 + 3 * (i % 4), 40 if i < 2 else 8 + i % 5, weights[tenant], n=2 if i % 5 == 4 else 1,
                  seed=i))
    ledger = Ledger()
    if overlap:
        overlapped_run(sched, ledger, arrivals)
    else:
        k = 0
        while k <= max(arrivals) or sched.has_unfinished():
            for g in arrivals.get(k, []):
                sched.add(g)
            k += 1
            if sched.has_unfinished():
                step(sched, sched.schedule(), ledger)
    groups = [g for gs in arrivals.values() for g in gs]
    assert sched.num_preemptions > 0
    for tenant in "ab":
        mine = [g for g in groups if g.tenant == tenant]
        state = sched.counters.get(tenant)
        assert state.input_tokens == sum(g.seqs[0].num_prompt_tokens for g in mine) == ledger.input[tenant]
        assert state.output_tokens == sum(s.num_output_tokens for g in mine for s in g.seqs) == ledger.output[tenant]
        # both active from the first step on: no lift, the counter is exactly the cost over the weight
        assert state.counter == pytest.approx(ledger.cost(tenant, weights[tenant]))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
