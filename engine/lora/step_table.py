"""The LoRA table of one step: where each of the step's adapters keeps its factors, for every wrapped module.

    resident slot c (any number, as memory allows)    step slot l (0..k-1: the step's distinct adapters)
    host rows[c]: [NE, 3] (A address, B address, r)  ──gather──▶ host [k, NE, 3] ──one copy──▶ device [L_max, NE, 3]
                                                                                            ▲ every LoRA kernel
    token_lora_idx[t] = l (step slot), -1 = base                                           reads its columns

NE counts the (module, output slice) entries of the model (q, k, v of a qkv projection are three). The device
table is written in place before the step's kernels run (stream order: a step in flight still reads the rows it
was launched with), from a pinned host buffer that is reused once the previous copy has completed; the copy is
skipped when the step's adapters and their placement did not change (steady decoding). ``view(...)`` gives one
module's ``LoRATable`` over its columns, for the step's L (cached per L, so CUDA graphs bucketed by batch size
each capture their own L).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from loraplex.kernels.lora_table import Factors, LoRATable


class StepTable:
    """[max_step_slots, num_entries, 3] int64 on the device, rewritten per step (module docstring)."""

    def __init__(self, max_step_slots: int, num_entries: int, device: torch.device) -> None:
        self.max_step_slots, self.num_entries = max_step_slots, num_entries
        self.device = device
        pin = device.type == "cuda"
        self.entries = torch.zeros(max_step_slots, max(1, num_entries), 3, dtype=torch.int64, device=device)
        self._host = torch.zeros(self.entries.shape, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._copied: torch.cuda.Event | None = None
        self._key: tuple | None = None
        self.slots: list[int] = []  # resident slot of each step slot (host; the references' lookup reads it)
        self.num_writes = 0         # device copies made (steps whose adapters changed)

    def write(self, slots: list[int], rows: Callable[[int], np.ndarray], generation: int) -> None:
        """Make step slot l hold resident slot ``slots[l]`` (``rows(c)``: its [NE, 3] entries). ``generation``
        changes whenever some resident slot's rows change; an unchanged (slots, generation) copies nothing."""
        key = (tuple(slots), generation)
        if key == self._key:
            return
        k = len(slots)
        if k > self.max_step_slots:
            raise ValueError(f"a step uses {k} adapters but the LoRA step table holds {self.max_step_slots}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the pinned rows (long done in practice)
        for i, c in enumerate(slots):
            self._host_np[i] = rows(c)
        if k:
            nb = self.device.type == "cuda"
            self.entries[:k].copy_(self._host[:k], non_blocking=nb)
            if nb:
                if self._copied is None:
                    self._copied = torch.cuda.Event()
                self._copied.record()
        self.slots = list(slots)
        self._key = key
        self.num_writes += 1

    def invalidate(self) -> None:
        """Forget the last write (the next ``write`` copies again)."""
        self._key = None

    def view(self, offset: int, *, in_features: int, out_features: tuple[int, ...], max_rank: int,
             dtype: torch.dtype, lookup: Callable[[int, int], Factors | None],
             num_experts: int = 0) -> "TargetTable":
        """The columns ``offset .. offset + len(out_features)`` as one module's table; ``lookup(c, entry)``
        gives resident slot c's factors of entry ``offset + s`` (or None)."""
        return TargetTable(self, offset, in_features=in_features, out_features=out_features, max_rank=max_rank,
                           dtype=dtype, num_experts=num_experts, lookup=lookup)


class TargetTable:
    """One module's columns of a ``StepTable``: ``at(L)`` is its ``LoRATable`` for a step of L step slots."""

    def __init__(self, table: StepTable, offset: int, *, in_features: int, out_features: tuple[int, ...],
                 max_rank: int, dtype: torch.dtype, num_experts: int,
                 lookup: Callable[[int, int], Factors | None]) -> None:
        self.table, self.offset = table, offset
        self.in_features, self.out_features = in_features, tuple(out_features)
        self.max_rank, self.dtype, self.num_experts = max_rank, dtype, num_experts
        self._lookup = lookup
        self._by_len: dict[int, LoRATable] = {}

    def _factors(self, l: int, s: int) -> Factors | None:
        slots = self.table.slots
        return self._lookup(slots[l], self.offset + s) if l < len(slots) else None

    def at(self, num_slots: int) -> LoRATable:
        t = self._by_len.get(num_slots)
        if t is None:
            entries = self.table.entries[:num_slots, self.offset:self.offset + len(self.out_features)]
            t = LoRATable(entries=entries, in_features=self.in_features, out_features=self.out_features,
                          max_rank=self.max_rank, dtype=self.dtype, num_experts=self.num_experts,
                          lookup=self._factors)
            self._by_len[num_slots] = t
        return t


__all__ = ["StepTable", "TargetTable"]
