"""Tenant-fair scheduling through the real LLMEngine on a tiny llama (CPU, float32): a light tenant's short request
beside a heavy tenant's two n=64 requests finishes within a few steps of its arrival under "vtc" (behind the
heavy ones under "fcfs") with the very tokens it gets alone; beside a heavy n=8 request holding every sequence
slot it takes them by slot preemption, and the preempted request's tokens equal those of its run without the light
tenant (seeded sampling with plain and overlapped steps, and beam search); every token is charged once with
overlapped steps; the tenant and its weight reach the scheduler through AsyncEngine and the engine service; stats
and metrics show the tenants with bounded labels."""
from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine import AsyncEngine, LLMEngine, SamplingParams
from loraplex.engine.fairness import DEFAULT_PREEMPT_GAP
from loraplex.engine.server.metrics import render_metrics
from loraplex.engine.server.protocol import GenerateRequest, RequestFormatError
from loraplex.engine.server.service import EngineService
from loraplex.engine.stats import TENANT_STATS_LIMIT, engine_stats

BASE = dict(device="cpu", dtype="float32", block_size=4, progress=False)
ARRIVAL = 2  # the step before which the light request arrives
HEAVY_TOKENS, LIGHT_TOKENS = 10, 4


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def heavy_and_light(path: str, policy: str):
    """Heavy: two n=64 requests (sampled, seeded); light: one greedy request added before step ARRIVAL.
    max_num_seqs 72: heavy's first group and the light request fit together, heavy's two groups do not. Runs
    until the light request has finished (then aborts the rest); returns ({request id: step it finished},
    light's tokens, light's tokens when it runs alone)."""
    engine = LLMEngine.from_pretrained(path, max_num_seqs=72, max_num_batched_tokens=256, num_kv_blocks=512,
                                       scheduling_policy=policy, **BASE)
    vocab = engine.model_config.vocab_size
    heavy = SamplingParams(n=64, max_tokens=HEAVY_TOKENS, temperature=1.0, seed=3, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"heavy-{i}", prompt(vocab, 12, i), heavy, tenant="heavy")
    light = SamplingParams(max_tokens=LIGHT_TOKENS, temperature=0.0, ignore_eos=True)
    finished: dict[str, int] = {}
    tokens: list[int] = []
    k = 0
    while "light" not in finished:
        if k == ARRIVAL:
            engine.add_request("light", prompt(vocab, 8, 9), light, tenant="light", weight=1.0)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = k
                if out.request_id == "light":
                    tokens = out.output_token_ids
        k += 1
        assert k < 100
    for request_id in ("heavy-0", "heavy-1"):
        engine.abort(request_id)
    assert not engine.has_unfinished_requests() and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    alone = engine.generate([prompt(vocab, 8, 9)], light)[0].output_token_ids
    return finished, tokens, alone


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_light_request_beside_two_n64_requests(tiny_checkpoint, policy):
    finished, tokens, alone = heavy_and_light(tiny_checkpoint("llama"), policy)
    assert tokens == alone and len(tokens) == LIGHT_TOKENS  # reordering changes when it runs, not what it computes
    if policy == "vtc":
        # admitted within a step of its arrival (a tie lost to heavy's older request at most), then its tokens,
        # while heavy's first 64 sequences still run
        assert finished["light"] - ARRIVAL <= LIGHT_TOKENS + 2 and "heavy-0" not in finished
    else:
        assert finished["heavy-0"] < finished["light"]  # FCFS: behind heavy's second n=64 request


HEAVY_N8 = {"sampled": SamplingParams(n=8, max_tokens=3 * HEAVY_TOKENS, temperature=1.0, seed=7, ignore_eos=True),
            "beam": SamplingParams(n=8, use_beam_search=True, beam_width=8, max_tokens=3 * HEAVY_TOKENS,
                                   ignore_eos=True)}  # greedy n > 1: beam search (sampling refuses temperature 0)


def heavy_n8_run(path: str, light: bool, async_scheduling: bool, kind: str = "sampled"):
    """A heavy n=8 request (seeded sampling, or a beam search of width 8) in max_num_seqs=8, the light greedy
    request added before step ARRIVAL when ``light``. Returns (heavy's 8 token lists, {request id: step it
    finished}, (light's tokens, its tokens alone), (slot preemptions, overlapped steps))."""
    engine = LLMEngine.from_pretrained(path, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256,
                                       vtc_preempt_gap=24.0, async_scheduling=async_scheduling, **BASE)
    vocab = engine.model_config.vocab_size
    engine.add_request("heavy", prompt(vocab, 10, 1), HEAVY_N8[kind], tenant="heavy")
    greedy = SamplingParams(max_tokens=LIGHT_TOKENS, temperature=0.0, ignore_eos=True)
    finished: dict[str, int] = {}
    outputs = {}
    k = 0
    while engine.has_unfinished_requests():
        if k == ARRIVAL and light:
            engine.add_request("light", prompt(vocab, 6, 2), greedy, tenant="light")
        for out in engine.step():
            if out.finished:
                finished[out.request_id], outputs[out.request_id] = k, out
        engine.kv_cache.check_invariants()
        k += 1
        assert k < 400
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    heavy_tokens = [c.output_token_ids for c in outputs["heavy"].outputs]
    light_tokens = outputs["light"].output_token_ids if light else None
    alone = engine.generate([prompt(vocab, 6, 2)], greedy)[0].output_token_ids
    return heavy_tokens, finished, (light_tokens, alone), (engine.scheduler.num_slot_preemptions,
                                                           engine.num_overlapped_steps)


@pytest.mark.parametrize("async_scheduling, kind", [(False, "sampled"), (True, "sampled"), (False, "beam")])
def test_slot_preemption_of_an_n8_request_is_lossless(tiny_checkpoint, async_scheduling, kind):
    path = tiny_checkpoint("llama")
    heavy, finished, (light, alone), (preemptions, overlapped) = heavy_n8_run(path, True, async_scheduling, kind)
    reference, _, _, (none, _) = heavy_n8_run(path, False, async_scheduling, kind)
    assert preemptions == 1 and none == 0 and (overlapped > 0) == async_scheduling
    # light holds nothing and asks for less than its share (4 of 8 slots): heavy's group yields at the first step
    # after the arrival, whatever the gap; its tokens follow one a step (one step later with a step in flight)
    assert finished["light"] - ARRIVAL <= LIGHT_TOKENS + 1 and finished["light"] < finished["heavy"]
    assert light == alone and len(light) == LIGHT_TOKENS
    assert heavy == reference and all(len(t) == 3 * HEAVY_TOKENS for t in heavy)


def test_default_gap_admits_the_light_request_beside_n64_requests_holding_every_slot(tiny_checkpoint):
    """The benchmark's shape at a small scale: heavy's two n=64 requests hold all 128 slots (128 sequences add
    256 to its counter a step); the light request is lifted level with heavy and holds nothing, so by the share
    rule it takes the slots of heavy's later group at the first step after its arrival (the default gap alone
    would hold it 4 + 1 steps) and finishes while heavy's first group still runs; heavy's tokens equal those of
    its run without the light tenant."""
    path = tiny_checkpoint("llama")
    heavy_params = SamplingParams(n=64, max_tokens=2 * HEAVY_TOKENS, temperature=1.0, seed=3, ignore_eos=True)
    light_params = SamplingParams(max_tokens=LIGHT_TOKENS, temperature=0.0, ignore_eos=True)

    def run(light: bool):
        engine = LLMEngine.from_pretrained(path, max_num_seqs=128, max_num_batched_tokens=256, num_kv_blocks=1024,
                                           **BASE)
        vocab = engine.model_config.vocab_size
        for i in range(2):
            engine.add_request(f"heavy-{i}", prompt(vocab, 12, i), heavy_params, tenant="heavy")
        finished, outputs, k = {}, {}, 0
        while engine.has_unfinished_requests():
            if k == ARRIVAL and light:
                engine.add_request("light", prompt(vocab, 8, 9), light_params, tenant="light")
            for out in engine.step():
                if out.finished:
                    finished[out.request_id], outputs[out.request_id] = k, out
            k += 1
            assert k < 200
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
        heavy = {r: [c.output_token_ids for c in outputs[r].outputs] for r in ("heavy-0", "heavy-1")}
        return finished, heavy, (engine.scheduler.num_slot_preemptions, engine_stats(engine))

    finished, heavy, (preemptions, stats) = run(True)
    reference, (none, _) = run(False)[1:]
    assert preemptions == 1 and none == 0
    assert (stats["slot_preemptions"], stats["budget_yields"]) == (1, 0)
    text = render_metrics(stats, model="tiny").decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values["loraplex_engine_server_slot_preemptions_total"] == 1.0
    gap_wait = -(-int(DEFAULT_PREEMPT_GAP) // (128 * 2)) + 1  # what the gap rule alone would take
    assert finished["light"] - ARRIVAL == LIGHT_TOKENS - 1 < gap_wait + LIGHT_TOKENS - 1  # admitted at once
    assert finished["light"] < finished["heavy-0"]
    assert heavy == reference


def test_every_token_is_charged_once_with_overlapped_steps(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint("llama"), max_num_seqs=6, max_num_batched_tokens=24,
                                       num_kv_blocks=18, preemption_mode="recompute", async_scheduling=True, **BASE)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    groups = []
    for i in range(8):
        tenant, weight = ("a", 1.0) if i % 2 == 0 else ("b", 4.0)
        engine.add_request(f"r{i}", prompt(vocab, 5 + i, i), params, tenant=tenant, weight=weight)
        groups.append(engine.scheduler.get_group(f"r{i}"))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert engine.num_overlapped_steps > 0 and engine.scheduler.num_preemptions > 0
    for tenant, weight in (("a", 1.0), ("b", 4.0)):
        mine = [g for g in groups if g.tenant == tenant]
        state = engine.scheduler.counters.get(tenant)
        n_in = sum(g.seqs[0].num_prompt_tokens for g in mine)
        n_out = sum(len(outputs[g.request_id].output_token_ids) for g in mine)
        assert (state.input_tokens, state.output_tokens) == (n_in, n_out) and n_out == 14 * len(mine)
        assert state.counter == pytest.approx((n_in + 2 * n_out) / weight)


def test_tenant_and_weight_reach_the_scheduler_through_the_service(tiny_checkpoint):
    with pytest.raises(RequestFormatError, match="'tenant_weight' must be a number in"):
        GenerateRequest.from_dict({"request_id": "x", "prompt": [1], "tenant_weight": 0})
    with pytest.raises(RequestFormatError, match="'tenant_weight' must be int or float"):
        GenerateRequest.from_dict({"request_id": "x", "prompt": [1], "tenant_weight": True})
    wire = GenerateRequest(request_id="r", prompt=[1], tenant_id="acme", tenant_weight=2.5).to_dict()
    assert GenerateRequest.from_dict(wire).tenant_weight == 2.5 and wire["tenant_weight"] == 2.5
    assert GenerateRequest.from_dict({"request_id": "r", "prompt": [1]}).tenant_weight == 1.0

    engine = AsyncEngine(LLMEngine.from_pretrained(tiny_checkpoint("llama"), max_num_seqs=4, **BASE))
    service = EngineService(engine, model_name="tiny")
    seen = []
    add = engine.engine.add_request

    def spy(*args, **kw):
        add(*args, **kw)
        group = engine.engine.scheduler.get_group(args[0])
        seen.append((group.tenant, group.weight, group.tenant_state.weight))

    engine.engine.add_request = spy

    async def run():
        request = GenerateRequest(request_id="r1", prompt=[5, 6, 7], sampling={"max_tokens": 3},
                                  tenant_id="acme", tenant_weight=2.5)
        return [c async for c in service.generate(request)]

    try:
        chunks = asyncio.run(run())
        with pytest.raises(ValueError, match="tenant weight must be a number in"):
            engine.engine.add_request("bad", [1, 2], weight=-1.0)
    finally:
        engine.shutdown()
    assert chunks[-1]["finished"] and seen == [("acme", 2.5, 2.5)]


def test_stats_and_metrics_list_tenants_with_bounded_labels(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint("llama"), max_num_seqs=4, **BASE)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tenants = [f"t{i:02d}" for i in range(TENANT_STATS_LIMIT + 4)]
    for i, tenant in enumerate(tenants):
        engine.add_request(f"r{i}", [5, 6, 7, 8], params, tenant=tenant, weight=1.0 + i % 3)
    engine.add_request("anon", [5, 6], params)  # no tenant
    engine.step()
    stats = engine_stats(engine)
    assert stats["scheduling_policy"] == "vtc" and stats["tenants_active"] == len(tenants) + 1
    rows = stats["tenants"]
    assert len(rows) == TENANT_STATS_LIMIT and stats["tenants_other"]["tenants"] == len(tenants) + 1 - len(rows)
    assert sum(r["running"] for r in rows) + stats["tenants_other"]["running"] == 4
    assert sum(r["waiting"] for r in rows) + stats["tenants_other"]["waiting"] == len(tenants) + 1 - 4
    running = [r for r in rows if r["running"]]
    assert len(running) == 4 and all(r["input_tokens"] > 0 and r["lead"] >= 0 for r in running)
    assert {r["weight"] for r in rows if r["tenant"] is not None} <= {1.0, 2.0, 3.0}
    text = render_metrics(stats, model="tiny").decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "loraplex_engine_server_tenant_sequences"]
    labels = {s.labels["tenant"] for s in samples}
    assert len(labels) == TENANT_STATS_LIMIT + 1 and "_other" in labels
    by = {(s.labels["tenant"], s.labels["state"]): s.value for s in samples}
    assert sum(v for (t, state), v in by.items() if state == "running") == 4
    while engine.has_unfinished_requests():
        engine.step()
    idle = engine_stats(engine)
    assert idle["tenants"] == [] and idle["tenants_active"] == 0
