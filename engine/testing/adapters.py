"""Random adapters in the engine's layout, for tests and GPU checks that need no PEFT folder.

    w = random_adapter(runner.lora, "t/a/1", rank=8, seed=0)     # every target the slots serve, rank 8
    runner.lora.load(0, w)

The factors are scaled so that a delta is visible against the base model but does not swamp it (``scale``).
"""
from __future__ import annotations

import torch

from loraplex.engine.lora.format import AdapterSpec
from loraplex.engine.lora.weights import AdapterWeights, LoraTensors


def random_adapter(slots, adapter_id: str, *, rank: int, seed: int, scale: float = 0.3,
                   targets: tuple[str, ...] | None = None, device: str | torch.device = "cpu") -> AdapterWeights:
    """An adapter of ``rank`` on every (layer, target) ``slots`` (a ``LoRASlots``) serves, or only ``targets``;
    factors ~ N(0, scale^2) / sqrt(fan-in) in the slots' dtype, on ``device`` (CPU: what the CPU tier holds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    modules: dict[tuple[int, str], LoraTensors] = {}
    for e in slots._entries:
        if e.key is None or (targets is not None and e.key[1] not in targets):
            continue
        lead = (e.num_experts,) if e.num_experts else ()
        a = torch.randn(*lead, rank, e.in_features, generator=g, device=device) * (scale / e.in_features ** 0.5)
        b = torch.randn(*lead, e.out_features, rank, generator=g, device=device) * (scale / rank ** 0.5)
        modules[e.key] = LoraTensors(lora_a=a.to(slots.dtype).contiguous(), lora_b=b.to(slots.dtype).contiguous())
    nbytes = sum(t.lora_a.nbytes + t.lora_b.nbytes for t in modules.values())
    spec = AdapterSpec(rank=rank, alpha=float(rank), scaling=1.0, use_rslora=False,
                       targets=tuple(sorted({k[1] for k in modules})), modules=(), dtype=str(slots.dtype),
                       num_parameters=nbytes // slots.elem_size, base_model_name_or_path=None)
    return AdapterWeights(adapter_id=adapter_id, rank=rank, nbytes=nbytes, spec=spec, modules=modules).pack()


__all__ = ["random_adapter"]
