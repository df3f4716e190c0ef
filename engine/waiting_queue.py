"""The scheduler's waiting sequences: one FIFO per key (per tenant under the fair policy, a single one under
FCFS), a group's sequences adjacent in its queue (torch-free).

    key "acme":   [ r7 r9 r9 r12 ]      new requests join the back, preempted (recompute) groups the front
    key "globex": [ r8 ]                iteration: queue by queue, in the order the keys first appeared

``num_requests(key)``: how many distinct requests have sequences in ``key``'s queue, kept up to date in O(1) per
change, so the fair policy can tell a tenant whose every unfinished request waits (it holds no slot) from one
with something running.

``on_head(key)``, when set, is called whenever a queue's front may have changed to a request that ranks earlier
(a first request, a preempted group put in front, the front removed): the fair policy re-ranks the tenant then.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator

from loraplex.engine.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._queues: dict[Hashable, deque[Sequence]] = {}
        self._requests: dict[Hashable, dict[str, int]] = {}  # key -> {request id: its waiting sequences}
        self._len = 0
        self.on_head: Callable[[Hashable], None] | None = None

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for q in list(self._queues.values()):
            yield from list(q)

    @property
    def num_keys(self) -> int:
        return len(self._queues)

    def keys(self) -> list[Hashable]:
        """Keys with at least one waiting sequence."""
        return list(self._queues)

    def lengths(self) -> dict[Hashable, int]:
        """Waiting sequences per key (a copy; safe to call from another thread)."""
        return {k: len(q) for k, q in list(self._queues.copy().items())}

    def snapshot(self) -> list[Sequence]:
        """The waiting sequences, copied queue by queue (each copy one C-level step): safe from another thread."""
        return [seq for q in list(self._queues.copy().values()) for seq in list(q)]

    def num_requests(self, key: Hashable) -> int:
        """Distinct requests with sequences waiting in ``key``'s queue."""
        counts = self._requests.get(key)
        return len(counts) if counts else 0

    def head(self, key: Hashable) -> Sequence | None:
        q = self._queues.get(key)
        return q[0] if q else None

    def queue(self, key: Hashable) -> deque[Sequence]:
        """The queue of ``key`` (read it, do not change it; empty if none)."""
        return self._queues.get(key) or deque()

    def append(self, key: Hashable, seq: Sequence) -> None:
        q = self._queues.get(key)
        if q is None:
            self._queues[key] = q = deque()
        q.append(seq)
        self._count(key, seq, 1)
        self._len += 1
        if len(q) == 1:
            self._notify(key)

    def appendleft(self, key: Hashable, seq: Sequence) -> None:
        self.extendleft(key, [seq])

    def extendleft(self, key: Hashable, seqs: list[Sequence]) -> None:
        """Put ``seqs`` back at the front of ``key``'s queue, in their order."""
        if not seqs:
            return
        q = self._queues.get(key)
        if q is None:
            self._queues[key] = q = deque()
        q.extendleft(reversed(seqs))
        for seq in seqs:
            self._count(key, seq, 1)
        self._len += len(seqs)
        self._notify(key)

    def popleft(self, key: Hashable) -> Sequence:
        q = self._queues[key]
        seq = q.popleft()
        self._count(key, seq, -1)
        self._len -= 1
        if not q:
            del self._queues[key]
        return seq

    def remove(self, key: Hashable, seq: Sequence) -> bool:
        """Take ``seq`` out wherever it is in its queue; False if it is not there."""
        q = self._queues.get(key)
        if not q:
            return False
        was_head = q[0] is seq
        try:
            q.remove(seq)
        except ValueError:
            return False
        self._count(key, seq, -1)
        self._len -= 1
        if not q:
            del self._queues[key]
        elif was_head:
            self._notify(key)
        return True

    def _count(self, key: Hashable, seq: Sequence, delta: int) -> None:
        counts = self._requests.get(key)
        if counts is None:
            self._requests[key] = counts = {}
        n = counts.get(seq.request_id, 0) + delta
        if n:
            counts[seq.request_id] = n
        else:
            del counts[seq.request_id]
            if not counts:
                del self._requests[key]

    def _notify(self, key: Hashable) -> None:
        if self.on_head is not None:
            self.on_head(key)
