"""Stand-ins for the device side of the adapter tiers: slots whose adapters all take SIZE bytes, and a copier whose
copies complete when the test says (the CUDA side stream's event, on CPU)."""
from __future__ import annotations

import torch

from loraplex.engine.lora.device_copy import CopyDone

SIZE = 100  # device bytes of every adapter in FakeSlots


class FakeSlots:
    """Records what the manager puts in which slot; every adapter takes SIZE bytes, copies complete at once."""

    max_rank = 16

    def __init__(self, n: int) -> None:
        self.held: dict[int, str | None] = {i: None for i in range(n)}
        self.loads = 0

    def footprint(self, weights) -> int:
        return SIZE

    def max_footprint(self) -> int:
        return SIZE

    def load(self, slot, weights):
        self.held[slot] = weights.adapter_id
        self.loads += 1
        return CopyDone()

    def clear(self, slot):
        self.held[slot] = None


class ManualCopier:
    """Copies at once (the data is there) but reports them done only when the test says."""

    def __init__(self) -> None:
        self.pending: list["ManualCopier.Handle"] = []

    class Handle:
        def __init__(self) -> None:
            self.finished = False

        def done(self) -> bool:
            return self.finished

        @property
        def seconds(self):
            return 0.001 if self.finished else None

    def copy(self, source: torch.Tensor):
        h = ManualCopier.Handle()
        self.pending.append(h)
        return source.clone(), h

    def finish_all(self) -> None:
        for h in self.pending:
            h.finished = True
