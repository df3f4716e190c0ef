"""``PendingRemovals``: a key the store refuses to remove is retried in the background until the store answers, an
unfinished write of it is aborted too, and a store that never comes back is left to the janitor after
``give_up_after_s``. A local store whose operations fail while it is switched 'down'."""
from __future__ import annotations

import hashlib
import os
import threading
import time

from loraplex.platform.blobs.base import BlobStoreUnavailable
from loraplex.platform.blobs.local import PART_MARK, LocalBlobStore
from loraplex.platform.blobs.removals import PendingRemovals, removals_of


class FlakyStore(LocalBlobStore):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.down, self.refused = False, 0

    def _check(self) -> None:
        if self.down:
            self.refused += 1
            raise BlobStoreUnavailable("store down (test)")

    def delete(self, key: str) -> None:
        self._check()
        super().delete(key)

    def incomplete_uploads(self, prefix: str = ""):
        self._check()
        return super().incomplete_uploads(prefix)


def put(store, tmp_path, key: str) -> None:
    data = os.urandom(3000)
    src = tmp_path / "src"
    src.write_bytes(data)
    store.put_file(key, str(src), sha256=hashlib.sha256(data).hexdigest())


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_removed_at_once_when_the_store_answers(tmp_path):
    store = FlakyStore(str(tmp_path / "blobs"))
    put(store, tmp_path, "adapters/t/a/x.safetensors")
    assert PendingRemovals(store).remove("adapters/t/a/x.safetensors") is True
    assert store.list_keys() == []


def test_retried_until_the_store_is_back(tmp_path):
    store = FlakyStore(str(tmp_path / "blobs"))
    keep, gone = "adapters/t/a/keep.safetensors", "adapters/t/a/gone.safetensors"
    put(store, tmp_path, keep)
    put(store, tmp_path, gone)
    removals = PendingRemovals(store, first_retry_s=0.02, max_retry_s=0.1)
    store.down = True
    assert removals.remove(gone) is False
    assert removals.pending() == [gone]
    wait_until(lambda: store.refused >= 4)           # retried, with the store still refusing
    assert removals.pending() == [gone] and sorted(store.list_keys()) == [gone, keep]
    store.down = False
    wait_until(lambda: not removals.pending())
    assert store.list_keys() == [keep]
    refused = store.refused
    store.down = True                                  # nothing pending: the thread stopped and touches nothing
    time.sleep(0.3)
    assert store.refused == refused


def test_unfinished_write_of_the_key_is_aborted(tmp_path):
    store = FlakyStore(str(tmp_path / "blobs"))
    key = "adapters/t/a/half.safetensors"
    folder = os.path.dirname(store._path(key))
    os.makedirs(folder)
    with open(os.path.join(folder, f".half.safetensors{PART_MARK}test"), "wb") as f:   # a killed write's temp file
        f.write(b"partial")
    assert [u.key for u in store.incomplete_uploads("adapters/")] == [key]
    assert PendingRemovals(store).remove(key) is True
    assert store.incomplete_uploads("adapters/") == []


def test_gives_up_after_the_deadline_and_leaves_it_to_the_janitor(tmp_path):
    store = FlakyStore(str(tmp_path / "blobs"))
    key = "adapters/t/a/stuck.safetensors"
    put(store, tmp_path, key)
    removals = PendingRemovals(store, first_retry_s=0.02, max_retry_s=0.05, give_up_after_s=0.2)
    store.down = True
    removals.remove(key)
    wait_until(lambda: not removals.pending(), timeout_s=5)
    store.down = False
    assert store.list_keys() == [key]


def test_one_instance_per_store(tmp_path):
    a, b = LocalBlobStore(str(tmp_path / "a")), LocalBlobStore(str(tmp_path / "b"))
    assert removals_of(a) is removals_of(a) and removals_of(a) is not removals_of(b)


def test_remove_later_leaves_the_first_try_to_the_thread(tmp_path):
    store = FlakyStore(str(tmp_path / "blobs"))
    key = "adapters/t/a/later.safetensors"
    put(store, tmp_path, key)
    removals = PendingRemovals(store, first_retry_s=0.02, max_retry_s=0.1)
    store.down = True
    caller = threading.get_ident()
    threads = []
    real = store.delete
    store.delete = lambda k: threads.append(threading.get_ident()) or real(k)
    assert removals.remove_later(key) is None
    wait_until(lambda: store.refused >= 2)
    store.down = False
    wait_until(lambda: not removals.pending())
    assert store.list_keys() == [] and threads and caller not in threads
