"""AdapterManager: makes adapters resident, tier by tier, off the step loop.

    fetcher (file://, s3://) ──▶ disk cache ──▶ CPU LRU ──────────▶ GPU memory (AdapterPool, pool.py)
      by URI scheme        cache_dir/<sha>-<uri>/ max_cpu_loras      byte budget: each adapter its own size;
                           sha256 verified      pinned memory      activate(): LRU unpinned adapters no running
                           LRU, cache_max_bytes on CUDA            request uses are evicted; the copy runs on a
                           (disk_cache.py)                         side stream (usable once ``is_ready``)
      └──────────── background thread pool ───────────┘            └── step thread only ──┘

``ensure_loading(ref)`` starts at most one load per ref (single-flight): fetch (or a disk-cache hit), sha256
check, then ``load_adapter_weights`` (format checks against the base model, NaN/Inf) into CPU
``AdapterWeights``. A failure is remembered per ref (``state`` = "failed", ``error``) and leaves nothing in any
tier; ``evict(ref)`` (or ``ensure_loading(ref, retry=True)``) forgets it. The disk cache (``disk_cache.DiskCache``)
keeps at most ``cache_max_bytes``, least recently used entries out first, never one a load is reading; an evicted
adapter is simply fetched again. ``activate(ref, in_use)`` starts copying a CPU-ready adapter into GPU memory (a
slot of its own size); ``is_ready(ref)`` says when the copy is done. Both touch device memory, so only the thread
that runs the model steps may call them (the engine's scheduler does).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Literal

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.disk_cache import DiskCache
from loraplex.engine.lora.fetch import (ADAPTER_FILES, AdapterFetchError, AdapterFetchUnavailableError, Fetcher,
                                        default_fetchers)
from loraplex.engine.lora.latency import LatencyHistogram
from loraplex.engine.lora.pool import AdapterPool
from loraplex.engine.lora.ref import AdapterRef

logger = logging.getLogger(__name__)

AdapterState = Literal["absent", "loading", "ready", "failed"]
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterChecksumError(ValueError):
    """The fetched ``adapter_model.safetensors`` does not have the sha256 the reference names."""


class AdapterLoadError(RuntimeError):
    """What a request for an adapter that could not be loaded finishes with. ``retryable``: the failure was in
    fetching the bytes (blob store down or slow), so the same request may succeed later; otherwise the adapter
    itself is bad (format, checksum) and retrying cannot help."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def is_transient_failure(err: BaseException | None) -> bool:
    """Blob store outages are transient (the next request retries); a missing blob, a bad adapter or a checksum
    mismatch is not."""
    return isinstance(err, AdapterFetchUnavailableError)


@dataclass
class AdapterCounters:
    """Monotonic counts since start. A "swap" is an ``activation`` that needed an ``eviction``."""

    fetches: int = 0          # fetcher calls (disk-cache misses)
    disk_hits: int = 0        # loads served from the disk cache
    loads: int = 0            # adapters converted into CPU weights
    cpu_evictions: int = 0    # CPU LRU drops
    activations: int = 0      # CPU -> GPU copies started
    slot_hits: int = 0        # admissions whose adapter was already resident on the GPU
    evictions: int = 0        # adapters dropped from GPU memory to make room for another (or by evict())
    failures: int = 0         # loads that failed
    disk_evictions: int = 0   # disk-cache entries deleted to fit cache_max_bytes (kept by the DiskCache)


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class AdapterManager:
    """GPU memory <- CPU LRU <- disk cache <- fetcher, for one engine. Thread-safe except ``activate``,
    ``is_ready`` and ``evict``, which touch device memory and belong to the step thread.

    ``gpu_budget_bytes``: the device bytes resident adapters may take (decided at start, beside the KV pool);
    ``max_loras``: an optional cap on how many are resident at once (None: memory alone decides)."""

    def __init__(self, slots: Any, model_config: ModelConfig, *, max_cpu_loras: int, max_rank: int,
                 cache_dir: str | None, gpu_budget_bytes: int, max_loras: int | None = None,
                 fetchers: dict[str, Fetcher] | None = None, dtype: Any = None,
                 base_model_name: str | None = None, pin_memory: bool = False, max_workers: int = 2,
                 loader: Callable[[str, str], Any] | None = None, cache_max_bytes: int | None = None) -> None:
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras must be None or >= 1, got {max_loras}")
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {max_cpu_loras}")
        self.slots = slots
        self.pool = AdapterPool(slots, budget_bytes=gpu_budget_bytes, max_loras=max_loras)
        self.model_config = model_config
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.base_model_name = base_model_name
        self.pin_memory = pin_memory
        self.fetchers: dict[str, Fetcher] = dict(default_fetchers() if fetchers is None else fetchers)
        self._own_cache_dir = cache_dir is None
        self.cache_dir = tempfile.mkdtemp(prefix="loraplex-adapters-") if cache_dir is None else cache_dir
        self.disk = DiskCache(self.cache_dir, cache_max_bytes)  # scans what a previous run left
        self._loader = loader or self._default_loader(dtype)
        self._lock = threading.RLock()
        self._progress = threading.Condition(self._lock)  # notified when a load ends
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="loraplex-adapter-load")
        self._cpu: OrderedDict[AdapterRef, Any] = OrderedDict()   # LRU first
        self.load_seconds: deque[float] = deque(maxlen=1024)       # disk / fetch -> CPU times of completed loads
        self.load_latency = LatencyHistogram()                     # the same, every load since start
        self._copied: set[AdapterRef] = set()  # activated, their first admission not yet made (no slot hit)
        self._loading: dict[AdapterRef, threading.Event] = {}  # set when the load is over
        self._failed: dict[AdapterRef, BaseException] = {}
        self._pinned: set[AdapterRef] = set()
        self.counters = AdapterCounters(disk_evictions=self.disk.evictions)  # the start-up scan may have evicted

    def _default_loader(self, dtype: Any) -> Callable[[str, str], Any]:
        def load(folder: str, adapter_id: str):
            # validates with loraplex.engine.lora.format (config, header, shapes vs the base, rank) and refuses
            # NaN/Inf; raises AdapterFormatError saying what is wrong
            from loraplex.engine.lora.weights import load_adapter_weights

            return load_adapter_weights(folder, self.model_config, max_rank=self.max_rank, dtype=dtype,
                                        base_model_name=self.base_model_name, adapter_id=adapter_id)
        return load

    def register_fetcher(self, scheme: str, fetcher: Fetcher) -> None:
        """Serve ``scheme://`` URIs with ``fetcher`` (the control plane registers ``s3``)."""
        with self._lock:
            self.fetchers[scheme.lower()] = fetcher

    # ---- queries ----------------------------------------------------------------------------------------------
    def slot_of(self, ref: AdapterRef) -> int | None:
        """GPU slot of ``ref`` if it is resident (its copy may still be in flight: ``is_ready``)."""
        with self._lock:
            return self.pool.slot_of(ref)

    def is_ready(self, ref: AdapterRef) -> bool:
        """Resident on the GPU with its copy complete, so a step may use it (never blocks)."""
        with self._lock:
            return self.pool.is_ready(ref)

    def state(self, ref: AdapterRef) -> AdapterState:
        """"ready" once its weights are on CPU (or in a slot), "loading", "failed", or "absent"."""
        with self._lock:
            if ref in self._failed:
                return "failed"
            if ref in self._cpu or self.pool.slot_of(ref) is not None:
                return "ready"
            return "loading" if ref in self._loading else "absent"

    def error(self, ref: AdapterRef) -> BaseException | None:
        """Why the last load of ``ref`` failed, or None."""
        with self._lock:
            return self._failed.get(ref)

    def residency(self) -> dict:
        """A snapshot for operators and the router: what is where, and the counters."""
        with self._lock:
            pool = self.pool
            return {
                "gpu": {slot: ref.adapter_id for slot, ref in sorted(pool.resident().items())},
                "gpu_bytes": pool.used_bytes, "gpu_budget_bytes": pool.budget_bytes,
                "gpu_copying": [ref.adapter_id for ref in pool.copying()],
                "load_seconds": {"cpu": list(self.load_seconds), "gpu": list(pool.copy_seconds)},
                "load_latency": {"cpu": self.load_latency.snapshot(), "gpu": pool.copy_latency.snapshot()},
                "cpu": [ref.adapter_id for ref in self._cpu],
                "cpu_bytes": sum(int(getattr(w, "nbytes", 0)) for w in self._cpu.values()),
                "loading": [ref.adapter_id for ref in self._loading],
                "failed": {ref.adapter_id: str(e) for ref, e in self._failed.items()},
                "pinned": sorted(ref.adapter_id for ref in self._pinned),
                "max_loras": self.pool.max_loras, "max_cpu_loras": self.max_cpu_loras,
                "disk": self.disk.stats(),
                "counters": self._counters(),
            }

    def _counters(self) -> dict:
        """Under the lock: the counters, with the disk cache's evictions."""
        self.counters.disk_evictions = self.disk.evictions
        return asdict(self.counters)

    # ---- background loads -------------------------------------------------------------------------------------
    def ensure_loading(self, ref: AdapterRef, *, retry: bool = False) -> AdapterState:
        """Start loading ``ref`` unless it is loaded or loading (one load however often it is asked).
        A ref whose fetch failed (transient: blob store down) is tried again; one that failed validation stays
        failed unless ``retry``. Returns the state after the call."""
        if not isinstance(ref, AdapterRef):
            raise TypeError(f"adapter must be an AdapterRef, got {type(ref).__name__}")
        with self._lock:
            if retry or is_transient_failure(self._failed.get(ref)):
                self._failed.pop(ref, None)
            if ref in self._failed:
                return "failed"
            if ref in self._cpu or self.pool.slot_of(ref) is not None:
                return "ready"
            if ref not in self._loading:
                done = threading.Event()
                self._loading[ref] = done
                self._pool.submit(self._run, ref, done)
            return "loading"

    def wait(self, ref: AdapterRef, timeout: float | None = None) -> AdapterState:
        """Block until ``ref`` is no longer loading (for tests and the platform's explicit preload)."""
        with self._lock:
            done = self._loading.get(ref)
        if done is not None:
            done.wait(timeout)
        return self.state(ref)

    def _run(self, ref: AdapterRef, done: threading.Event) -> None:
        """Worker thread: load, then publish the result (or the failure) unless evicted meanwhile."""
        try:
            t0 = time.monotonic()
            try:
                weights, err = self._load(ref), None
            except Exception as e:  # noqa: BLE001 - remembered per ref, surfaced to its requests
                weights, err = None, e
            with self._lock:
                if self._loading.get(ref) is not done:  # evicted while loading: drop the result
                    return
                del self._loading[ref]
                if err is not None:
                    self.counters.failures += 1
                    self._failed[ref] = err
                    logger.warning("adapter %s failed to load: %s", ref.adapter_id, err)
                    return
                self._cpu[ref] = weights
                self.load_seconds.append(time.monotonic() - t0)
                self.load_latency.observe(self.load_seconds[-1])
                self.counters.loads += 1
                self._trim_cpu(keep=ref)
        finally:
            done.set()
            with self._lock:
                self._progress.notify_all()

    def wait_for_progress(self, timeout: float) -> bool:
        """Sleep until some load ends or ``timeout`` passes (an idle step loop waiting on loads calls this
        instead of spinning). False at once if nothing is loading."""
        with self._lock:
            if not self._loading:
                return False
            return self._progress.wait(timeout)

    def _trim_cpu(self, keep: AdapterRef) -> None:
        """Drop CPU entries, LRU first, until within max_cpu_loras: never pinned ones or ``keep``; those resident on
        the GPU go first (the GPU copy serves them; if it is evicted later they come back from disk)."""
        while len(self._cpu) > self.max_cpu_loras:
            candidates = [r for r in self._cpu if r != keep and r not in self._pinned]
            if not candidates:
                return
            victim = next((r for r in candidates if self.pool.slot_of(r) is not None), candidates[0])
            del self._cpu[victim]
            self.counters.cpu_evictions += 1

    def _load(self, ref: AdapterRef) -> Any:
        """Worker thread: disk cache or fetch -> sha256 -> checked CPU weights. The disk entry is held while it is
        read (never evicted under a load); a bad adapter leaves nothing on disk."""
        key = self.cache_key(ref) if ref.sha256 else None
        entry = self.disk.lookup(key) if key else None
        if entry is not None and not os.path.isfile(os.path.join(entry.path, WEIGHTS_FILE)):  # deleted behind us
            self.disk.discard(entry)
            self.disk.release(entry)
            entry = None
        temp: str | None = None
        try:
            if entry is not None:
                folder = entry.path
                with self._lock:
                    self.counters.disk_hits += 1
                self._verify_sha256(ref, folder)
            else:
                temp = self.disk.temp_dir()
                folder = self._fetch(ref, temp)
                self._verify_sha256(ref, folder)
                if key:  # refs without a sha256, and adapters bigger than the cap, load from the download folder
                    entry = self.disk.publish(folder, key, label=ref.adapter_id)
                    if entry is not None:
                        folder = entry.path
            weights = self._loader(folder, ref.adapter_id)
            if self.pin_memory and hasattr(weights, "pin_memory"):
                weights = weights.pin_memory() or weights
            return weights
        except BaseException:
            if entry is not None:
                self.disk.discard(entry)
            raise
        finally:
            if entry is not None:
                self.disk.release(entry)
            if temp is not None:  # whatever of the download was not moved into the cache
                shutil.rmtree(temp, ignore_errors=True)
            with self._lock:
                self.counters.disk_evictions = self.disk.evictions

    def num_disk_entries(self) -> int:
        """Adapters in the disk cache (fetches in flight, ``.fetch-*``, excluded)."""
        return len(self.disk)

    @staticmethod
    def cache_key(ref: AdapterRef) -> str:
        """Disk-cache entry name: the weights' sha256 plus a digest of the URI. The URI carries the adapter's
        config (inline for s3://, a per-version folder for file://), so two versions with equal weights but
        different configs (another alpha, say) never share an entry."""
        return f"{ref.sha256}-{hashlib.sha256(ref.uri.encode()).hexdigest()[:16]}"

    def _fetch(self, ref: AdapterRef, dest: str) -> str:
        with self._lock:
            fetcher = self.fetchers.get(ref.scheme)
            self.counters.fetches += 1
        if fetcher is None:
            raise AdapterFetchError(f"no fetcher for {ref.scheme}:// URIs (adapter {ref.adapter_id!r}); "
                                    f"registered: {', '.join(sorted(self.fetchers)) or 'none'}")
        folder = fetcher.fetch(ref.uri, dest)
        for name in ADAPTER_FILES:
            if not os.path.isfile(os.path.join(folder, name)):
                raise AdapterFetchError(f"fetching {ref.uri!r} gave no {name}; the blob store entry of adapter "
                                        f"{ref.adapter_id!r} is incomplete")
        return folder

    @staticmethod
    def _verify_sha256(ref: AdapterRef, folder: str) -> None:
        if ref.sha256 is None:
            return
        got = sha256_file(os.path.join(folder, WEIGHTS_FILE))
        if got != ref.sha256:
            raise AdapterChecksumError(f"sha256 mismatch for adapter {ref.adapter_id!r}: expected {ref.sha256}, "
                                       f"fetched {WEIGHTS_FILE} has {got}; the blob is corrupt or the reference "
                                       "is stale, upload the adapter again")

    # ---- GPU memory (step thread) -------------------------------------------------------------------------------
    def activate(self, ref: AdapterRef, in_use: set[AdapterRef] | frozenset = frozenset()) -> int | None:
        """Make a CPU-ready adapter resident on the GPU and return its slot: already resident (its LRU place
        touched), or its copy started now, after evicting the least recently used unpinned adapters not in
        ``in_use`` that are needed to make room (``AdapterPool``). None when it is not CPU-ready, when no room can
        be made now, or when it can never fit (then it is marked failed). ``is_ready`` says when it may run."""
        with self._lock:
            pool = self.pool
            slot = pool.slot_of(ref)
            if slot is not None:
                pool.touch(ref)
                if ref in self._copied:  # the admission its own copy was made for: no hit
                    if pool.is_ready(ref):
                        self._copied.discard(ref)
                else:
                    self.counters.slot_hits += 1
                return slot
            weights = self._cpu.get(ref)
            if weights is None:
                return None
            before = len(pool)
            try:
                slot = pool.activate(ref, weights, in_use)
            except Exception as e:  # noqa: BLE001 - too large, or refused by the slots: fail this adapter, not the step
                del self._cpu[ref]
                self._failed[ref] = e
                self.counters.failures += 1
                logger.warning("adapter %s could not be put on the GPU: %s", ref.adapter_id, e)
                return None
            if slot is None:
                return None
            self.counters.evictions += before + 1 - len(pool)
            self._cpu.move_to_end(ref)
            self.counters.activations += 1
            self._copied.intersection_update(pool.resident().values())  # forget evicted ones
            if not pool.is_ready(ref):  # a copy in flight: the activate() that finds it done admits, no hit
                self._copied.add(ref)
            return slot

    # ---- operator controls ------------------------------------------------------------------------------------
    def pin(self, ref: AdapterRef) -> AdapterState:
        """Never evict ``ref`` from CPU or GPU memory; starts its load. Refused (ValueError) once the pinned
        adapters would leave less than one largest adapter's room in the GPU budget (``AdapterPool.can_pin``)."""
        with self._lock:
            weights = self._cpu.get(ref)
            nbytes = self.slots.footprint(weights) if weights is not None else None
            self.pool.pin(ref, nbytes)
            self._pinned.add(ref)
        return self.ensure_loading(ref)

    def unpin(self, ref: AdapterRef) -> None:
        with self._lock:
            self._pinned.discard(ref)
            self.pool.unpin(ref)

    def evict(self, ref: AdapterRef) -> bool:
        """Drop ``ref`` from every in-memory tier (GPU, CPU), forget a failure or an ongoing load, unpin it.
        The disk cache keeps it (until its LRU cap needs the room). The caller makes sure no running sequence uses
        it. True if anything went."""
        with self._lock:
            found = self._failed.pop(ref, None) is not None
            found |= self._loading.pop(ref, None) is not None
            found |= self._cpu.pop(ref, None) is not None
            self._pinned.discard(ref)
            self._copied.discard(ref)
            self.pool.unpin(ref)
            if self.pool.evict(ref):
                self.counters.evictions += 1
                found = True
            return found

    def close(self) -> None:
        """Stop the loader threads (without waiting on a hung fetch); removes the cache folder it made."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._own_cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
