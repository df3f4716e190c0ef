"""The AdapterManager's disk tier under a byte cap (``cache_max_bytes``), with real PEFT adapters of the tiny llama:
the cap holds while many adapters come and go, LRU order follows loads, an entry being loaded survives, an evicted
adapter is fetched again with identical weights (also one sitting in a GPU slot), a restarted manager keeps the
order, many concurrent loads, adapters bigger than the cap, and the counters in engine stats and /metrics. The GPU
slots are a recording fake."""
from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.disk_cache import folder_bytes
from loraplex.engine.lora.fetch import FileFetcher, file_uri
from loraplex.engine.lora.manager import AdapterManager, sha256_file
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.lora.weights import load_adapter_weights
from tests.engine.lora.fakes import SIZE, FakeSlots


class CountingFetcher(FileFetcher):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def fetch(self, uri, dest_dir):
        with self.lock:
            self.calls.append(uri)
        return super().fetch(uri, dest_dir)


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return path, ModelConfig.from_pretrained(path)


@pytest.fixture(scope="module")
def sources(base, peft_adapter, tmp_path_factory):
    """Ten adapter folders: three real PEFT adapters (different weights), each copied to its own folder, so ten
    URIs, ten cache entries of equal size."""
    made = [peft_adapter(base[0], r=4, alpha=8, attention_only=True, seed=100 + i) for i in range(3)]
    root = tmp_path_factory.mktemp("disk-cache-sources")
    out = []
    for i in range(10):
        dest = root / f"a{i}"
        shutil.copytree(made[i % 3], dest)
        out.append(str(dest))
    return out


def ref_of(i: int, folder: str) -> AdapterRef:
    weights = os.path.join(folder, "adapter_model.safetensors")
    return AdapterRef(f"tenant/a{i}/1", file_uri(folder), sha256_file(weights))


@pytest.fixture(scope="module")
def refs(sources):
    return [ref_of(i, f) for i, f in enumerate(sources)]


@pytest.fixture(scope="module")
def entry_bytes(sources):
    sizes = {sum(os.path.getsize(os.path.join(f, n)) for n in ("adapter_config.json", "adapter_model.safetensors"))
             for f in sources}   # what an entry holds (PEFT's README.md is not fetched)
    assert len(sizes) == 1
    return sizes.pop()


@pytest.fixture
def make_manager(base, tmp_path):
    made = []

    def make(cap, *, fit=2, max_cpu_loras=2, cache_dir=None, fetcher=None, **kw):
        m = AdapterManager(FakeSlots(fit), base[1], gpu_budget_bytes=fit * SIZE, max_cpu_loras=max_cpu_loras,
                           max_rank=16, cache_dir=cache_dir or str(tmp_path / "cache"),
                           fetchers={"file": fetcher or CountingFetcher()}, cache_max_bytes=cap, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def load(m: AdapterManager, ref: AdapterRef) -> None:
    m.ensure_loading(ref)
    assert m.wait(ref, 30) == "ready", m.error(ref)


def entries(m: AdapterManager) -> list[str]:
    """Cache entries on disk, checked against the index (no download or graveyard folder left)."""
    names = sorted(os.listdir(m.cache_dir))
    assert names == sorted(m.disk.keys()), names
    assert folder_bytes(m.cache_dir) == m.disk.nbytes
    return names


def test_cap_holds_across_many_adapters_in_lru_order(make_manager, refs, entry_bytes):
    fetcher = CountingFetcher()
    m = make_manager(int(3.5 * entry_bytes), fetcher=fetcher)   # three entries fit
    for r in refs:
        load(m, r)
        assert len(entries(m)) <= 3 and m.disk.nbytes <= 3.5 * entry_bytes
    assert m.disk.keys() == [AdapterManager.cache_key(r) for r in refs[7:]]
    assert m.counters.fetches == 10 and m.residency()["counters"]["disk_evictions"] == 7
    m.evict(refs[7])                                  # out of memory; a load from disk makes it most recent
    load(m, refs[7])
    assert m.counters.disk_hits == 1 and m.counters.fetches == 10
    load(m, refs[0])                                  # a fetch again: the least recently used, 8, goes
    assert m.disk.keys() == [AdapterManager.cache_key(r) for r in (refs[9], refs[7], refs[0])]
    assert m.counters.fetches == 11 and fetcher.calls.count(refs[0].uri) == 2


def test_an_evicted_adapter_is_fetched_again_with_identical_weights(make_manager, refs, entry_bytes):
    m = make_manager(int(1.5 * entry_bytes), fit=2, max_cpu_loras=2)  # one entry fits
    load(m, refs[0])
    assert m.activate(refs[0]) is not None                      # in a GPU slot and on CPU
    first = {k: (t.lora_a.clone(), t.lora_b.clone()) for k, t in m._cpu[refs[0]].modules.items()}
    assert first and all(a.abs().sum() > 0 and b.abs().sum() > 0 for a, b in first.values())
    load(m, refs[1])                                            # its disk entry goes; memory tiers keep it
    assert m.disk.keys() == [AdapterManager.cache_key(refs[1])]
    assert m.slot_of(refs[0]) is not None and m.state(refs[0]) == "ready"
    assert m.activate(refs[0]) == m.slot_of(refs[0]) and m.counters.slot_hits == 1   # still served from its slot
    assert m.evict(refs[0])                                     # now out of every tier: next use fetches again
    fetches = m.counters.fetches
    load(m, refs[0])
    assert m.counters.fetches == fetches + 1 and m.counters.disk_hits == 0
    again = m._cpu[refs[0]].modules
    assert again.keys() == first.keys()
    for k, (a, b) in first.items():
        assert torch.equal(again[k].lora_a, a) and torch.equal(again[k].lora_b, b), k
    assert m.activate(refs[0]) is not None and m.disk.keys() == [AdapterManager.cache_key(refs[0])]


def test_an_entry_being_loaded_is_never_evicted(make_manager, refs, entry_bytes, base):
    gate, reading = threading.Event(), threading.Event()
    seen = {}

    def loader(folder, adapter_id):
        if adapter_id == refs[0].adapter_id and not gate.is_set():
            reading.set()
            assert gate.wait(30)
            seen["files"] = sorted(os.listdir(folder))          # the entry is still whole after the others came
        return load_adapter_weights(folder, base[1], max_rank=16, dtype=None, adapter_id=adapter_id)

    m = make_manager(int(1.5 * entry_bytes), fit=2, max_cpu_loras=4, max_workers=2, loader=loader)
    m.ensure_loading(refs[0])
    try:
        assert reading.wait(30)
        for r in refs[1:4]:                            # each one past the cap: refs[0]'s entry is the LRU
            load(m, r)
            assert AdapterManager.cache_key(refs[0]) in m.disk.keys()
    finally:
        gate.set()
    assert m.wait(refs[0], 30) == "ready"
    assert seen["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert len(entries(m)) == 1 and m.disk.nbytes <= 1.5 * entry_bytes   # back within the cap once released


def test_restarted_manager_keeps_lru_order_and_cap(make_manager, refs, entry_bytes, tmp_path):
    cache = str(tmp_path / "persist")
    m1 = make_manager(None, cache_dir=cache, max_cpu_loras=4)
    for r in refs[:4]:
        load(m1, r)
    m1.evict(refs[0])
    load(m1, refs[0])                                  # a disk hit: 0 becomes the most recently used
    keys = [AdapterManager.cache_key(r) for r in (refs[1], refs[2], refs[3], refs[0])]
    for age, k in enumerate(keys):                     # make the mtimes distinct whatever the clock's resolution
        os.utime(os.path.join(cache, k), (1_000_000 + age, 1_000_000 + age))
    os.makedirs(os.path.join(cache, ".fetch-crashed"))
    fetcher = CountingFetcher()
    m2 = make_manager(int(2.5 * entry_bytes), cache_dir=cache, fetcher=fetcher)  # restart with a cap
    assert m2.disk.keys() == keys[2:] and entries(m2) == sorted(keys[2:])
    assert m2.residency()["counters"]["disk_evictions"] == 2
    load(m2, refs[0])
    load(m2, refs[3])
    assert fetcher.calls == [] and m2.counters.disk_hits == 2
    load(m2, refs[1])
    assert fetcher.calls == [refs[1].uri]


def test_concurrent_loads_under_a_small_cap(make_manager, refs, entry_bytes):
    m = make_manager(int(2.5 * entry_bytes), fit=2, max_cpu_loras=3, max_workers=4)
    errors = []

    def client(seed: int) -> None:
        try:
            for k in range(12):
                r = refs[(seed * 3 + k) % len(refs)]
                for _ in range(50):                    # other clients' loads may push it out of CPU meanwhile
                    state = m.ensure_loading(r)
                    if state == "loading":
                        state = m.wait(r, 30)
                    if state in ("ready", "failed"):
                        break
                assert state == "ready", (r.adapter_id, state, m.error(r))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert not m.residency()["failed"] and m.counters.failures == 0
    assert len(entries(m)) <= 2 and m.disk.nbytes <= 2.5 * entry_bytes
    assert m.residency()["counters"]["disk_evictions"] > 0


def test_an_adapter_bigger_than_the_cap_is_served_but_not_cached(make_manager, refs, entry_bytes, caplog):
    fetcher = CountingFetcher()
    m = make_manager(entry_bytes - 1, fetcher=fetcher)
    with caplog.at_level("WARNING", logger="loraplex.engine.lora.disk_cache"):
        load(m, refs[0])
    assert "served but not cached" in caplog.text and refs[0].adapter_id in caplog.text
    assert os.listdir(m.cache_dir) == [] and m.disk.stats()["oversized"] == 1
    m.evict(refs[0])
    load(m, refs[0])
    assert fetcher.calls == [refs[0].uri] * 2 and m.activate(refs[0]) is not None


def test_a_corrupt_entry_is_discarded_and_fetched_again(make_manager, refs, entry_bytes):
    m = make_manager(10 * entry_bytes)
    load(m, refs[0])
    weights = os.path.join(m.cache_dir, AdapterManager.cache_key(refs[0]), "adapter_model.safetensors")
    with open(weights, "r+b") as f:                    # a bit flipped on disk
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    m.evict(refs[0])
    m.ensure_loading(refs[0])
    assert m.wait(refs[0], 30) == "failed" and "sha256 mismatch" in str(m.error(refs[0]))
    assert entries(m) == [] and m.disk.nbytes == 0           # the bad entry is gone, not evicted
    assert m.ensure_loading(refs[0], retry=True) == "loading" and m.wait(refs[0], 30) == "ready"
    assert entries(m) == [AdapterManager.cache_key(refs[0])] and m.counters.fetches == 2
    assert m.disk.stats()["evictions"] == 0


def test_an_entry_deleted_behind_the_cache_is_fetched_again(make_manager, refs, entry_bytes):
    fetcher = CountingFetcher()
    m = make_manager(10 * entry_bytes, fetcher=fetcher)
    load(m, refs[0])
    shutil.rmtree(os.path.join(m.cache_dir, AdapterManager.cache_key(refs[0])))   # an operator cleaned up
    m.evict(refs[0])
    load(m, refs[0])
    assert fetcher.calls == [refs[0].uri] * 2 and entries(m) == [AdapterManager.cache_key(refs[0])]


def test_disk_counters_reach_engine_stats_and_metrics(make_manager, refs, entry_bytes):
    from loraplex.engine.server.metrics import render_metrics
    from loraplex.engine.stats import adapter_stats, empty_stats

    m = make_manager(int(1.5 * entry_bytes))
    for r in refs[:3]:
        load(m, r)
    s = adapter_stats(m)
    assert s["adapter_disk_bytes"] == entry_bytes and s["adapter_disk_max_bytes"] == int(1.5 * entry_bytes)
    assert s["adapter_tiers"]["disk"] == 1 and s["adapter_counters"]["disk_evictions"] == 2
    assert {"adapter_disk_bytes", "adapter_disk_max_bytes"} <= empty_stats().keys()
    text = render_metrics({**empty_stats(), **s}, model="tiny").decode()
    assert f"loraplex_engine_server_adapter_disk_bytes {float(entry_bytes)}" in text
    assert f"loraplex_engine_server_adapter_disk_max_bytes {float(int(1.5 * entry_bytes))}" in text
    assert 'loraplex_engine_server_adapter_events_total{event="disk_evictions"} 2.0' in text
    unbounded = render_metrics({**empty_stats(), **adapter_stats(make_manager(None, cache_dir=m.cache_dir + "-u"))},
                               model="tiny").decode()
    assert "adapter_disk_max_bytes" not in unbounded and "loraplex_engine_server_adapter_disk_bytes 0.0" in unbounded
