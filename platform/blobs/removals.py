"""Removing a blob that a failed write may have left behind, also while the store is down.

A write can fail after the store has it: S3 completes a multipart upload whose answer never reaches the platform
(the connection dropped), so the upload is reported failed while its object exists. Its writer removes the key at
once; when the store refuses that too, the key waits here and a background thread retries with backoff until the
store answers (or ``give_up_after_s`` passes: the janitor's orphan pass removes it later in any case).

    removals_of(store).remove(key)       # now if the store answers, else soon after it is back
    removals_of(store).remove_later(key) # the store just failed: straight to the retry thread (no blocking retry)
    removals_of(store).pending()         # keys still waiting

Only keys that nothing else may point at belong here (an upload's own, version-specific key)."""
from __future__ import annotations

import logging
import threading
import time
import weakref

from loraplex.platform.blobs.base import BlobStore, BlobStoreUnavailable

log = logging.getLogger(__name__)


class PendingRemovals:
    """The keys of one store that wait for removal, and the thread that retries them."""

    def __init__(self, store: BlobStore, *, first_retry_s: float = 0.25, max_retry_s: float = 10.0,
                 give_up_after_s: float = 900.0):
        self.store = store
        self.first_retry_s, self.max_retry_s, self.give_up_after_s = first_retry_s, max_retry_s, give_up_after_s
        self._keys: dict[str, float] = {}          # key -> monotonic time it was handed over
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def remove(self, key: str) -> bool:
        """Removes ``key`` (and any unfinished write of it) now; returns False when the store was unavailable and
        the key was left to the retry thread."""
        if self._try(key):
            return True
        log.warning("blob %s could not be removed (the blob store is unavailable); retrying in the background", key)
        self.remove_later(key)
        return False

    def remove_later(self, key: str) -> None:
        """Leaves ``key`` to the retry thread, which tries at once and then with backoff: for a caller whose store
        call just failed, so that its own answer does not wait for another round of timeouts."""
        with self._lock:
            self._keys.setdefault(key, time.monotonic())
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="loraplex-blob-removals", daemon=True)
                self._thread.start()
        self._wake.set()

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)

    def _try(self, key: str) -> bool:
        try:
            self.store.delete(key)
            for upload in self.store.incomplete_uploads(key):
                if upload.key == key:
                    self.store.abort_incomplete(upload)
            return True
        except BlobStoreUnavailable:
            return False

    def _run(self) -> None:
        delay = self.first_retry_s
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            with self._lock:
                keys = dict(self._keys)
            if not keys:
                with self._lock:
                    if not self._keys:
                        self._thread = None
                        return
                continue
            settled = False
            for key, since in keys.items():
                if self._try(key):
                    log.info("blob %s removed after the blob store came back", key)
                elif time.monotonic() - since > self.give_up_after_s:
                    log.error("blob %s still could not be removed after %.0f s; the janitor's orphan pass removes "
                              "it", key, self.give_up_after_s)
                else:
                    continue
                settled = True
                with self._lock:
                    self._keys.pop(key, None)
            delay = self.first_retry_s if settled else min(delay * 2, self.max_retry_s)


_BY_STORE: "weakref.WeakKeyDictionary[BlobStore, PendingRemovals]" = weakref.WeakKeyDictionary()
_BY_STORE_LOCK = threading.Lock()


def removals_of(store: BlobStore) -> PendingRemovals:
    """The one ``PendingRemovals`` of ``store`` in this process."""
    with _BY_STORE_LOCK:
        removals = _BY_STORE.get(store)
        if removals is None:
            removals = _BY_STORE[store] = PendingRemovals(store)
        return removals
