"""GPT-OSS's published MXFP4 checkpoint layout, and the loader's path from it to ``Mxfp4FusedExperts`` without a
float expert weight at any point.

Each MoE layer's experts (E experts, H hidden, I intermediate; everything else in the checkpoint is float):

    model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]  rows: gate / up interleaved
    model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]      E8M0, bias 127
    model.layers.N.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]
    model.layers.N.mlp.experts.down_proj_scales     uint8 [E, H, I/32]
    model.layers.N.mlp.experts.gate_up_proj_bias    float [E, 2I]            interleaved like the rows
    model.layers.N.mlp.experts.down_proj_bias       float [E, H]

A row (output channel) of blocks holds the K = H or I input features as K/32 blocks of 16 bytes, two E2M1 codes a
byte, the low nibble first: ``kernels/mxfp4.py``'s [N, K/2] with the last two dims merged (transformers'
``integrations/mxfp4.py`` decodes it the same way, then transposes to its [E, K, N] parameters). The engine's w13
rows are [gate; up], so the gate_up rows (codes, scales and bias) are de-interleaved: even rows gate, odd rows up.

    staged, sites = stage_mxfp4_experts(model, ["model.layers.0.mlp.experts", ...], device, dtype)
    ... copy the checkpoint's codes into staged[...] (the loader's targets) ...
    install_mxfp4_experts(staged, sites, dtype)      # each layer: Mxfp4FusedExperts.from_mxfp4(...)
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.quantization.mxfp4_experts import Mxfp4FusedExperts
from loraplex.kernels.mxfp4 import BLOCK_SIZE


def merge_blocks(t: torch.Tensor) -> torch.Tensor:
    """[E, N, K/32, 16] codes -> [E, N, K/2]; scales [E, N, K/32] pass unchanged."""
    return t.flatten(-2) if t.dim() == 4 else t


def gpt_oss_gate_up_codes(t: torch.Tensor) -> torch.Tensor:
    """gate_up blocks [E, 2I, H/32, 16] or scales [E, 2I, H/32], rows interleaved -> rows [gate; up], merged."""
    t = merge_blocks(t)
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def stage_mxfp4_experts(model: nn.Module, prefixes: list[str], device, dtype: torch.dtype) -> tuple[dict, dict]:
    """Detach the (meta-device) FusedExperts named by ``prefixes`` from ``model`` so that no float weight is
    ever allocated for them, and allocate the uint8 codes / scales and the ``dtype`` biases they load into.
    Returns ({tensor name, e.g. ``<prefix>.w13_blocks``: empty tensor}, {prefix: (parent module, meta module)})."""
    modules = dict(model.named_modules())
    staged: dict[str, torch.Tensor] = {}
    sites: dict[str, tuple[nn.Module, nn.Module]] = {}
    for prefix in prefixes:
        meta = modules[prefix]
        e, h, i = meta.num_experts, meta.hidden_size, meta.intermediate_size
        shapes = {"w13_blocks": (e, 2 * i, h // 2), "w13_scales": (e, 2 * i, h // BLOCK_SIZE),
                  "w2_blocks": (e, h, i // 2), "w2_scales": (e, h, i // BLOCK_SIZE)}
        for name, shape in shapes.items():
            staged[f"{prefix}.{name}"] = torch.empty(shape, dtype=torch.uint8, device=device)
        for name, shape in (("b13", (e, 2 * i)), ("b2", (e, h))):
            if getattr(meta, name) is not None:
                staged[f"{prefix}.{name}"] = torch.empty(shape, dtype=dtype, device=device)
        parent_name, _, child = prefix.rpartition(".")
        setattr(modules[parent_name], child, None)
        sites[prefix] = (modules[parent_name], meta)
    return staged, sites


def install_mxfp4_experts(staged: dict[str, torch.Tensor], sites: dict, dtype: torch.dtype) -> None:
    """The loaded codes of every staged layer become its Mxfp4FusedExperts (``from_mxfp4``, the one constructor);
    ``staged`` is emptied of them."""
    for prefix, (parent, meta) in sites.items():
        def take(name: str) -> torch.Tensor | None:
            return staged.pop(f"{prefix}.{name}", None)

        experts = Mxfp4FusedExperts.from_mxfp4(
            (take("w13_blocks"), take("w13_scales")), (take("w2_blocks"), take("w2_scales")), b13=take("b13"),
            b2=take("b2"), activation=meta.activation, alpha=meta.alpha, limit=meta.limit, dtype=dtype)
        setattr(parent, prefix.rpartition(".")[2], experts)


__all__ = ["gpt_oss_gate_up_codes", "install_mxfp4_experts", "merge_blocks", "stage_mxfp4_experts"]
