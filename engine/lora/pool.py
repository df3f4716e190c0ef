"""AdapterPool: which adapters are resident on the GPU, under one byte budget fixed at start.

    budget (bytes, decided at start beside the KV pool; KV blocks are never given up for adapters)
    ┌───────────────┬─────────┬──────┬────────────────────┬──────────────┐
    │ A (r32, in use)│ B (r8)  │ C r16│ D (r32, copying)   │ free         │   each adapter: exactly its bytes
    └───────────────┴─────────┴──────┴────────────────────┴──────────────┘
    activate(X, in_use): resident -> its slot (LRU touched). Else, if X fits in the free bytes after evicting,
    least recently used first, adapters that are unpinned, not in ``in_use`` and not still copying: evict
    those, start X's copy, return its slot (usable once ``is_ready``). If even evicting all of them would not
    make room, nothing is evicted and None is returned: X's request waits (the scheduler's slot head) until
    running requests finish and release their adapters.

Rules. An adapter in use (a running or swapped-out request's) is never evicted. Pins keep an adapter resident and
are refused once the pinned adapters (counted at ``max_footprint`` until their size is known) would leave less
than one largest adapter's room, so the unpinned rest can always be served one at a time. An adapter larger than
the whole budget cannot be made resident: ``AdapterTooLargeError`` (its requests fail with that reason).
``max_loras`` (optional) caps the number of resident adapters on top of the bytes.

The pool decides; ``LoRASlots`` (slots.py) holds the blobs and does the copies. Step thread only.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from loraplex.engine.lora.device_copy import CopyHandle
from loraplex.engine.lora.latency import LatencyHistogram

logger = logging.getLogger(__name__)


class AdapterTooLargeError(ValueError):
    """The adapter needs more device memory than the whole adapter budget."""


@dataclass
class _Resident:
    slot: int
    nbytes: int
    handle: CopyHandle
    source: Any = None  # CPU weights, kept alive until the copy completes


class AdapterPool:
    """GPU residency of adapters (module docstring). ``slots``: a ``LoRASlots`` (``load``, ``clear``,
    ``footprint``, ``max_footprint``)."""

    def __init__(self, slots: Any, *, budget_bytes: int, max_loras: int | None = None) -> None:
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras must be None or >= 1, got {max_loras}")
        self.slots = slots
        self.budget_bytes = int(budget_bytes)
        self.max_loras = max_loras
        self.max_footprint = int(slots.max_footprint())
        if self.budget_bytes < self.max_footprint:
            raise ValueError(f"the adapter memory budget ({self.budget_bytes / 2**20:.1f} MiB) holds no adapter of "
                             f"rank {slots.max_rank} on every target ({self.max_footprint / 2**20:.1f} MiB); raise "
                             "adapter_memory_bytes / adapter_memory_fraction or lower max_lora_rank")
        self._resident: OrderedDict[Hashable, _Resident] = OrderedDict()  # LRU first
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.used_bytes = 0
        self.pinned: set[Hashable] = set()
        self._pin_bytes: dict[Hashable, int] = {}
        self.copy_seconds: list[float] = []  # CPU -> GPU copy times of completed activations (bounded)
        self.copy_latency = LatencyHistogram()  # the same, every copy since start

    # ---- queries ----------------------------------------------------------------------------------------------
    def slot_of(self, ref: Hashable) -> int | None:
        r = self._resident.get(ref)
        return r.slot if r is not None else None

    def is_ready(self, ref: Hashable) -> bool:
        """Resident and its copy complete (``event.query()`` on CUDA: never blocks)."""
        r = self._resident.get(ref)
        if r is None:
            return False
        if r.source is not None and r.handle.done():
            r.source = None
            if r.handle.seconds is not None:
                self.copy_seconds.append(r.handle.seconds)
                del self.copy_seconds[:-1024]
                self.copy_latency.observe(r.handle.seconds)
        return r.source is None

    def copying(self) -> list[Hashable]:
        """Resident adapters whose copy is still in flight."""
        return [ref for ref in list(self._resident) if not self.is_ready(ref)]

    def resident(self) -> dict[int, Hashable]:
        return {r.slot: ref for ref, r in self._resident.items()}

    def nbytes_of(self, ref: Hashable) -> int | None:
        r = self._resident.get(ref)
        return r.nbytes if r is not None else None

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def __len__(self) -> int:
        return len(self._resident)

    # ---- residency --------------------------------------------------------------------------------------------
    def touch(self, ref: Hashable) -> None:
        self._resident.move_to_end(ref)

    def activate(self, ref: Hashable, weights: Any, in_use: set | frozenset = frozenset()) -> int | None:
        """Make ``ref`` (CPU ``weights``) resident: its slot, or None when no room can be made now (module
        docstring). Raises AdapterTooLargeError, or the slots' ValueError for weights they refuse."""
        r = self._resident.get(ref)
        if r is not None:
            self.touch(ref)
            return r.slot
        need = int(self.slots.footprint(weights))
        if need > self.budget_bytes:
            raise AdapterTooLargeError(
                f"adapter needs {need / 2**20:.1f} MiB on the GPU, more than the whole adapter budget of "
                f"{self.budget_bytes / 2**20:.1f} MiB; raise adapter_memory_bytes or use a lower rank")
        victims = self._victims(need, in_use)
        if victims is None:
            return None
        for victim in victims:
            logger.info("adapter memory: evicting %s (%.1f MiB) for %s", getattr(victim, "adapter_id", victim),
                        self._resident[victim].nbytes / 2**20, getattr(ref, "adapter_id", ref))
            self._drop(victim)
        slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        try:
            handle = self.slots.load(slot, weights)
        except torch.OutOfMemoryError:  # within the budget, but the allocator found no block: wait, as for no room
            self._free_slots.append(slot)
            logger.warning("adapter memory: no device block of %.1f MiB for %s although the budget has room; its "
                           "requests wait", need / 2**20, getattr(ref, "adapter_id", ref))
            return None
        except Exception:
            self._free_slots.append(slot)
            raise
        self._resident[ref] = _Resident(slot, need, handle, source=weights)
        self.used_bytes += need
        if ref in self.pinned:
            self._pin_bytes[ref] = need
        return slot

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def _victims(self, need: int, in_use) -> list[Hashable] | None:
        """The fewest LRU evictable adapters whose bytes (with the free ones) make room for ``need`` bytes and a
        slot under ``max_loras``; None if all of them together would not."""
        free = self.free_bytes
        count_ok = self.max_loras is None or len(self._resident) < self.max_loras
        if free >= need and count_ok:
            return []
        victims = []
        for ref, r in self._resident.items():
            if ref in in_use or ref in self.pinned or not self.is_ready(ref):
                continue
            victims.append(ref)
            free += r.nbytes
            count_ok = self.max_loras is None or len(self._resident) - len(victims) < self.max_loras
            if free >= need and count_ok:
                return victims
        return None

    def _drop(self, ref: Hashable) -> None:
        r = self._resident.pop(ref)
        self.slots.clear(r.slot)
        self._free_slots.append(r.slot)
        self.used_bytes -= r.nbytes

    def evict(self, ref: Hashable) -> bool:
        """Drop ``ref`` from the GPU (the caller makes sure no running request uses it). True if it was there."""
        if ref not in self._resident:
            return False
        self._drop(ref)
        return True

    # ---- pins -------------------------------------------------------------------------------------------------
    def can_pin(self, ref: Hashable, nbytes: int | None = None) -> str | None:
        """None if ``ref`` may be pinned, else why not. ``nbytes``: its footprint if known (else max_footprint)."""
        if ref in self.pinned:
            return None
        if self.max_loras is not None and len(self.pinned) >= self.max_loras - 1:
            return (f"{len(self.pinned)} adapters are pinned and max_loras={self.max_loras} must keep one resident "
                    "adapter unpinned; unpin one or raise max_loras")
        own = nbytes if nbytes is not None else self.nbytes_of(ref) or self.max_footprint
        pinned = sum(self._pin_bytes.get(p, self.max_footprint) for p in self.pinned)
        if pinned + own + self.max_footprint > self.budget_bytes:
            return (f"pinned adapters would take {(pinned + own) / 2**20:.0f} MiB of the {self.budget_bytes / 2**20:.0f}"
                    f" MiB adapter budget, leaving less than one largest adapter ({self.max_footprint / 2**20:.0f} "
                    "MiB) for the others; unpin one or raise the adapter memory budget")
        return None

    def pin(self, ref: Hashable, nbytes: int | None = None) -> None:
        reason = self.can_pin(ref, nbytes)
        if reason is not None:
            raise ValueError(f"cannot pin {getattr(ref, 'adapter_id', ref)!r}: {reason}")
        self.pinned.add(ref)
        known = nbytes if nbytes is not None else self.nbytes_of(ref)
        if known is not None:
            self._pin_bytes[ref] = known

    def unpin(self, ref: Hashable) -> None:
        self.pinned.discard(ref)
        self._pin_bytes.pop(ref, None)


__all__ = ["AdapterPool", "AdapterTooLargeError"]
