"""GPU-resident adapters and the transform that attaches multi-LoRA to a built model (gpt-fast style: the model
files know nothing of LoRA; ``LoRASlots(model, ...)`` swaps its Linear / FusedExperts modules for the wrappers of
``layers.py``, which keep the same parameter names).

    slots = LoRASlots(model, model_config, max_rank=32, max_step_slots=256, device="cuda", dtype=torch.bfloat16)
    handle = slots.load(7, load_adapter_weights(folder, model_config, max_rank=32, dtype=torch.bfloat16))
    handle.done()                            # False while the copy runs on the side stream (CUDA)
    slots.set_token_slots(token_slots)       # once per step: [T] resident slot per token, -1 = base; None = no LoRA
    slots.bind_static_token_slots(buf, L)    # CUDA-graph mode: a static map of step slots, LoRA kernels always run
    hidden = model(...)

A resident slot holds one adapter in one device blob of exactly its size (every factor at its module's own rank,
only the modules it targets: ``AdapterWeights.nbytes``), copied in one piece (``device_copy.py``). Slot numbers
are unbounded; which adapters stay resident, and the byte budget, are the pool's business (``pool.py``). Each step
the distinct slots its tokens use become step slots 0..k-1 of the step's LoRA table (``step_table.py``), whose
columns the wrappers read:

    self_attn.qkv_proj  (q_proj, k_proj, v_proj)   3 entries: A [r, H] / B [Q or KV, r] each
    self_attn.o_proj                              1 entry:   A [r, Q] / B [H, r]
    mlp.gate_up_proj    (gate_proj, up_proj)       2 entries: A [r, H] / B [I, r] each
    mlp.down_proj                                 1 entry:   A [r, I] / B [H, r]
    mlp.experts  gate_up_proj                     1 entry:   A [E, r, H] / B [E, 2I, r]
                 down_proj                        1 entry:   A [E, r, I] / B [E, H, r]

A module an adapter does not target has rank 0 in its rows: no delta, no memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.device_copy import CopyHandle, DeviceCopier
from loraplex.engine.lora.format import EXPERT_TARGETS, SUPPORTED_TARGETS
from loraplex.engine.lora.layers import LoRAFusedExperts, LoRALinear, LoRAState
from loraplex.engine.lora.step_table import StepTable
from loraplex.engine.lora.weights import ALIGN_BYTES, AdapterWeights, LoraTensors, rank_major, packed_numel
from loraplex.engine.models.layers.linear import Linear
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.kernels import ops


@dataclass
class _Entry:
    """One (module, output slice) column of the LoRA table."""

    key: tuple[int, str] | None     # (layer, PEFT target); None: a slice of a served module that is no target
    in_features: int
    out_features: int
    num_experts: int = 0


@dataclass
class _Resident:
    adapter_id: str
    blob: torch.Tensor                          # every factor, flat, on the device
    rows: np.ndarray                            # [NE, 3] int64: A address, B address, rank per entry
    factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # entry -> (A, B) views
    handle: CopyHandle | None = None


# eager steps' LoRA slot count: one power-of-two bucket for steps of up to 8 adapters. Each bucket is one more set of
# kernel variants for the eager warm-up to compile; each idle slot in a step launches programs that find no work
# (a 1600-token arrival beside 15 decodes with 8 adapters: TTFT p50 60 ms at L = 8, 71 ms at L = 16 on the H200)
EAGER_MIN_STEP_SLOTS = 8


class LoRASlots:
    """Owns the resident adapters' device blobs, the step's LoRA table and the per-step token -> slot map.

    ``targets`` limits which PEFT targets get table entries (default: every supported target the model has);
    loading an adapter that adapts another target raises ValueError. ``max_step_slots`` bounds the distinct
    adapters of one step (the engine passes ``max_num_seqs``)."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, *, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype, max_step_slots: int, targets: tuple[str, ...] | None = None,
                 copier: DeviceCopier | None = None) -> None:
        if max_rank < 1 or max_step_slots < 1:
            raise ValueError(f"max_rank and max_step_slots must be >= 1, got {max_rank} and {max_step_slots}")
        unknown = set(targets or ()) - set(SUPPORTED_TARGETS)
        if unknown:
            raise ValueError(f"unknown LoRA targets {sorted(unknown)}; supported: {', '.join(SUPPORTED_TARGETS)}")
        self.model_config = model_config
        self.max_rank, self.max_step_slots = max_rank, max_step_slots
        self.device, self.dtype = torch.device(device), dtype
        self.targets = tuple(targets or SUPPORTED_TARGETS)
        self.copier = copier or DeviceCopier(self.device)
        self.state = LoRAState(max_step_slots, self.device)
        self._entries: list[_Entry] = []
        self._entry_of: dict[tuple[int, str], int] = {}
        self._wrapper_of: list[nn.Module] = []      # entry -> its wrapper
        self._wrappers: list[nn.Module] = []
        self._originals: list[tuple[nn.Module, str, nn.Module]] = []
        self._resident: dict[int, _Resident] = {}
        self._generation = 0                        # bumped whenever a resident slot's rows change
        plans = []
        for i, layer in enumerate(model.model.layers):
            for path, mod in list(layer.named_modules()):
                if isinstance(mod, Linear):
                    plan = self._plan_linear(i, path, mod)
                elif isinstance(mod, FusedExperts):
                    plan = self._plan_experts(i, mod)
                else:
                    continue
                if plan is not None:
                    plans.append((layer, path, mod, plan))
        self.step_table = StepTable(max_step_slots, len(self._entries), self.device)
        for layer, path, mod, plan in plans:
            self._replace(layer, path, self._wrap(mod, plan))

    # ---- attaching ------------------------------------------------------------------------------------------
    def _new_entry(self, entry: _Entry) -> int:
        self._entries.append(entry)
        if entry.key is not None:
            self._entry_of[entry.key] = len(self._entries) - 1
        return len(self._entries) - 1

    def _plan_linear(self, layer_idx: int, path: str, mod: Linear):
        parent_path, _, name = path.rpartition(".")
        names = mod.output_names or [name]
        slice_targets = [f"{parent_path}.{n}" if parent_path else n for n in names]
        if not any(t in self.targets for t in slice_targets):
            return None  # routers, lm_head-like modules: not a LoRA target
        first = len(self._entries)
        for target, width in zip(slice_targets, mod.output_sizes):
            served = target in self.targets
            self._new_entry(_Entry((layer_idx, target) if served else None, mod.in_features, width))
        return ("linear", first, slice_targets)

    def _plan_experts(self, layer_idx: int, mod: FusedExperts):
        gate_up, down = EXPERT_TARGETS
        E, H, I = mod.num_experts, mod.hidden_size, mod.intermediate_size
        e13 = self._new_entry(_Entry((layer_idx, gate_up), H, 2 * I, E)) if gate_up in self.targets else None
        e2 = self._new_entry(_Entry((layer_idx, down), I, H, E)) if down in self.targets else None
        if e13 is None and e2 is None:
            return None
        return ("experts", e13, e2)

    def _view(self, first: int, num: int):
        e = self._entries[first]
        return self.step_table.view(first, in_features=e.in_features,
                                    out_features=tuple(x.out_features for x in self._entries[first:first + num]),
                                    max_rank=self.max_rank, dtype=self.dtype, lookup=self._factors,
                                    num_experts=e.num_experts)

    def _wrap(self, mod: nn.Module, plan) -> nn.Module:
        if plan[0] == "linear":
            _, first, slice_targets = plan
            wrapper = LoRALinear(mod, self.state, slice_targets, self._view(first, len(slice_targets)))
            self._wrapper_of.extend([wrapper] * len(slice_targets))
            return wrapper
        _, e13, e2 = plan
        wrapper = LoRAFusedExperts(mod, self.state, self._view(e13, 1) if e13 is not None else None,
                                   self._view(e2, 1) if e2 is not None else None)
        self._wrapper_of.extend([wrapper] * ((e13 is not None) + (e2 is not None)))
        return wrapper

    def _replace(self, layer: nn.Module, path: str, new: nn.Module) -> None:
        parent_path, _, name = path.rpartition(".")
        parent = layer.get_submodule(parent_path) if parent_path else layer
        self._originals.append((parent, name, getattr(parent, name)))
        setattr(parent, name, new)
        self._wrappers.append(new)

    def detach(self) -> None:
        """Puts the model's original modules back (the resident adapters are then unused)."""
        for parent, name, original in reversed(self._originals):
            setattr(parent, name, original)
        self._originals.clear()

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def prepare(self, weights: AdapterWeights) -> AdapterWeights:
        """The weights this device holds of an adapter (the whole adapter; a tensor-parallel rank keeps its part)."""
        return weights

    def footprint(self, weights: AdapterWeights) -> int:
        """Device bytes ``load`` takes for ``weights``: every factor at its own rank (16-byte aligned; no padding
        at all when the factors' sizes are multiples of 16 bytes, as at real model sizes)."""
        return self.elem_size * packed_numel(weights.layout(self.elem_size))

    def max_footprint(self, rank: int | None = None) -> int:
        """Device bytes of an adapter of ``rank`` (default max_rank) on every target this model serves: the
        largest adapter the deployment accepts."""
        r = rank or self.max_rank
        align = max(1, ALIGN_BYTES // self.elem_size)
        return self.elem_size * sum(_round_up(r * e.in_features * max(1, e.num_experts), align)
                                    + _round_up(r * e.out_features * max(1, e.num_experts), align)
                                    for e in self._entries if e.key is not None)

    @property
    def nbytes(self) -> int:
        """Device memory held by the resident adapters."""
        return sum(r.blob.numel() for r in self._resident.values()) * self.elem_size

    # ---- resident slots -------------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise ValueError(f"slot must be an integer >= 0, got {slot!r}")

    def adapter_in(self, slot: int) -> str | None:
        """adapter_id held by ``slot`` (None: empty)."""
        r = self._resident.get(slot)
        return r.adapter_id if r is not None else None

    @property
    def resident_slots(self) -> list[int]:
        return sorted(self._resident)

    def load(self, slot: int, weights: AdapterWeights) -> CopyHandle:
        """Copies ``weights`` into a device blob of their size for ``slot`` (replacing what it held) and returns
        the copy's handle: on CUDA the copy runs on a side stream, and the slot may be used by a step only once
        ``handle.done()``. Raises ValueError (nothing changed) for a rank over max_rank or a module these slots
        do not serve."""
        self._check_slot(slot)
        weights = self.prepare(weights)
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter {weights.adapter_id!r} has rank {weights.rank}, over max_rank={self.max_rank}")
        missing = sorted(k for k in weights.modules if k not in self._entry_of)
        if missing:
            layer, target = missing[0]
            raise ValueError(f"adapter {weights.adapter_id!r} adapts {target} of layer {layer}, which these slots do "
                             f"not serve (targets: {', '.join(self.targets)})")
        for key, t in weights.modules.items():
            e = self._entries[self._entry_of[key]]
            n_ok = t.lora_b.shape[-2] == e.out_features and t.lora_a.shape[-1] == e.in_features
            if not n_ok or (e.num_experts and t.lora_a.shape[0] != e.num_experts):
                raise ValueError(f"adapter {weights.adapter_id!r}: {key[1]} of layer {key[0]} has A "
                                 f"{tuple(t.lora_a.shape)} / B {tuple(t.lora_b.shape)}, which do not fit this model")
        if weights.flat is not None and weights.flat.dtype != self.dtype:  # re-pack: the alignment is in elements
            weights = AdapterWeights(
                adapter_id=weights.adapter_id, rank=weights.rank, nbytes=weights.nbytes, spec=weights.spec,
                modules={k: LoraTensors(t.lora_a.to(self.dtype), t.lora_b.to(self.dtype))
                         for k, t in weights.modules.items()})
        weights.pack()
        if slot in self._resident:
            self.clear(slot)
        blob, handle = self.copier.copy(weights.flat)
        base, elem = blob.data_ptr(), self.elem_size
        res = _Resident(weights.adapter_id, blob, np.zeros((max(1, len(self._entries)), 3), dtype=np.int64),
                        handle=handle)
        for key, a_off, a_shape, b_off, b_shape in weights.layout(elem):
            e = self._entry_of[key]
            a = blob[a_off:a_off + a_shape.numel()].view(a_shape)
            b = blob[b_off:b_off + b_shape.numel()].view(rank_major(b_shape)).transpose(-1, -2)  # [.., N, r]
            res.factors[e] = (a, b)
            res.rows[e] = (base + a_off * elem, base + b_off * elem, a_shape[-2])
            self._wrapper_of[e].loaded.add(slot)
        self._resident[slot] = res
        self._generation += 1
        return handle

    def clear(self, slot: int) -> None:
        """Frees ``slot``'s blob (its memory is reused only after the steps already enqueued that read it)."""
        self._check_slot(slot)
        res = self._resident.pop(slot, None)
        if res is None:
            return
        for e in res.factors:
            self._wrapper_of[e].loaded.discard(slot)
        self._generation += 1

    def _factors(self, slot: int, entry: int):
        res = self._resident.get(slot)
        return res.factors.get(entry) if res is not None else None

    def _rows(self, slot: int) -> np.ndarray:
        return self._resident[slot].rows

    # ---- the step's token map -------------------------------------------------------------------------------
    def _step_slots(self, distinct: list[int]) -> None:
        for c in distinct:
            if c not in self._resident:
                raise ValueError(f"slot {c} holds no adapter (resident: {self.resident_slots})")
        self.step_table.write(distinct, self._rows, self._generation)

    def step_indices(self, row_slots: list[int]) -> list[int]:
        """For the padded decode path: the step slot of each row's resident slot (-1 stays -1), after writing the
        step's LoRA table. The rows' map itself is the caller's static buffer (``bind_static_token_slots``)."""
        distinct = sorted({c for c in row_slots if c >= 0})
        self._step_slots(distinct)
        local = {c: i for i, c in enumerate(distinct)}
        return [local[c] if c >= 0 else -1 for c in row_slots]

    def set_token_slots(self, token_slots: torch.Tensor | None) -> None:
        """Sets the step's token map: [T] integer resident slot per token (-1 = no adapter). None: no LoRA work.

        Pass a CPU tensor: the step's adapters are taken on the host (no device sync), the step's LoRA table is
        written, the map of step slots is copied to the model's device, and the token grouping by step slot
        (``state.segments``, shared by every layer) is computed once on the device (None where the torch
        references run)."""
        state = self.state
        state.always_on, state.segments = False, None
        if token_slots is None:
            state.token_lora_idx, state.active_slots, state.num_slots = None, frozenset(), 0
            return
        if token_slots.dim() != 1 or token_slots.dtype.is_floating_point:
            raise ValueError(f"token slots must be a 1-D integer tensor, got {token_slots.dtype} "
                             f"{tuple(token_slots.shape)}")
        token_slots = token_slots.to(torch.int64)
        if token_slots.numel() and int(token_slots.min()) < -1:
            raise ValueError(f"token slots hold {int(token_slots.min())}; a slot is >= 0, or -1 for the base model")
        distinct = [int(c) for c in torch.unique(token_slots).tolist() if c >= 0]
        if not distinct:
            state.token_lora_idx, state.active_slots, state.num_slots = None, frozenset(), 0
            return
        self._step_slots(distinct)
        keys = torch.tensor(distinct, dtype=torch.int64)
        local = torch.where(token_slots < 0, -1, torch.searchsorted(keys, token_slots.clamp(min=0)))
        local = local.to(torch.int32)
        if self.device.type == "cuda":  # pinned: a pageable copy can wait for the work already on the stream
            local = local.pin_memory()
        state.token_lora_idx = local.to(self.device, non_blocking=True)
        state.active_slots, state.num_slots = frozenset(distinct), self.eager_step_slots(len(distinct))
        state.segments = ops.lora_segments(state.token_lora_idx, state.num_slots)

    def eager_step_slots(self, used: int) -> int:
        """The step slots L an eager step's LoRA kernels see for ``used`` distinct adapters: a power of two, at
        least EAGER_MIN_STEP_SLOTS (capped by max_step_slots). The kernels are compiled per power-of-two slot
        count, so an exact L would compile new kernel variants mid-serving whenever a step's adapter count
        reaches a new bucket (seconds of stall for every running request); the slots past ``used`` hold no
        token, so they launch no LoRA work (as in the decode graphs' wide tables)."""
        return min(self.max_step_slots, max(EAGER_MIN_STEP_SLOTS, 1 << max(0, used - 1).bit_length()))

    def bind_static_token_slots(self, token_lora_idx: torch.Tensor, num_slots: int) -> None:
        """Graph mode: every wrapper reads ``token_lora_idx`` (a static [T] int32 buffer of step slots on the
        model's device, -1 = no adapter, written per step from ``step_indices``) with ``num_slots`` step slots,
        and runs its LoRA kernels whatever the host knows of the slots (``always_on``), so a captured graph holds
        the LoRA work of every layer. ``set_token_slots`` (None included) leaves graph mode."""
        if token_lora_idx.device.type != self.device.type or token_lora_idx.dtype != torch.int32:
            raise ValueError(f"a static token map must be int32 on {self.device}, got {token_lora_idx.dtype} on "
                             f"{token_lora_idx.device}")
        if not 1 <= num_slots <= self.max_step_slots:
            raise ValueError(f"num_slots must be in [1, {self.max_step_slots}], got {num_slots}")
        state = self.state
        state.token_lora_idx, state.num_slots = token_lora_idx, num_slots
        state.active_slots = frozenset()
        state.always_on = True
        state.segments = ops.lora_segments(token_lora_idx, num_slots)

    def supports_static_token_slots(self) -> bool:
        """Whether the wrappers honour ``LoRAState.always_on`` (active with no slot loaded): graphs need it."""
        if not self._wrappers:
            return True
        state = self.state
        saved = (state.token_lora_idx, state.active_slots, state.always_on, state.segments, state.num_slots)
        loaded = [set(w.loaded) for w in self._wrappers]
        try:
            for w in self._wrappers:
                w.loaded.clear()
            state.token_lora_idx = torch.full((1,), -1, dtype=torch.int32, device=self.device)
            state.active_slots, state.always_on, state.num_slots = frozenset(), True, 1
            return all(w.lora_active() for w in self._wrappers)
        finally:
            state.token_lora_idx, state.active_slots, state.always_on, state.segments, state.num_slots = saved
            for w, flags in zip(self._wrappers, loaded):
                w.loaded.update(flags)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def max_adapter_bytes(model: nn.Module, *, max_rank: int, dtype: torch.dtype,
                      targets: tuple[str, ...] | None = None) -> int:
    """Device bytes of an adapter of ``max_rank`` on every target of ``model`` (what ``LoRASlots.max_footprint``
    gives once attached), without attaching anything: for sizing before ``init_lora``."""
    targets = tuple(targets or SUPPORTED_TARGETS)
    gate_up, down = EXPERT_TARGETS
    elem = torch.empty((), dtype=dtype).element_size()
    align = max(1, ALIGN_BYTES // elem)
    factors: list[int] = []  # elements of each factor
    for layer in model.model.layers:
        for path, mod in layer.named_modules():
            if isinstance(mod, Linear):
                parent_path, _, name = path.rpartition(".")
                names = mod.output_names or [name]
                for n, width in zip(names, mod.output_sizes):
                    if (f"{parent_path}.{n}" if parent_path else n) in targets:
                        factors += [max_rank * mod.in_features, max_rank * width]
            elif isinstance(mod, FusedExperts):
                E, H, I = mod.num_experts, mod.hidden_size, mod.intermediate_size
                if gate_up in targets:
                    factors += [E * max_rank * H, E * max_rank * 2 * I]
                if down in targets:
                    factors += [E * max_rank * I, E * max_rank * H]
    return elem * sum(_round_up(f, align) for f in factors)
