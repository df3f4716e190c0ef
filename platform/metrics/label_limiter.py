"""LabelLimiter: bounded label values for Prometheus. The heaviest keys by traffic keep their own name; the rest
share one overflow value, so the number of series stays bounded however many adapters exist.

    sketch (space-saving, ``sketch_size`` counters)      named (<= max_values - 1 keys)     label(key)
    ┌ key: (count, error) ┐ every key lands here;        ┌ key ┐  free room: admit at once  -> key
    │ ...                 │ when full, the smallest      │ ... │  else a key whose guaranteed -> key (the weakest
    └─────────────────────┘ entry is replaced            └─────┘  count is promote_ratio x the     named key is
                            (count = min + w, error = min)        weakest named count            evicted)
                                                                  otherwise                       -> other

Space-saving (Metwally et al., 2005) over-estimates a count by at most its ``error``; ``count - error`` is a
guaranteed lower bound, so a key is promoted only on traffic it surely had. The hysteresis (``promote_ratio``)
stops two keys of similar traffic from swapping the name back and forth. An evicted key's series should be
dropped by the caller (``on_evict``); that keeps the number of distinct values, ``other`` included, at most
``max_values`` at every moment.
"""
from __future__ import annotations

import heapq
import threading
from typing import Callable, Hashable

OTHER = "_other"  # adapter and tenant names start with [a-z0-9], so this never collides with a real name


class LabelLimiter:
    """Maps keys to at most ``max_values`` distinct labels (``other`` included). Thread-safe.

    ``label(key)`` returns ``label_of(key)`` (default ``str(key)``) for a named key, else ``other``.
    ``on_evict(key)`` is called (under the lock) when a named key loses its name to a heavier one.
    """

    def __init__(self, max_values: int, *, other: str = OTHER, sketch_size: int | None = None,
                 promote_ratio: float = 2.0, on_evict: Callable[[Hashable], None] | None = None) -> None:
        if not isinstance(max_values, int) or max_values < 2:
            raise ValueError(f"max_values must be an integer >= 2 (at least one named value and {other!r}), "
                             f"got {max_values!r}")
        if promote_ratio < 1.0:
            raise ValueError(f"promote_ratio must be >= 1.0, got {promote_ratio}")
        self.max_values = max_values
        self.max_named = max_values - 1
        self.other = other
        self.sketch_size = sketch_size or max(64, 8 * max_values)
        if self.sketch_size < self.max_named:
            raise ValueError(f"sketch_size ({self.sketch_size}) must be >= max_values - 1 ({self.max_named})")
        self.promote_ratio = promote_ratio
        self.on_evict = on_evict
        self._counts: dict[Hashable, list[int]] = {}   # key -> [count, error]
        self._heap: list[tuple[int, int, Hashable]] = []  # (count, tiebreak, key); stale entries skipped lazily
        self._tiebreak = 0
        self._named: set[Hashable] = set()
        self._lock = threading.Lock()
        self.promotions = 0
        self.evictions = 0

    # ---- the sketch -------------------------------------------------------------------------------------------
    def _push(self, key: Hashable, count: int) -> None:
        self._tiebreak += 1
        heapq.heappush(self._heap, (count, self._tiebreak, key))
        if len(self._heap) > 4 * self.sketch_size:  # too many stale entries: rebuild
            self._heap = [(c, i, k) for i, (k, (c, _)) in enumerate(self._counts.items())]
            heapq.heapify(self._heap)

    def _pop_min(self) -> tuple[Hashable, int]:
        while True:
            count, _, key = heapq.heappop(self._heap)
            entry = self._counts.get(key)
            if entry is not None and entry[0] == count:
                return key, count
            # stale (the key grew or was replaced): a live entry with its current count is elsewhere in the heap

    def _observe(self, key: Hashable, weight: int) -> None:
        entry = self._counts.get(key)
        if entry is not None:
            entry[0] += weight
        elif len(self._counts) < self.sketch_size:
            self._counts[key] = entry = [weight, 0]
        else:
            victim, floor = self._pop_min()
            del self._counts[victim]
            self._counts[key] = entry = [floor + weight, floor]
        self._push(key, entry[0])

    def _guaranteed(self, key: Hashable) -> int:
        entry = self._counts.get(key)
        return entry[0] - entry[1] if entry else 0

    def _estimate(self, key: Hashable) -> int:
        entry = self._counts.get(key)
        return entry[0] if entry else 0

    # ---- public -----------------------------------------------------------------------------------------------
    def label(self, key: Hashable, weight: int = 1, label_of: Callable[[Hashable], str] = str) -> str:
        """Count ``weight`` units of traffic for ``key`` and return its label value."""
        with self._lock:
            self._observe(key, weight)
            if key in self._named:
                return label_of(key)
            if len(self._named) < self.max_named:
                self._named.add(key)
                return label_of(key)
            weakest = min(self._named, key=self._estimate)
            if self._guaranteed(key) > self.promote_ratio * self._estimate(weakest):
                self._named.discard(weakest)
                self._named.add(key)
                self.promotions += 1
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(weakest)
                return label_of(key)
            return self.other

    def peek(self, key: Hashable, label_of: Callable[[Hashable], str] = str) -> str:
        """The label ``key`` has now, without counting traffic."""
        with self._lock:
            return label_of(key) if key in self._named else self.other

    @property
    def named(self) -> frozenset:
        with self._lock:
            return frozenset(self._named)

    def top(self, n: int | None = None) -> list[tuple[Hashable, int]]:
        """The sketch's heaviest keys with their estimated counts, heaviest first."""
        with self._lock:
            items = sorted(((k, c[0]) for k, c in self._counts.items()), key=lambda kc: -kc[1])
        return items if n is None else items[:n]
