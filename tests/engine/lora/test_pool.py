"""AdapterPool with real LoRASlots on a tiny model: each adapter costs exactly its rank's bytes (rank 8 a quarter
of rank 32), residency bounded by the byte budget, LRU eviction of unused adapters only, copies in flight never
evicted, pins that always leave room for one more adapter, accounting back to zero when everything goes."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.loader import load_model
from loraplex.engine.lora.pool import AdapterPool, AdapterTooLargeError
from loraplex.engine.lora.slots import LoRASlots
from loraplex.engine.testing.adapters import random_adapter
from tests.engine.lora.fakes import ManualCopier


@pytest.fixture
def slots(tiny_checkpoint):
    model, cfg = load_model(tiny_checkpoint("gpt_oss"), progress=False)
    return LoRASlots(model, cfg, max_rank=32, max_step_slots=8, device="cpu", dtype=torch.float32)


def test_an_adapter_costs_exactly_its_rank(slots):
    r8, r32 = random_adapter(slots, "r8", rank=8, seed=0), random_adapter(slots, "r32", rank=32, seed=1)
    assert slots.footprint(r8) * 4 == slots.footprint(r32) == slots.max_footprint()
    attn = random_adapter(slots, "attn", rank=8, seed=2, targets=("self_attn.q_proj", "self_attn.v_proj"))
    assert 0 < slots.footprint(attn) < slots.footprint(r8)  # only the modules it targets
    pool = AdapterPool(slots, budget_bytes=slots.max_footprint())
    pool.activate("r8", r8)
    pool.activate("attn", attn)
    assert pool.used_bytes == slots.nbytes == slots.footprint(r8) + slots.footprint(attn)


def test_residency_grows_until_the_budget_then_lru_unused_adapters_go(slots):
    """A budget of one rank-32 adapter holds four rank-8 ones (the old slots held as many adapters as slots,
    whatever their rank); a fifth evicts the least recently used one not in use."""
    pool = AdapterPool(slots, budget_bytes=slots.max_footprint())
    small = {f"s{i}": random_adapter(slots, f"s{i}", rank=8, seed=i) for i in range(5)}
    for name in ("s0", "s1", "s2", "s3"):
        assert pool.activate(name, small[name]) is not None
    assert len(pool) == 4 and pool.free_bytes == 0
    pool.touch("s0")                                       # s1 is now the least recently used
    assert pool.activate("s4", small["s4"], in_use={"s2"}) is not None
    assert pool.slot_of("s1") is None and len(pool) == 4 and pool.used_bytes == slots.nbytes
    big = random_adapter(slots, "big", rank=32, seed=9)
    assert pool.activate("big", big, in_use={"s0"}) is None  # would need s0's bytes: nothing is evicted
    assert len(pool) == 4
    assert pool.activate("big", big) is not None and len(pool) == 1 and pool.free_bytes == 0
    with pytest.raises(AdapterTooLargeError, match="more than the whole adapter budget"):
        AdapterPool(slots, budget_bytes=slots.max_footprint()).activate(
            "huge", random_adapter(slots, "huge", rank=33, seed=3))


def test_an_adapter_in_use_or_still_copying_is_never_evicted(slots):
    copier = ManualCopier()
    slots.copier = copier
    pool = AdapterPool(slots, budget_bytes=2 * slots.footprint(random_adapter(slots, "x", rank=16, seed=0)))
    a, b, c = (random_adapter(slots, n, rank=16, seed=i) for i, n in enumerate("abc"))
    pool.activate("a", a)
    pool.activate("b", b)
    assert not pool.is_ready("a") and pool.copying() == ["a", "b"]
    assert pool.activate("c", c) is None                   # both copies in flight: not evictable
    copier.finish_all()
    assert pool.is_ready("a") and pool.copying() == [] and pool.copy_seconds == [0.001, 0.001]
    latency = pool.copy_latency.snapshot()                 # every completed copy, for the engine's /metrics
    assert latency["count"] == 2 and latency["sum"] == pytest.approx(0.002) and latency["buckets"][0] == [0.001, 2]
    assert pool.activate("c", c, in_use={"a", "b"}) is None
    assert pool.activate("c", c, in_use={"b"}) is not None and pool.slot_of("a") is None


def test_pins_keep_room_for_one_more_adapter(slots):
    pool = AdapterPool(slots, budget_bytes=3 * slots.max_footprint())
    r32 = {n: random_adapter(slots, n, rank=32, seed=i) for i, n in enumerate("abcd")}
    pool.pin("a")
    pool.pin("b", slots.footprint(r32["b"]))
    with pytest.raises(ValueError, match="leaving less than one largest adapter"):
        pool.pin("c")
    for n in "abc":
        assert pool.activate(n, r32[n]) is not None
    assert pool.activate("d", r32["d"]) is not None        # c goes: a and b are pinned
    assert pool.slot_of("c") is None and pool.slot_of("a") is not None and pool.slot_of("b") is not None
    pool.unpin("a")
    pool.pin("c")                                          # room again


def test_accounting_returns_to_zero(slots):
    pool = AdapterPool(slots, budget_bytes=slots.max_footprint())
    names = [f"s{i}" for i in range(4)]
    for i, n in enumerate(names):
        pool.activate(n, random_adapter(slots, n, rank=4 + 4 * (i % 2), seed=i))
    assert pool.used_bytes == slots.nbytes > 0
    for n in names:
        assert pool.evict(n)
    assert pool.used_bytes == 0 == slots.nbytes and len(pool) == 0 and slots.resident_slots == []
    assert all(not w.loaded for w in slots._wrappers)
    assert not pool.evict("s0")


def test_budget_below_one_largest_adapter_is_refused_at_start(slots):
    with pytest.raises(ValueError, match="holds no adapter of rank 32 on every target"):
        AdapterPool(slots, budget_bytes=slots.max_footprint() - 1)


def test_an_allocator_failure_within_the_budget_waits_instead_of_failing(slots, monkeypatch):
    pool = AdapterPool(slots, budget_bytes=slots.max_footprint())
    w = random_adapter(slots, "a", rank=8, seed=0)

    def no_block(slot, weights):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(slots, "load", no_block)
    assert pool.activate("a", w) is None and len(pool) == 0 and pool.used_bytes == 0
    monkeypatch.undo()
    assert pool.activate("a", w) is not None and pool.used_bytes == slots.footprint(w)
