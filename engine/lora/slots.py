"""GPU-resident adapter slots and the transform that attaches multi-LoRA to a built model (gpt-fast style: the
model files know nothing of LoRA; ``LoRASlots(model, ...)`` swaps its Linear / FusedExperts modules for the
wrappers of ``layers.py``, which keep the same parameter names).

    slots = LoRASlots(model, model_config, max_loras=4, max_rank=16, device="cuda", dtype=torch.bfloat16)
    slots.load(2, load_adapter_weights(folder, model_config, max_rank=16, dtype=torch.bfloat16))
    slots.set_token_slots(token_lora_idx)    # once per step: [T] int32, -1 = base; None = no LoRA work at all
    slots.bind_static_token_slots(buf)       # CUDA-graph mode: a static device map, LoRA kernels always run
    hidden = model(...)

Buffers per adapted module, zero-padded to max_rank R so adapters of any rank share one kernel call
(L = max_loras, S output slices of a fused module, K in, N out, E experts):

    self_attn.qkv_proj  (q_proj, k_proj, v_proj)   lora_a [3, L, R, H]    lora_b [L, Q+2KV, R]
    self_attn.o_proj                              lora_a [1, L, R, Q]    lora_b [L, H, R]
    mlp.gate_up_proj    (gate_proj, up_proj)       lora_a [2, L, R, H]    lora_b [L, 2I, R]
    mlp.down_proj                                 lora_a [1, L, R, I]    lora_b [L, H, R]
    mlp.experts  gate_up_proj                     lora_a [L, E, R, H]    lora_b [L, E, 2I, R]
                 down_proj                        lora_a [L, E, R, I]    lora_b [L, E, H, R]

A slot's rows of every module the loaded adapter does not target stay zero (no delta).
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.format import EXPERT_TARGETS, SUPPORTED_TARGETS
from loraplex.engine.lora.layers import LoRAFusedExperts, LoRALinear, LoRAState
from loraplex.engine.lora.weights import AdapterWeights
from loraplex.engine.models.layers.linear import Linear
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.kernels import ops


class LoRASlots:
    """Owns the stacked slot buffers ``[max_loras, ...]`` on the model's device and the per-step token->slot map.

    ``targets`` limits which PEFT targets get buffers (default: every supported target the model has); loading
    an adapter that adapts another target raises ValueError."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, *, max_loras: int, max_rank: int,
                 device: torch.device | str, dtype: torch.dtype, targets: tuple[str, ...] | None = None) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras} and {max_rank}")
        unknown = set(targets or ()) - set(SUPPORTED_TARGETS)
        if unknown:
            raise ValueError(f"unknown LoRA targets {sorted(unknown)}; supported: {', '.join(SUPPORTED_TARGETS)}")
        self.model_config = model_config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype = torch.device(device), dtype
        self.targets = tuple(targets or SUPPORTED_TARGETS)
        self.state = LoRAState(max_loras, self.device)
        self.slot_adapter: list[str | None] = [None] * max_loras   # adapter_id held by each slot
        # (layer, target) -> (wrapper, slice index, row offset in lora_b, slice width) for Linear targets
        self._linear: dict[tuple[int, str], tuple[LoRALinear, int, int, int]] = {}
        # (layer, target) -> (wrapper, lora_a, lora_b) for expert targets
        self._experts: dict[tuple[int, str], tuple[LoRAFusedExperts, torch.Tensor, torch.Tensor]] = {}
        self._wrappers: list[nn.Module] = []
        self._originals: list[tuple[nn.Module, str, nn.Module]] = []
        for i, layer in enumerate(model.model.layers):
            for path, mod in list(layer.named_modules()):
                if isinstance(mod, Linear):
                    self._wrap_linear(i, layer, path, mod)
                elif isinstance(mod, FusedExperts):
                    self._wrap_experts(i, layer, path, mod)

    # ---- attaching ------------------------------------------------------------------------------------------
    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _replace(self, layer: nn.Module, path: str, new: nn.Module) -> None:
        parent_path, _, name = path.rpartition(".")
        parent = layer.get_submodule(parent_path) if parent_path else layer
        self._originals.append((parent, name, getattr(parent, name)))
        setattr(parent, name, new)
        self._wrappers.append(new)

    def _wrap_linear(self, layer_idx: int, layer: nn.Module, path: str, mod: Linear) -> None:
        parent_path, _, name = path.rpartition(".")
        names = mod.output_names or [name]
        slice_targets = [f"{parent_path}.{n}" if parent_path else n for n in names]
        if not any(t in self.targets for t in slice_targets):
            return  # routers, lm_head-like modules: not a LoRA target
        L, R = self.max_loras, self.max_rank
        lora_a = self._zeros(len(slice_targets), L, R, mod.in_features)
        lora_b = self._zeros(L, mod.out_features, R)
        wrapper = LoRALinear(mod, self.state, slice_targets, lora_a, lora_b)
        offset = 0
        for s, (target, width) in enumerate(zip(slice_targets, mod.output_sizes)):
            if target in self.targets:
                self._linear[(layer_idx, target)] = (wrapper, s, offset, width)
            offset += width
        self._replace(layer, path, wrapper)

    def _wrap_experts(self, layer_idx: int, layer: nn.Module, path: str, mod: FusedExperts) -> None:
        L, R, E = self.max_loras, self.max_rank, mod.num_experts
        H, I = mod.hidden_size, mod.intermediate_size
        gate_up, down = EXPERT_TARGETS
        w13 = (self._zeros(L, E, R, H), self._zeros(L, E, 2 * I, R)) if gate_up in self.targets else None
        w2 = (self._zeros(L, E, R, I), self._zeros(L, E, H, R)) if down in self.targets else None
        if w13 is None and w2 is None:
            return
        wrapper = LoRAFusedExperts(mod, self.state, L, w13, w2)
        for target, bufs in ((gate_up, w13), (down, w2)):
            if bufs is not None:
                self._experts[(layer_idx, target)] = (wrapper, *bufs)
        self._replace(layer, path, wrapper)

    def detach(self) -> None:
        """Puts the model's original modules back (the slot buffers are then unused)."""
        for parent, name, original in reversed(self._originals):
            setattr(parent, name, original)
        self._originals.clear()

    # ---- slots ----------------------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be an integer in [0, {self.max_loras}), got {slot!r}")

    def load(self, slot: int, weights: AdapterWeights) -> None:
        """Copies ``weights`` into ``slot`` (zero-padding its rank to max_rank; targets it lacks are cleared)."""
        self._check_slot(slot)
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter {weights.adapter_id!r} has rank {weights.rank}, over max_rank={self.max_rank}")
        missing = sorted(k for k in weights.modules if k not in self._linear and k not in self._experts)
        if missing:
            layer, target = missing[0]
            raise ValueError(f"adapter {weights.adapter_id!r} adapts {target} of layer {layer}, which these slots do "
                             f"not serve (targets: {', '.join(self.targets)})")
        self.clear(slot)
        nb = self.device.type == "cuda"  # asynchronous from pinned CPU memory; same stream as the next step
        for key, t in weights.modules.items():
            r = t.rank
            if key in self._linear:
                wrapper, s, off, width = self._linear[key]
                wrapper.lora_a[s, slot, :r].copy_(t.lora_a, non_blocking=nb)
                wrapper.lora_b[slot, off:off + width, :r].copy_(t.lora_b, non_blocking=nb)
            else:
                wrapper, lora_a, lora_b = self._experts[key]
                lora_a[slot, :, :r].copy_(t.lora_a, non_blocking=nb)
                lora_b[slot, :, :, :r].copy_(t.lora_b, non_blocking=nb)
            wrapper.loaded[slot] = True
        self.slot_adapter[slot] = weights.adapter_id

    def clear(self, slot: int) -> None:
        """Zeroes ``slot`` in every module: tokens pointing at it get no delta."""
        self._check_slot(slot)
        for w in self._wrappers:
            if isinstance(w, LoRALinear):
                w.lora_a[:, slot].zero_()
                w.lora_b[slot].zero_()
            else:
                for bufs in (w.w13_lora, w.w2_lora):
                    if bufs is not None:
                        bufs[0][slot].zero_()
                        bufs[1][slot].zero_()
            w.loaded[slot] = False
        self.slot_adapter[slot] = None

    def set_token_slots(self, token_lora_idx: torch.Tensor | None) -> None:
        """Sets the step's token -> slot map: [T] integer (-1 = no adapter). None: no LoRA work at all this step.

        Pass a CPU tensor: the set of slots in use is taken on the host (no device sync), the map is copied to the
        model's device here, and the step's token grouping by slot (``state.segments``, shared by every layer) is
        computed once on the device (None where the torch references run)."""
        state = self.state
        state.always_on, state.segments = False, None
        if token_lora_idx is None:
            state.token_lora_idx, state.active_slots = None, frozenset()
            return
        if token_lora_idx.dim() != 1 or token_lora_idx.dtype.is_floating_point:
            raise ValueError(f"token_lora_idx must be a 1-D integer tensor, got {token_lora_idx.dtype} "
                             f"{tuple(token_lora_idx.shape)}")
        lo, hi = (int(v) for v in torch.aminmax(token_lora_idx)) if token_lora_idx.numel() else (-1, -1)
        if lo < -1 or hi >= self.max_loras:
            raise ValueError(f"token_lora_idx holds slot {lo if lo < -1 else hi}, outside [-1, {self.max_loras})")
        if hi < 0:
            state.token_lora_idx, state.active_slots = None, frozenset()
            return
        used = {hi} if lo == hi else set(token_lora_idx.unique().tolist()) - {-1}
        state.token_lora_idx = token_lora_idx.to(self.device, torch.int32, non_blocking=True)
        state.active_slots = frozenset(used)
        state.segments = ops.lora_segments(state.token_lora_idx, self.max_loras)

    def bind_static_token_slots(self, token_lora_idx: torch.Tensor) -> None:
        """Graph mode: every wrapper reads ``token_lora_idx`` (a static [T] int32 buffer on the model's device,
        -1 = no adapter) and runs its LoRA kernels whatever the host knows of the slots (``always_on``), so a
        captured graph holds the LoRA work of every layer. ``set_token_slots`` (None included) leaves graph mode."""
        if token_lora_idx.device.type != self.device.type or token_lora_idx.dtype != torch.int32:
            raise ValueError(f"a static token map must be int32 on {self.device}, got {token_lora_idx.dtype} on "
                             f"{token_lora_idx.device}")
        state = self.state
        state.token_lora_idx = token_lora_idx
        state.active_slots = frozenset(range(self.max_loras))
        state.always_on = True
        state.segments = ops.lora_segments(token_lora_idx, self.max_loras)

    def supports_static_token_slots(self) -> bool:
        """Whether the wrappers honour ``LoRAState.always_on`` (active with no slot loaded): graphs need it."""
        if not self._wrappers:
            return True
        state = self.state
        saved = (state.token_lora_idx, state.active_slots, getattr(state, "always_on", False),
                 getattr(state, "segments", None))
        loaded = [list(w.loaded) for w in self._wrappers]
        try:
            for w in self._wrappers:
                w.loaded[:] = [False] * len(w.loaded)
            state.token_lora_idx = torch.full((1,), -1, dtype=torch.int32, device=self.device)
            state.active_slots, state.always_on = frozenset(), True
            return all(w.lora_active() for w in self._wrappers)
        finally:
            state.token_lora_idx, state.active_slots, state.always_on, state.segments = saved
            for w, flags in zip(self._wrappers, loaded):
                w.loaded[:] = flags

    @staticmethod
    def estimate_nbytes(model: nn.Module, *, max_loras: int, max_rank: int, dtype: torch.dtype,
                        targets: tuple[str, ...] | None = None) -> int:
        """Device bytes ``LoRASlots(model, ...)`` would allocate, without allocating (KV pool sizing)."""
        targets = tuple(targets or SUPPORTED_TARGETS)
        gate_up, down = EXPERT_TARGETS
        L, R = max_loras, max_rank
        elems = 0
        for layer in model.model.layers:
            for path, mod in layer.named_modules():
                if isinstance(mod, Linear):
                    parent_path, _, name = path.rpartition(".")
                    names = mod.output_names or [name]
                    slice_targets = [f"{parent_path}.{n}" if parent_path else n for n in names]
                    if any(t in targets for t in slice_targets):
                        elems += L * R * (len(slice_targets) * mod.in_features + mod.out_features)
                elif isinstance(mod, FusedExperts):
                    E, H, I = mod.num_experts, mod.hidden_size, mod.intermediate_size
                    if gate_up in targets:
                        elems += L * E * R * (H + 2 * I)
                    if down in targets:
                        elems += L * E * R * (I + H)
        return elems * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Device memory held by the slot buffers."""
        seen: dict[int, int] = {}
        for w in self._wrappers:
            bufs = [w.lora_a, w.lora_b] if isinstance(w, LoRALinear) else [
                t for pair in (w.w13_lora, w.w2_lora) if pair is not None for t in pair]
            for t in bufs:
                seen[id(t)] = t.nbytes
        return sum(seen.values())
