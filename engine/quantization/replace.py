"""Swap the FusedExperts modules of a built model for converted ones, in place (shared by the INT8 and MXFP4
transforms and by the conversion of a quantised checkpoint's experts)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from loraplex.engine.lora.layers import LoRAFusedExperts
from loraplex.engine.models.layers.moe import FusedExperts


def _is_float(m: nn.Module) -> bool:
    return type(m) is FusedExperts


def replace_experts(model: nn.Module, convert: Callable[[FusedExperts], FusedExperts], *, lora_slots=None,
                    what: str, select: Callable[[FusedExperts], bool] = _is_float) -> int:
    """Replace every ``FusedExperts`` of ``model`` that ``select`` picks (default: the float ones, exactly that
    class: quantised ones subclass it and are left alone) by ``convert(module)``, in place; returns how many.

    Works before and after multi-LoRA is attached: a ``LoRAFusedExperts`` wrapper gets the quantised module as
    its base and drops its references to the float weights. ``lora_slots`` (the ``LoRASlots`` attached to the
    model, e.g. ``engine.runner.lora``) keeps the unwrapped modules for ``detach``; pass it so those become the
    quantised ones too, or the float weights stay referenced there. The LoRA slot buffers are not touched.
    Call ``torch.cuda.empty_cache()`` afterwards to return the freed memory. ``what`` names the format in the
    error raised when nothing is left to convert (``what=None``: no error, 0)."""
    count = 0
    replaced: dict[int, FusedExperts] = {}
    # (parent, child name) pairs and wrappers only: holding the float modules themselves (e.g. a list of
    # model.modules()) would keep every layer's float weights alive until the end
    wrappers = [m for m in model.modules() if isinstance(m, LoRAFusedExperts)]
    sites = [(parent, name) for parent in model.modules() if not isinstance(parent, LoRAFusedExperts)
             for name, child in parent.named_children() if isinstance(child, FusedExperts) and select(child)]
    for wrapper in wrappers:
        if not isinstance(wrapper.base, FusedExperts) or not select(wrapper.base):
            continue
        q = convert(wrapper.base)
        replaced[id(wrapper.base)] = q
        wrapper._base = (q,)  # the wrapper has no public setter for its base
        for name in ("w13", "w2", "b13", "b2"):
            wrapper._parameters.pop(name, None)  # the wrapper mirrored the base's parameters
        for name, p in q.named_parameters(recurse=False):
            wrapper.register_parameter(name, p)
        count += 1
    for parent, name in sites:
        q = convert(getattr(parent, name))
        replaced[id(getattr(parent, name))] = q
        setattr(parent, name, q)  # the float module (and its weights) is freed here, one layer at a time
        count += 1
    if count == 0 and what is not None:
        raise ValueError(f"quantize_experts_{what} found no FusedExperts to quantise (already quantised, or not a "
                         f"MoE model)")
    if lora_slots is not None:
        lora_slots._originals = [(p, n, replaced.get(id(m), m)) for p, n, m in lora_slots._originals]
    return count
