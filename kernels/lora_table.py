"""The LoRA weight operand of the multi-LoRA ops: each adapter's factors at its own rank, found by address.

Shape legend: L step slots (the distinct adapters of one step, ``token_lora_idx`` values 0..L-1), S output slices
of a fused target (q/k/v, gate/up; 1 for experts), r the rank of one adapter's module, R the largest rank any
slot may hold, K in, N_s out features of slice s, E experts.

    entries [L, S, 3] int64     (address of A, address of B^T, rank r) of step slot l, slice s; r = 0: no weights
    dense  slice s:   A [r, K]       B^T [r, N_s]        (row-major, contiguous; B itself is [N_s, r])
    expert (S = 1):   A [E, r, K]    B^T [E, r, N]

Both factors are stored rank-major, so a tile's rows are contiguous runs along K or N, and every factor starts on
a 16-byte boundary (``ALIGN_BYTES``): the kernels then read them with vector loads (they assume that alignment;
the engine's blobs and the tables built here keep it). An adapter costs exactly its own factors: nothing is padded
to R, and slices an adapter does not target hold no memory (rank 0). The kernels mask the rank dimension with each slot's r (their tile is ``max_rank`` wide), so
one launch serves a batch mixing ranks. ``entries`` is a device tensor the caller writes before the launch (the
engine rewrites one shared table per step in place, so a CUDA graph reads new adapters on every replay); the
torch references read the same factors through ``lookup`` instead of addresses.

The stacked layout of the earlier API -- ``lora_a [S, L, R, K]`` / ``lora_b [L, N, R]`` (dense) or
``[L, E, R, K]`` / ``[L, E, N, R]`` (experts), every slot zero-padded to R -- is one such table with rank R in
every slot: ``from_stacked`` builds it (device operations only -- B transposed into a new tensor -- so it is
allowed inside a CUDA-graph capture).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

Factors = tuple[torch.Tensor, torch.Tensor]  # (A, B) of one slot and slice, at the slot's rank (B [.., N, r])
ALIGN_BYTES = 16  # every factor of a table starts on such a boundary (vector loads)


@dataclass(frozen=True, eq=False)
class LoRATable:
    """The weights of one LoRA target (one wrapped module) for one step's slots.

    ``lookup(l, s)`` returns slot l's (A [.., r, K], B [.., N, r]) for slice s, or None (no weights); it must
    agree with ``entries`` (whose B address is that of B's rank-major storage B^T).
    """

    entries: torch.Tensor                    # [L, S, 3] int64 on the weights' device
    in_features: int                         # K
    out_features: tuple[int, ...]            # N_s per slice (experts: (N,))
    max_rank: int                            # R: every slot's r <= R
    dtype: torch.dtype                       # of A and B
    lookup: Callable[[int, int], Factors | None] = field(repr=False)
    num_experts: int = 0                     # E; 0 = a dense target

    @property
    def num_slots(self) -> int:
        return self.entries.shape[0]

    @property
    def num_slices(self) -> int:
        return self.entries.shape[1]

    @property
    def device(self) -> torch.device:
        return self.entries.device

    def check(self) -> None:
        """Shape checks shared by the launchers and the references."""
        if self.entries.dim() != 3 or self.entries.shape[2] != 3 or self.entries.dtype != torch.int64:
            raise ValueError(f"LoRATable.entries must be [L, S, 3] int64, got {tuple(self.entries.shape)} "
                             f"{self.entries.dtype}")
        if len(self.out_features) != self.num_slices:
            raise ValueError(f"LoRATable has {self.num_slices} slices but {len(self.out_features)} output widths")
        if self.entries.stride(2) != 1:
            raise ValueError("LoRATable.entries must have its last dimension contiguous")

    @classmethod
    def from_factors(cls, slots: Sequence[Sequence[Factors | None]], *, in_features: int,
                     out_features: Sequence[int], max_rank: int | None = None, num_experts: int = 0,
                     device: torch.device | str | None = None) -> "LoRATable":
        """A table over ``slots[l][s]`` = (A [.., r, K], B [.., N, r]) or None, e.g. adapters of different ranks
        (tests, benchmarks). A must be contiguous; B is copied rank-major. The table keeps the tensors alive."""
        num_slices = len(out_features)
        found = [f for row in slots for f in row if f is not None]
        if device is None:
            device = found[0][0].device if found else "cpu"
        dtype = found[0][0].dtype if found else torch.float32
        rows, frozen = [], []
        for l, row in enumerate(slots):
            if len(row) != num_slices:
                raise ValueError(f"slot {l} has {len(row)} slices, expected {num_slices}")
            line, kept = [], []
            for s, f in enumerate(row):
                if f is None:
                    line.append((0, 0, 0))
                    kept.append(None)
                    continue
                a, b = f
                _check_factors(a, b, in_features, out_features[s], num_experts, dtype)
                bt = b.transpose(-1, -2).contiguous()
                for t in (a, bt):
                    if t.data_ptr() % ALIGN_BYTES:
                        raise ValueError(f"LoRA factors must start on a {ALIGN_BYTES}-byte boundary")
                line.append((a.data_ptr(), bt.data_ptr(), a.shape[-2]))
                kept.append((a, bt.transpose(-1, -2)))
            rows.append(line)
            frozen.append(kept)
        ranks = [f[0].shape[-2] for f in found]
        entries = torch.tensor(rows, dtype=torch.int64).reshape(len(slots), num_slices, 3).to(device)
        return cls(entries=entries, in_features=in_features, out_features=tuple(out_features),
                   max_rank=max_rank or max(ranks, default=1), dtype=dtype, num_experts=num_experts,
                   lookup=lambda l, s: frozen[l][s])

    @classmethod
    def from_stacked(cls, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, *,
                     output_slices: Sequence[int] | None = None, experts: bool = False) -> "LoRATable":
        """The table of a zero-padded stacked layout: every slot at rank R (module docstring). Either factor may
        be None (a shrink needs only A, an expand only B); its addresses are then 0. B is transposed into a new
        rank-major tensor (per slice for a dense target)."""
        ref = lora_a if lora_a is not None else lora_b
        if ref is None:
            raise ValueError("from_stacked needs lora_a or lora_b")
        for name, t in (("lora_a", lora_a), ("lora_b", lora_b)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        dev = ref.device
        if experts:
            if lora_a is not None and lora_a.dim() != 4 or lora_b is not None and lora_b.dim() != 4:
                raise ValueError("expert LoRA factors must be lora_a [L, E, R, K] and lora_b [L, E, N, R]")
            num_slots, num_experts = ref.shape[0], ref.shape[1]
            rank = lora_a.shape[2] if lora_a is not None else lora_b.shape[3]
            k = lora_a.shape[3] if lora_a is not None else 0
            widths = (lora_b.shape[2],) if lora_b is not None else (0,)
            bts = [lora_b.transpose(-1, -2).contiguous()] if lora_b is not None else None  # [L, E, R, N]
            a_addr = _addresses(lora_a, num_slots, [0], dev)
            b_addr = _addresses(bts[0] if bts else None, num_slots, [0], dev)

            def lookup(l: int, s: int) -> Factors:
                return (lora_a[l] if lora_a is not None else None,
                        bts[0][l].transpose(-1, -2) if bts else None)
        else:
            num_experts = 0
            if lora_a is not None and lora_a.dim() != 4 or lora_b is not None and lora_b.dim() != 3:
                raise ValueError("dense LoRA factors must be lora_a [S, L, R, K] and lora_b [L, N, R]")
            num_slots = lora_a.shape[1] if lora_a is not None else lora_b.shape[0]
            rank = lora_a.shape[2] if lora_a is not None else lora_b.shape[2]
            k = lora_a.shape[3] if lora_a is not None else 0
            if output_slices is None:
                output_slices = (lora_b.shape[1],) if lora_a is None else (0,) * lora_a.shape[0]
            widths = tuple(int(w) for w in output_slices)
            if lora_a is not None and len(widths) != lora_a.shape[0]:
                raise ValueError(f"{len(widths)} output slices but lora_a has {lora_a.shape[0]}")
            offsets = [sum(widths[:s]) for s in range(len(widths))]
            bts = [lora_b[:, o:o + w].transpose(-1, -2).contiguous() for o, w in zip(offsets, widths)] \
                if lora_b is not None else None  # per slice [L, R, N_s]
            a_addr = _addresses(lora_a, num_slots, [s * lora_a[0].numel() if lora_a is not None else 0
                                                    for s in range(len(widths))], dev, slot_dim=1)
            b_addr = torch.stack([_addresses(bt, num_slots, [0], dev)[:, 0] for bt in bts], dim=1) if bts else \
                _addresses(None, num_slots, [0] * len(widths), dev)

            def lookup(l: int, s: int) -> Factors:
                return (lora_a[s, l] if lora_a is not None else None,
                        bts[s][l].transpose(-1, -2) if bts else None)
        num_slices = len(widths)
        ranks = torch.full((num_slots, num_slices), rank, dtype=torch.int64, device=dev)
        entries = torch.stack((a_addr, b_addr, ranks), dim=-1)
        return cls(entries=entries, in_features=k, out_features=widths, max_rank=rank, dtype=ref.dtype,
                   num_experts=num_experts, lookup=lookup)


def as_table(weights, *, output_slices: Sequence[int] | None = None, experts: bool = False,
             which: str = "a") -> LoRATable:
    """A LoRATable as is; a stacked tensor (``which``: "a" for lora_a, "b" for lora_b) or an (A, B) pair of
    stacked tensors converted by ``from_stacked``."""
    if isinstance(weights, LoRATable):
        return weights
    if isinstance(weights, (tuple, list)):
        return LoRATable.from_stacked(weights[0], weights[1], output_slices=output_slices, experts=experts)
    if which == "a":
        return LoRATable.from_stacked(weights, None, output_slices=output_slices, experts=experts)
    return LoRATable.from_stacked(None, weights, output_slices=output_slices, experts=experts)


def _addresses(t: torch.Tensor | None, num_slots: int, slice_offsets, device: torch.device, *,
               slot_dim: int = 0) -> torch.Tensor:
    """[L, S] int64 byte addresses of slot l, slice s in stacked ``t``: ``t``'s start + l x its stride along
    ``slot_dim`` + ``slice_offsets[s]`` elements (zeros when t is None). Device arithmetic on Python scalars only
    (no host->device copy), so a CUDA-graph capture may run it."""
    num_slices = len(slice_offsets)
    if t is None:
        return torch.zeros(num_slots, num_slices, dtype=torch.int64, device=device)
    elem = t.element_size()
    if (t.stride(slot_dim) * elem) % ALIGN_BYTES or t.data_ptr() % ALIGN_BYTES \
            or any((o * elem) % ALIGN_BYTES for o in slice_offsets):
        raise ValueError(f"stacked LoRA factors must put every slot on a {ALIGN_BYTES}-byte boundary; got a slot "
                         f"stride of {t.stride(slot_dim) * elem} bytes")
    slot = torch.arange(num_slots, dtype=torch.int64, device=t.device) * (t.stride(slot_dim) * elem) + t.data_ptr()
    offs = torch.zeros(num_slices, dtype=torch.int64, device=t.device)
    for s in range(1, num_slices):
        offs[s] = slice_offsets[s] * elem
    return slot[:, None] + offs[None, :]


def _check_factors(a: torch.Tensor, b: torch.Tensor, k: int, n: int, num_experts: int, dtype: torch.dtype) -> None:
    want_dims = 3 if num_experts else 2
    if a.dim() != want_dims or b.dim() != want_dims:
        raise ValueError(f"LoRA factors must be A [{'E, ' if num_experts else ''}r, K] and B "
                         f"[{'E, ' if num_experts else ''}N, r], got {tuple(a.shape)} and {tuple(b.shape)}")
    r = a.shape[-2]
    if a.shape[-1] != k or b.shape[-2:] != (n, r) or (num_experts and (a.shape[0], b.shape[0]) !=
                                                       (num_experts, num_experts)):
        raise ValueError(f"LoRA factors A {tuple(a.shape)} / B {tuple(b.shape)} do not fit K={k}, N={n}"
                         f"{f', E={num_experts}' if num_experts else ''}")
    if not (a.is_contiguous() and b.is_contiguous()) or a.dtype != dtype or b.dtype != dtype:
        raise ValueError("LoRA factors must be contiguous and of one dtype")


__all__ = ["LoRATable", "Factors", "as_table"]
