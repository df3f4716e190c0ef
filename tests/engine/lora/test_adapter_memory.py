"""Adapters sharing a small GPU byte budget with a small KV pool, through the whole engine (tiny GPT-OSS, float32,
CPU): five PEFT adapters of ranks 16 / 8 / 16 / 8 / 4 (attention + fused experts) and a budget of 17 rank-units,
so at most two are resident at once; requests cycle through them with base requests between, and a KV pool too
small for the batch forces preemption. Every request must give PEFT's greedy tokens for its adapter alone while
adapters are evicted and reloaded; no step may evict an adapter a running or swapped request uses; the budget
accounting and the KV blocks come back once requests finish or are aborted."""
from __future__ import annotations

import os

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.lora.fetch import file_uri
from loraplex.engine.lora.manager import sha256_file
from loraplex.engine.lora.ref import AdapterRef

RANKS = (16, 8, 16, 8, 4)
MAX_RANK = 16
BUDGET_UNITS = 17     # bytes of a rank-1 adapter on every target: 16 + 8 > 17, 8 + 8 + 4 > 17, so two at most
NEW_TOKENS = 10
REL_TOL = 1e-4
FAMILY = "gpt_oss"


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, peft_adapter):
    path = tiny_checkpoint(FAMILY)
    folders = [peft_adapter(path, r=r, alpha=2 * r, seed=300 + i) for i, r in enumerate(RANKS)]
    refs = [AdapterRef(f"tenant/mem{i}/1", file_uri(f), sha256_file(os.path.join(f, "adapter_model.safetensors")))
            for i, f in enumerate(folders)]
    return path, folders, refs


def make_engine(path, tmp_path, **kw) -> LLMEngine:
    from loraplex.engine.loader import load_model
    from loraplex.engine.lora.slots import max_adapter_bytes

    model, _ = load_model(path, progress=False)
    unit = max_adapter_bytes(model, max_rank=1, dtype=torch.float32)  # a rank-1 adapter on every target
    del model
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=MAX_RANK,
                                     adapter_memory_bytes=BUDGET_UNITS * unit, block_size=4, max_num_seqs=8,
                                     max_num_batched_tokens=48, progress=False,
                                     adapter_cache_dir=str(tmp_path / "adapters"), **kw)


def workload(refs, vocab):
    """Arrivals cycle through the adapters twice (a b c d e a b c d e), a base request after every third: each
    adapter's second request comes after the others have pushed it out, so it is reloaded."""
    gen = torch.Generator().manual_seed(11)
    adapters = [refs[i % len(refs)] for i in range(2 * len(refs))]
    for i in (9, 6, 3):
        adapters.insert(i, None)
    return [(f"m{j}", a, torch.randint(0, vocab, (int(torch.randint(5, 12, (1,), generator=gen)),),
                                       generator=gen).tolist()) for j, a in enumerate(adapters)]


class Watch:
    """Checks after every step: KV invariants, budget accounting, and (on every eviction) that the victim is no
    running or swapped request's adapter."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.evicted, self.max_resident = engine, [], 0
        pool = engine.adapters.pool
        drop = pool._drop

        def spy(ref):
            sched = engine.scheduler
            in_use = {sched.get_group(s.request_id).adapter for s in sched.running} | {g.adapter for g in sched.swapped}
            assert ref not in in_use, f"evicted {ref.adapter_id} while a request uses it"
            self.evicted.append(ref)
            drop(ref)

        pool._drop = spy

    def after_step(self) -> None:
        engine = self.engine
        engine.kv_cache.check_invariants()
        pool, slots = engine.adapters.pool, engine.runner.lora
        assert pool.used_bytes == slots.nbytes <= pool.budget_bytes
        self.max_resident = max(self.max_resident, len(pool))


def test_tokens_match_peft_while_adapters_are_evicted_and_kv_is_preempted(setup, tmp_path, peft_logits):
    path, folders, refs = setup
    engine = make_engine(path, tmp_path, num_kv_blocks=12)
    watch = Watch(engine)
    logits: dict[str, list] = {}
    engine.runner.logits_hook = lambda seqs, lg: [logits.setdefault(s.request_id, []).append(lg[j].clone())
                                                  for j, s in enumerate(seqs)]
    work = workload(refs, engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, ref, prompt in work:
        engine.add_request(rid, prompt, params, adapter=ref)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 2000
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        watch.after_step()
    counters = engine.list_adapters()["counters"]
    assert engine.scheduler.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert watch.evicted and counters["evictions"] == len(watch.evicted) and counters["activations"] > len(RANKS)
    assert watch.max_resident == 2
    folder_of = {r: f for r, f in zip(refs, folders)}
    for rid, ref, prompt in work:
        out = final[rid]
        assert out.finish_reason == "length" and len(out.output_token_ids) == NEW_TOKENS, out
        want = peft_logits(path, folder_of[ref] if ref else None, prompt, out.output_token_ids)
        assert want.argmax(-1).tolist() == out.output_token_ids, f"{rid} ({ref}): not PEFT's greedy tokens"
        got = logits[rid][-NEW_TOKENS:]  # a preempted request recomputes: its last rows are the final ones
        err = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
        assert err <= REL_TOL, (rid, err)
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks  # every block back (cached ones are free too)
    engine.close()


def test_aborts_leave_no_kv_blocks_or_adapter_memory(setup, tmp_path):
    path, _, refs = setup
    engine = make_engine(path, tmp_path, num_kv_blocks=64)
    watch = Watch(engine)
    work = workload(refs, engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for rid, ref, prompt in work:
        engine.add_request(rid, prompt, params, adapter=ref)
    for _ in range(12):  # some running, some waiting for an adapter, some loading
        engine.step()
        watch.after_step()
    assert engine.scheduler.num_running > 0 and engine.adapters.pool.used_bytes > 0
    for rid, _, _ in work:
        engine.abort(rid)
    engine.step()
    watch.after_step()
    kv, pool, slots = engine.kv_cache, engine.adapters.pool, engine.runner.lora
    assert not engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks
    # steady: what stays resident is an LRU cache of unused adapters, exactly accounted, and all of it evictable
    assert pool.used_bytes == slots.nbytes == sum(pool.nbytes_of(r) for r in pool.resident().values())
    for ref in list(pool.resident().values()):
        assert engine.evict_adapter(ref)
    assert pool.used_bytes == 0 == slots.nbytes and slots.resident_slots == []
    assert all(not w.loaded for w in slots._wrappers)
    engine.close()
