"""DiskCache on its own (engine/lora/disk_cache.py): LRU order under a byte cap, held entries never evicted,
the start-up scan (recency from mtimes, leftovers of a crashed run), adapters bigger than the cap, many threads at
once; plus the size parser behind ``--adapter-cache-max-bytes`` and the EngineConfig field. Entries here are
plain folders of random bytes (the manager's real adapters are in test_disk_cache_manager.py)."""
from __future__ import annotations

import logging
import os
import random
import shutil
import threading

import pytest

from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.lora.disk_cache import DiskCache, folder_bytes, parse_size


def key(i: int) -> str:
    return f"{i:064x}-{i:016x}"


def download(cache: DiskCache, nbytes: int, seed: int) -> str:
    """A finished fetch: the two PEFT file names in a ``.fetch-*`` folder, ``nbytes`` of random bytes in all."""
    folder = cache.temp_dir()
    data = random.Random(seed).randbytes(nbytes)
    with open(os.path.join(folder, "adapter_config.json"), "wb") as f:
        f.write(data[:10])
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(data[10:])
    return folder


def put(cache: DiskCache, i: int, nbytes: int = 100) -> None:
    """Fetch and load entry ``i`` (publish, then release)."""
    entry = cache.publish(download(cache, nbytes, seed=i), key(i))
    assert entry is not None
    cache.release(entry)


def on_disk(root) -> list[str]:
    return sorted(os.listdir(root))


def test_least_recently_used_entries_go_first_and_the_cap_holds(tmp_path):
    cache = DiskCache(str(tmp_path), max_bytes=350)   # three 100-byte entries fit, not four
    for i in range(3):
        put(cache, i)
    assert cache.keys() == [key(0), key(1), key(2)] and cache.nbytes == 300
    hit = cache.lookup(key(0))                        # a load from disk is a use: 0 becomes most recent
    assert hit is not None and hit.path == str(tmp_path / key(0))
    cache.release(hit)
    put(cache, 3)                                     # 400 > 350: the least recently used, 1, goes
    assert cache.keys() == [key(2), key(0), key(3)] and cache.nbytes == 300
    assert on_disk(tmp_path) == sorted([key(0), key(2), key(3)])   # no .fetch-/.evict- folder left
    assert cache.lookup(key(1)) is None
    put(cache, 4, nbytes=220)                         # 520: 2 then 0 go (3 and 4 fit in 320)
    assert cache.keys() == [key(3), key(4)] and cache.nbytes == 320
    assert cache.stats() == {"bytes": 320, "entries": 2, "max_bytes": 350, "evictions": 3, "oversized": 0}
    assert folder_bytes(str(tmp_path)) == 320


def test_held_entries_are_never_evicted_and_go_once_released(tmp_path):
    cache = DiskCache(str(tmp_path), max_bytes=250)
    put(cache, 0)
    held = cache.lookup(key(0))                       # a load is reading entry 0
    put(cache, 1)
    put(cache, 2)                                     # 300 > 250: 0 is the LRU but held, so 1 goes
    assert cache.keys() == [key(0), key(2)]
    new = cache.publish(download(cache, 100, seed=3), key(3))   # 300 again: 2 goes, 0 and 3 are held
    assert cache.keys() == [key(0), key(3)] and os.path.isfile(os.path.join(held.path, "adapter_model.safetensors"))
    cache.release(new)
    cache.release(held)
    assert cache.keys() == [key(0), key(3)] and cache.nbytes == 200   # within the cap: nothing else to do
    held2, held3 = cache.lookup(key(0)), cache.lookup(key(3))
    big = cache.publish(download(cache, 150, seed=4), key(4))  # 350 with everything held: over the cap for now
    assert cache.nbytes == 350 and len(cache) == 3
    for e in (held2, big):
        cache.release(e)
    assert cache.keys() == [key(3), key(4)] and cache.nbytes == 250   # 0 went as soon as nobody held it
    cache.release(held3)
    assert on_disk(tmp_path) == sorted([key(3), key(4)])


def test_a_racing_twin_publish_shares_the_first_entry(tmp_path):
    cache = DiskCache(str(tmp_path), max_bytes=None)
    first = cache.publish(download(cache, 100, seed=0), key(0))
    late = download(cache, 100, seed=0)
    second = cache.publish(late, key(0))              # the same adapter fetched twice at once
    assert second is first and first.users == 2 and os.path.isdir(late)  # the caller deletes its download
    cache.release(first)
    cache.release(second)
    assert len(cache) == 1 and cache.nbytes == 100


def test_discard_removes_an_entry_at_once(tmp_path):
    cache = DiskCache(str(tmp_path), max_bytes=1000)
    put(cache, 0)
    entry = cache.lookup(key(0))
    cache.discard(entry)                              # its bytes failed a check
    cache.release(entry)
    assert len(cache) == 0 and cache.nbytes == 0 and on_disk(tmp_path) == []
    assert cache.stats()["evictions"] == 0            # not an eviction: a bad entry


def test_an_entry_bigger_than_the_cap_is_not_cached(tmp_path, caplog):
    cache = DiskCache(str(tmp_path), max_bytes=250)
    put(cache, 0)
    put(cache, 1)
    folder = download(cache, 300, seed=2)
    with caplog.at_level(logging.WARNING, logger="loraplex.engine.lora.disk_cache"):
        assert cache.publish(folder, key(2), label="t/huge/1") is None
    assert "t/huge/1 is 300 bytes, more than the whole adapter disk cache (max 250 bytes)" in caplog.text
    assert os.path.isdir(folder)                      # left to the caller, who loads from it and deletes it
    assert cache.keys() == [key(0), key(1)] and cache.stats()["oversized"] == 1   # the others stay cached
    off = DiskCache(str(tmp_path / "off"), max_bytes=0)  # 0: cache nothing, quietly
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loraplex.engine.lora.disk_cache"):
        assert off.publish(download(off, 50, seed=3), key(3)) is None
    assert caplog.text == "" and len(off) == 0


def test_restart_scan_rebuilds_lru_order_from_mtimes_and_drops_leftovers(tmp_path):
    first = DiskCache(str(tmp_path), max_bytes=None)
    for i in range(4):
        put(first, i)
    for age, i in enumerate([2, 0, 3, 1]):            # last uses: 1 most recent, 2 oldest
        os.utime(tmp_path / key(i), (1_000_000 + age, 1_000_000 + age))
    download(first, 64, seed=9)                       # a fetch the crash interrupted
    os.makedirs(tmp_path / f".evict-{key(7)}-1")      # an eviction it interrupted
    (tmp_path / f".evict-{key(7)}-1" / "adapter_model.safetensors").write_bytes(b"x" * 10)
    os.makedirs(tmp_path / key(8))                    # half an entry: no weights
    (tmp_path / key(8) / "adapter_config.json").write_text("{}")
    os.makedirs(tmp_path / "lost+found")              # not ours: left alone, not counted
    (tmp_path / "notes.txt").write_text("operator's file")

    again = DiskCache(str(tmp_path), max_bytes=None)
    assert again.keys() == [key(2), key(0), key(3), key(1)] and again.nbytes == 400
    assert on_disk(tmp_path) == sorted([key(i) for i in range(4)] + ["lost+found", "notes.txt"])
    smaller = DiskCache(str(tmp_path), max_bytes=250)  # restarted with a lower cap: the two oldest go at once
    assert smaller.keys() == [key(3), key(1)] and smaller.stats()["evictions"] == 2
    assert on_disk(tmp_path) == sorted([key(3), key(1), "lost+found", "notes.txt"])
    hit = smaller.lookup(key(3))                      # a use updates the mtime, so the next start sees it
    smaller.release(hit)
    assert DiskCache(str(tmp_path), max_bytes=None).keys() == [key(1), key(3)]


def test_many_threads_keep_the_index_and_the_folder_consistent(tmp_path):
    cache = DiskCache(str(tmp_path), max_bytes=1000)
    sizes = {i: 100 + 37 * (i % 5) for i in range(24)}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                i = rng.randrange(24)
                entry = cache.lookup(key(i))
                if entry is None:
                    folder = download(cache, sizes[i], seed=i)
                    entry = cache.publish(folder, key(i))
                    if os.path.isdir(folder):     # a twin won: ours is the caller's to delete
                        shutil.rmtree(folder)
                assert os.path.getsize(os.path.join(entry.path, "adapter_model.safetensors")) == sizes[i] - 10
                cache.release(entry)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert cache.nbytes <= 1000 and cache.stats()["evictions"] > 0
    assert on_disk(tmp_path) == sorted(cache.keys())  # no leftover download or graveyard
    assert folder_bytes(str(tmp_path)) == cache.nbytes == sum(sizes[int(k[:64], 16)] for k in cache.keys())


@pytest.mark.parametrize("text, expected", [
    ("21474836480", 21474836480), ("20GiB", 20 * 1024 ** 3), ("20Gi", 20 * 1024 ** 3), ("20gib", 20 * 1024 ** 3),
    ("500MB", 500_000_000), ("500M", 500_000_000), ("1.5KiB", 1536), ("0", 0), ("7B", 7), ("none", None),
    ("unlimited", None), (None, None), (123, 123),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["20 gigs", "-5", "GiB", "", "1e9"])
def test_parse_size_refuses_what_it_cannot_read(text):
    with pytest.raises(ValueError, match="cannot read .* as a size"):
        parse_size(text)


def test_engine_config_validates_the_cap():
    assert EngineConfig(model="m").adapter_cache_max_bytes == 20 * 1024 ** 3
    assert EngineConfig(model="m", adapter_cache_max_bytes=None).adapter_cache_max_bytes is None
    for bad in (-1, 1.5, "20GiB", True):
        with pytest.raises(ValueError, match="adapter_cache_max_bytes must be None .* or an integer >= 0"):
            EngineConfig(model="m", adapter_cache_max_bytes=bad)
    with pytest.raises(ValueError, match="max_bytes must be None or an integer >= 0"):
        DiskCache("/nonexistent-never-created", max_bytes=-1)


def test_engine_serve_passes_the_cap(monkeypatch):
    import loraplex.commands.engine as engine_cmd
    import loraplex.engine.server.serve as serve_mod
    from loraplex.cli import main

    seen = []
    monkeypatch.setattr(engine_cmd, "_check_settings", lambda model, kwargs: None)   # "/m" has no config.json
    monkeypatch.setattr(serve_mod, "real_service", lambda model, **kw: seen.append(kw))
    monkeypatch.setattr(serve_mod, "serve", lambda make, **kw: make())
    monkeypatch.delenv("LORAPLEX_ADAPTER_CACHE_MAX_BYTES", raising=False)
    main(["engine", "serve", "--model", "/m", "--enable-lora"])
    main(["engine", "serve", "--model", "/m", "--enable-lora", "--adapter-cache-max-bytes", "3Gi"])
    main(["engine", "serve", "--model", "/m", "--enable-lora", "--adapter-cache-max-bytes", "none"])
    monkeypatch.setenv("LORAPLEX_ADAPTER_CACHE_MAX_BYTES", "1MiB")
    main(["engine", "serve", "--model", "/m", "--enable-lora"])
    assert [kw["adapter_cache_max_bytes"] for kw in seen] == [20 * 1024 ** 3, 3 * 1024 ** 3, None, 1024 ** 2]
    with pytest.raises(SystemExit):
        main(["engine", "serve", "--model", "/m", "--enable-lora", "--adapter-cache-max-bytes", "lots"])
