"""Adapter-aware scheduling through the whole engine: more adapters in flight than GPU slots, cold loads that run
off the step loop, no starvation, prefix-cache separation. Real PEFT adapters of the tiny llama, float32 CPU."""
from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.lora.fetch import FileFetcher, file_uri
from loraplex.engine.lora.manager import sha256_file
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import SequenceGroup

NUM_ADAPTERS = 6
REQUESTS_PER_ADAPTER = 3
NUM_BASE = 2
MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def refs(base, peft_adapter):
    """Six adapters (ranks 4 and 8, attention + MLP) as AdapterRefs with their sha256."""
    out = []
    for i in range(NUM_ADAPTERS):
        folder = peft_adapter(base, r=4 if i % 2 else 8, alpha=8, seed=200 + i)
        out.append(AdapterRef(f"tenant/sched{i}/1", file_uri(folder),
                              sha256_file(os.path.join(folder, "adapter_model.safetensors"))))
    return out


def make_engine(base, tmp_path, max_loras, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(base, device="cpu", dtype="float32", enable_lora=True, max_loras=max_loras,
                                     max_cpu_loras=NUM_ADAPTERS, max_lora_rank=8, max_num_seqs=32,
                                     max_num_batched_tokens=256, block_size=4, progress=False,
                                     adapter_cache_dir=str(tmp_path / f"cache-{max_loras}"), **kw)


@pytest.fixture(scope="module")
def workload(refs):
    """(request id, adapter or None, prompt): adapters interleaved round-robin, a few base requests."""
    gen = torch.Generator().manual_seed(7)
    items = [refs[i % NUM_ADAPTERS] for i in range(NUM_ADAPTERS * REQUESTS_PER_ADAPTER)] + [None] * NUM_BASE
    return [(f"r{i}", a, torch.randint(1, 300, (int(torch.randint(5, 13, (1,), generator=gen)),),
                                       generator=gen).tolist()) for i, a in enumerate(items)]


@pytest.fixture(scope="module")
def reference(base, refs, workload, tmp_path_factory):
    """Tokens of every workload request from an engine with a slot per adapter (no swapping)."""
    engine = make_engine(base, tmp_path_factory.mktemp("ref"), max_loras=NUM_ADAPTERS)
    outs = engine.generate([p for _, _, p in workload], PARAMS, adapters=[a for _, a, _ in workload])
    engine.close()
    assert engine.list_adapters()["counters"]["evictions"] == 0
    return {rid: o.output_token_ids for (rid, _, _), o in zip(workload, outs)}


def spy_slots(engine: LLMEngine) -> list[dict[int, int]]:
    """Records the {seq_id: slot} the engine hands the runner each step."""
    seen: list[dict[int, int]] = []
    execute = engine.runner.execute

    def spy(out, sampling, lora_slots=None):
        seen.append(dict(lora_slots or {}))
        return execute(out, sampling, lora_slots=lora_slots)

    engine.runner.execute = spy
    return seen


def test_six_adapters_through_two_slots_finish_within_bound_with_same_tokens(base, refs, workload, reference,
                                                                             tmp_path):
    engine = make_engine(base, tmp_path, max_loras=2)
    for r in refs:  # CPU-warm, so that the step count depends on scheduling alone
        assert engine.load_adapter(r, wait=True, timeout=30) == "ready"
    seen = spy_slots(engine)
    for rid, adapter, prompt in workload:
        engine.add_request(rid, prompt, PARAMS, adapter)
    final, steps = {}, 0
    # Bound: every prompt fits one step's budget, so a request admitted at step s finishes at step
    # s + MAX_TOKENS - 1. Slots are granted in queue order and requests of a running adapter join in the step
    # its slot is granted, so the requests run in waves of <= max_loras adapters; a wave holds its slots for
    # MAX_TOKENS steps and the next wave is admitted in the step after it ends: ceil(6/2) waves.
    bound = math.ceil(NUM_ADAPTERS / 2) * MAX_TOKENS
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= bound, f"not finished within {bound} steps"
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert {rid: o.output_token_ids for rid, o in final.items()} == reference
    assert all(o.finish_reason == "length" for o in final.values())
    assert all(len(set(s.values())) <= 2 for s in seen)  # never more than max_loras adapters in a step
    assert any(len(set(s.values())) == 2 for s in seen)
    c = engine.list_adapters()["counters"]
    # 6 adapters through 2 slots: each activated at least once, at least 4 slots taken over; each loaded once
    assert c["loads"] == NUM_ADAPTERS and c["fetches"] == NUM_ADAPTERS and c["failures"] == 0
    assert c["activations"] >= NUM_ADAPTERS and c["evictions"] >= NUM_ADAPTERS - 2
    assert c["slot_hits"] >= NUM_ADAPTERS * REQUESTS_PER_ADAPTER - c["activations"]
    engine.close()


class GatedFetcher(FileFetcher):
    """``slow:///path`` served from the local folder once the test opens the gate (a slow blob store)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def fetch(self, uri, dest_dir):
        assert self.gate.wait(30), "test never opened the fetch gate"
        return super().fetch("file://" + uri.split("://", 1)[1], dest_dir)


def test_running_requests_keep_decoding_while_a_cold_adapter_loads(base, refs, workload, reference, tmp_path):
    engine = make_engine(base, tmp_path, max_loras=2)
    fetcher = GatedFetcher()
    engine.adapters.register_fetcher("slow", fetcher)
    warm_rid, warm_ref, warm_prompt = workload[0]
    base_rid, _, base_prompt = workload[-1]
    cold_rid, cold_ref, cold_prompt = workload[1]
    cold = AdapterRef(cold_ref.adapter_id, "slow://" + cold_ref.uri.split("://", 1)[1], cold_ref.sha256)
    # the warm adapter is on CPU before anything runs, so the token counts below do not depend on when the
    # background load happens to finish
    assert engine.load_adapter(warm_ref, wait=True, timeout=60) == "ready"
    engine.add_request(warm_rid, warm_prompt, PARAMS, warm_ref)
    engine.add_request(base_rid, base_prompt, PARAMS)
    tokens, final = {}, {}

    def step():
        for o in engine.step():
            tokens[o.request_id] = len(o.output_token_ids)
            if o.finished:
                final[o.request_id] = o

    while not (tokens.get(warm_rid) and tokens.get(base_rid)):
        step()
    engine.add_request(cold_rid, cold_prompt, PARAMS, cold)
    before = dict(tokens)
    for _ in range(4):
        step()
        assert engine.adapters.state(cold) == "loading"
    # four decode steps of the others happened while the cold adapter's fetch was still blocked
    assert before[warm_rid] + 4 <= MAX_TOKENS and before[base_rid] + 4 <= MAX_TOKENS, before
    assert tokens == {warm_rid: before[warm_rid] + 4, base_rid: before[base_rid] + 4}
    fetcher.gate.set()
    for _ in range(200):
        step()
        if not engine.has_unfinished_requests():
            break
    assert {r: final[r].output_token_ids for r in (warm_rid, base_rid, cold_rid)} == \
        {r: reference[r] for r in (warm_rid, base_rid, cold_rid)}
    engine.close()


def test_same_prompt_under_two_adapters_shares_no_prefix_cache(base, refs, tmp_path):
    engine = make_engine(base, tmp_path, max_loras=2)
    prompt = list(range(10, 30))  # 5 full blocks of 4
    first = engine.generate([prompt], PARAMS, adapters=[refs[0]])[0]
    again = engine.generate([prompt], PARAMS, adapters=[refs[0]])[0]
    other = engine.generate([prompt], PARAMS, adapters=[refs[1]])[0]
    plain = engine.generate([prompt], PARAMS)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16  # same adapter: prefix hit
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0   # other adapter / base: none
    assert again.output_token_ids == first.output_token_ids != other.output_token_ids
    engine.close()


# ---- starvation (scheduler only, a fake adapter manager) ------------------------------------------------------
class FakeManager:
    """Every adapter is CPU-ready; ``max_loras`` slots, taken over LRU-free-first like the real one."""

    def __init__(self, max_loras: int) -> None:
        self.slots: list = [None] * max_loras

    def slot_of(self, a):
        return self.slots.index(a) if a in self.slots else None

    def ensure_loading(self, a):
        return "ready"

    def activate(self, a, in_use):
        if a in self.slots:
            return self.slots.index(a)
        for i, held in enumerate(self.slots):
            if held is None or held not in in_use:
                self.slots[i] = a
                return i
        return None


def test_a_request_for_another_adapter_is_not_starved_by_a_stream():
    kv = KVCacheManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64, max_loras=1),
                      kv, adapter_slots=FakeManager(1))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    starving_admitted_at = None
    for t in range(60):
        # a new request for adapter "A" arrives every step, forever; "B" arrives at step 1
        sched.add(SequenceGroup.from_prompt(f"a{t}", [1, 2, 3], params, arrival_time=float(t), adapter="A",
                                            extra_key="A"))
        if t == 1:
            sched.add(SequenceGroup.from_prompt("b", [1, 2, 3], params, arrival_time=float(t), adapter="B",
                                                extra_key="B"))
        out = sched.schedule()
        assert len({sched.get_group(s.seq.request_id).adapter for s in out.scheduled}) <= 1
        if any(s.seq.request_id == "b" for s in out.scheduled):
            starving_admitted_at = t
            break
        sched.update(out, {s.seq.seq_id: 5 for s in out.scheduled if s.sample})
    # B is refused at step 1 (grace: A's newcomers still join), then A drains: 4 tokens -> admitted by step 6
    assert starving_admitted_at is not None and starving_admitted_at <= 1 + params.max_tokens + 1
