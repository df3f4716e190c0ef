"""AdapterManager tiers: single-flight loads, disk cache by sha256, CPU LRU, GPU activation and eviction under the
byte budget, pinning, remembered failures, fetchers by scheme. Real PEFT adapters of the tiny llama; the GPU side
is a recording fake whose adapters all take SIZE bytes (the LoRA math is tested against PEFT in
test_peft_equivalence.py, the budget with mixed sizes in test_pool.py)."""
from __future__ import annotations

import os
import threading

import pytest

from loraplex.engine.config import ModelConfig
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.lora.fetch import AdapterFetchError, FileFetcher, file_uri
from loraplex.engine.lora.manager import AdapterManager, sha256_file
from loraplex.engine.lora.ref import AdapterRef
from tests.engine.lora.fakes import SIZE, FakeSlots


class CountingFetcher(FileFetcher):
    """A file fetcher that counts calls and can be held at a gate (a slow blob store)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls = 0
        self.gate = gate
        self.lock = threading.Lock()

    def fetch(self, uri, dest_dir):
        with self.lock:
            self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(30), "test never opened the fetch gate"
        return super().fetch(uri, dest_dir)


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return path, ModelConfig.from_pretrained(path)


@pytest.fixture(scope="module")
def refs(base, peft_adapter):
    """Four real PEFT adapters of the tiny llama, as AdapterRefs with their sha256."""
    out = []
    for i in range(4):
        folder = peft_adapter(base[0], r=4, alpha=8, attention_only=True, seed=100 + i)
        out.append(AdapterRef(f"tenant/a{i}/1", file_uri(folder),
                              sha256_file(os.path.join(folder, "adapter_model.safetensors"))))
    return out


@pytest.fixture
def make_manager(base, tmp_path):
    made = []

    def make(fit=2, max_cpu_loras=4, cache_dir=None, fetcher=None, **kw):
        """A manager whose GPU budget holds ``fit`` adapters."""
        m = AdapterManager(FakeSlots(fit), base[1], gpu_budget_bytes=fit * SIZE, max_cpu_loras=max_cpu_loras,
                           max_rank=16, cache_dir=cache_dir or str(tmp_path / "cache"),
                           fetchers={"file": fetcher or FileFetcher()}, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_adapter_ref_identity_and_validation():
    a = AdapterRef("t/a/1", "file:///x", "AB" * 32)
    assert a == AdapterRef("t/a/1", "s3://bucket/key", "ab" * 32)  # where the bytes live is not identity
    assert hash(a) == hash(AdapterRef("t/a/1", "s3://elsewhere", "ab" * 32)) and a.scheme == "file"
    assert a != AdapterRef("t/a/1", "file:///x", "cd" * 32) and a != AdapterRef("t/a/2", "file:///x", "ab" * 32)
    with pytest.raises(ValueError, match="sha256 must be 64 hex characters"):
        AdapterRef("t/a/1", "file:///x", "abc")
    with pytest.raises(ValueError, match="must be a URI with a scheme"):
        AdapterRef("t/a/1", "/no/scheme")
    with pytest.raises(ValueError, match="adapter_id must be a non-empty string"):
        AdapterRef("", "file:///x")


def test_engine_config_validates_lora_limits():
    with pytest.raises(ValueError, match=r"max_loras must be None \(no cap\) or an integer >= 1, got 0"):
        EngineConfig(model="m", max_loras=0)
    assert EngineConfig(model="m", max_loras=4, max_cpu_loras=2).max_loras == 4  # GPU residency is not the CPU's
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        EngineConfig(model="m", max_lora_rank=0)
    with pytest.raises(ValueError, match=r"adapter_memory_fraction must be in \(0, 1\)"):
        EngineConfig(model="m", adapter_memory_fraction=1.0)
    with pytest.raises(ValueError, match="adapter_memory_bytes must be None or a positive integer"):
        EngineConfig(model="m", adapter_memory_bytes=0)


def test_concurrent_requests_for_a_cold_adapter_cause_one_load(make_manager, refs):
    gate = threading.Event()
    fetcher = CountingFetcher(gate)
    m = make_manager(fetcher=fetcher)
    states = []
    threads = [threading.Thread(target=lambda: states.append(m.ensure_loading(refs[0]))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert states == ["loading"] * 8 and m.state(refs[0]) == "loading"
    gate.set()
    assert m.wait(refs[0], timeout=30) == "ready"
    assert fetcher.calls == 1 and m.counters.fetches == 1 and m.counters.loads == 1
    assert m.ensure_loading(refs[0]) == "ready" and fetcher.calls == 1


def test_disk_cache_is_content_addressed_and_survives_restart(make_manager, refs, tmp_path):
    cache = str(tmp_path / "shared-cache")
    fetcher = CountingFetcher()
    m1 = make_manager(cache_dir=cache, fetcher=fetcher)
    assert m1.ensure_loading(refs[1]) == "loading" and m1.wait(refs[1], 30) == "ready"
    entry = os.path.join(cache, AdapterManager.cache_key(refs[1]))
    assert AdapterManager.cache_key(refs[1]).startswith(refs[1].sha256)
    assert sorted(os.listdir(entry)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sha256_file(os.path.join(entry, "adapter_model.safetensors")) == refs[1].sha256
    assert os.listdir(cache) == [AdapterManager.cache_key(refs[1])]  # no leftover temp folder
    m2 = make_manager(cache_dir=cache, fetcher=fetcher)  # a restarted engine: empty memory, warm disk
    m2.ensure_loading(refs[1])
    assert m2.wait(refs[1], 30) == "ready"
    assert fetcher.calls == 1 and m2.counters.disk_hits == 1 and m2.counters.fetches == 0


def test_cpu_tier_is_lru_bounded(make_manager, refs):
    m = make_manager(fit=2, max_cpu_loras=2)
    for r in refs[:3]:
        m.ensure_loading(r)
        m.wait(r, 30)
    assert m.residency()["cpu"] == [refs[1].adapter_id, refs[2].adapter_id]
    assert m.state(refs[0]) == "absent" and m.counters.cpu_evictions == 1 and m.residency()["cpu_bytes"] > 0


def test_activation_evicts_the_lru_unpinned_adapter_not_in_use(make_manager, refs):
    m = make_manager(fit=2)
    for r in refs:
        m.ensure_loading(r)
        m.wait(r, 30)
    a, b, c, d = refs
    assert m.activate(a) == 0 and m.activate(b) == 1 and m.counters.evictions == 0
    assert m.activate(a) == 0 and m.counters.slot_hits == 1  # a is now the most recently used
    assert m.activate(c) == 1 and m.slot_of(b) is None and m.counters.evictions == 1  # b was LRU
    assert list(m.slots.held.values()) == [a.adapter_id, c.adapter_id]
    assert m.activate(d, in_use={a, c}) is None  # every byte serves a running request
    assert m.residency()["gpu_bytes"] == 2 * SIZE == m.residency()["gpu_budget_bytes"]
    assert m.activate(d, in_use={c}) == 0 and m.slot_of(a) is None and m.counters.evictions == 2
    assert m.counters.activations == 4 and m.slots.loads == 4


def test_pinned_adapters_keep_their_memory(make_manager, refs):
    m = make_manager(fit=2)
    a, b, c, d = refs
    assert m.pin(a) in ("loading", "ready")
    with pytest.raises(ValueError, match="leaving less than one largest adapter"):
        m.pin(b)
    for r in refs:
        m.ensure_loading(r)
        m.wait(r, 30)
    m.activate(a)
    m.activate(b)
    assert m.activate(c) == 1  # b goes, although a is older: a is pinned
    assert m.activate(d, in_use={c}) is None and m.slot_of(a) == 0
    m.unpin(a)
    assert m.activate(d, in_use={c}) == 0 and m.residency()["pinned"] == []


def test_failure_is_remembered_until_retried_and_leaves_nothing(make_manager, refs, tmp_path):
    fetcher = CountingFetcher()
    m = make_manager(fetcher=fetcher)
    missing = AdapterRef("tenant/gone/1", file_uri(tmp_path / "nowhere"), "0" * 64)
    m.ensure_loading(missing)
    assert m.wait(missing, 30) == "failed"
    assert isinstance(m.error(missing), AdapterFetchError) and "does not exist" in str(m.error(missing))
    assert m.ensure_loading(missing) == "failed" and fetcher.calls == 1  # remembered, not refetched
    assert os.listdir(m.cache_dir) == [] and m.activate(missing) is None
    assert m.residency()["failed"] == {"tenant/gone/1": str(m.error(missing))}
    assert m.ensure_loading(missing, retry=True) == "loading"
    assert m.wait(missing, 30) == "failed" and fetcher.calls == 2 and m.counters.failures == 2
    assert m.evict(missing) and m.state(missing) == "absent"


def test_fetchers_are_chosen_by_scheme(make_manager, refs, base):
    m = make_manager()
    s3 = AdapterRef("tenant/s3/1", "s3://bucket/adapters/tenant/s3/x.safetensors", refs[2].sha256)
    m.ensure_loading(s3)
    assert m.wait(s3, 30) == "failed"
    assert str(m.error(s3)) == "no fetcher for s3:// URIs (adapter 'tenant/s3/1'); registered: file"

    class FakeS3:  # the control plane's fetcher: here it serves refs[2]'s folder for any key
        def fetch(self, uri, dest_dir):
            return FileFetcher().fetch(refs[2].uri, dest_dir)

    m.register_fetcher("s3", FakeS3())
    m.ensure_loading(s3, retry=True)
    assert m.wait(s3, 30) == "ready" and m.activate(s3) == 0


def test_evict_during_load_discards_the_result(make_manager, refs):
    gate = threading.Event()
    m = make_manager(fetcher=CountingFetcher(gate))
    m.ensure_loading(refs[3])
    assert m.evict(refs[3]) and m.state(refs[3]) == "absent"
    gate.set()
    m._pool.shutdown(wait=True)  # let the worker finish
    assert m.state(refs[3]) == "absent" and m.residency()["cpu"] == [] and m.counters.loads == 0


def test_an_adapter_the_slots_refuse_fails_alone(make_manager, refs):
    m = make_manager(fit=2)
    for r in refs[:2]:
        m.ensure_loading(r)
        m.wait(r, 30)

    def refuse(slot, weights):
        raise ValueError("rank 4 does not fit")

    m.slots.load = refuse
    assert m.activate(refs[0]) is None
    assert m.state(refs[0]) == "failed" and str(m.error(refs[0])) == "rank 4 does not fit"
    assert m.residency()["gpu"] == {} and refs[0].adapter_id not in m.residency()["cpu"]
    assert m.state(refs[1]) == "ready"


def test_blob_store_outage_is_retried_by_the_next_request_but_a_bad_blob_is_not(make_manager, refs):
    """A fetch that failed because the blob store was down is tried again on the next ensure_loading; a fetch that
    failed for good (missing blob) stays failed until an explicit retry."""
    from loraplex.engine.lora.fetch import AdapterFetchError, AdapterFetchUnavailableError
    from loraplex.engine.lora.manager import is_transient_failure

    class Flaky(FileFetcher):
        def __init__(self, error):
            self.error, self.calls = error, 0

        def fetch(self, uri, dest_dir):
            self.calls += 1
            if self.calls == 1:
                raise self.error
            return super().fetch(uri, dest_dir)

    outage = Flaky(AdapterFetchUnavailableError("blob store unreachable"))
    m = make_manager(fetcher=outage)
    m.ensure_loading(refs[0])
    assert m.wait(refs[0], timeout=30) == "failed" and is_transient_failure(m.error(refs[0]))
    assert m.ensure_loading(refs[0]) == "loading"          # the next request retries at once
    assert m.wait(refs[0], timeout=30) == "ready" and outage.calls == 2

    missing = Flaky(AdapterFetchError("no such blob"))
    m2 = make_manager(fetcher=missing, cache_dir=None)
    m2.ensure_loading(refs[1])
    assert m2.wait(refs[1], timeout=30) == "failed" and not is_transient_failure(m2.error(refs[1]))
    assert m2.ensure_loading(refs[1]) == "failed" and missing.calls == 1   # not hammered by every request
    assert m2.ensure_loading(refs[1], retry=True) == "loading"
    assert m2.wait(refs[1], timeout=30) == "ready"


def test_max_loras_caps_residency_below_the_budget(make_manager, refs):
    """max_loras=1 with a budget for 4: one adapter resident at a time, pins refused (one must stay unpinned)."""
    m = make_manager(fit=4, max_loras=1)
    for r in refs[:2]:
        m.ensure_loading(r)
        m.wait(r, 30)
    a, b = refs[:2]
    assert m.activate(a) == 0 and m.activate(b, in_use={a}) is None
    assert m.activate(b) == 0 and m.slot_of(a) is None and m.residency()["gpu_bytes"] == SIZE
    with pytest.raises(ValueError, match="max_loras=1 must keep one resident adapter unpinned"):
        m.pin(a)


def test_an_adapter_larger_than_the_budget_fails_with_the_reason(make_manager, refs):
    m = make_manager(fit=2)
    m.ensure_loading(refs[0])
    m.wait(refs[0], 30)
    m.slots.footprint = lambda weights: 3 * SIZE
    assert m.activate(refs[0]) is None and m.state(refs[0]) == "failed"
    assert "more than the whole adapter budget" in str(m.error(refs[0]))
    assert m.residency()["gpu"] == {} and m.residency()["gpu_bytes"] == 0
