"""MXFP4 weight-only experts (GPT-OSS's native expert format): built from a published MXFP4 checkpoint's codes
(``from_mxfp4``, by the loader) or by quantising a float model's experts (a transform of the built model).

    experts = Mxfp4FusedExperts.from_mxfp4((w13_blocks, w13_scales), (w2_blocks, w2_scales), b13=b13, b2=b2, ...)
    n = quantize_experts_mxfp4(model)             # every float FusedExperts -> Mxfp4FusedExperts, in place

Format (``kernels/mxfp4.py``): per expert, output channel and block of 32 input features, one E8M0 power-of-two
scale and 32 E2M1 codes (4.25 bits per weight, half of INT8). Shapes (E experts, H hidden, I intermediate):
w13 [E, 2I, H] -> w13_blocks uint8 [E, 2I, H/2] + w13_scales uint8 [E, 2I, H/32]; w2 [E, H, I] -> w2_blocks
[E, H, I/2] + w2_scales [E, H, I/32]. H and I (per tensor-parallel rank) must be multiples of 32. Biases stay in
the model dtype. w13's rows are [gate; up] as in the float FusedExperts (a GPT-OSS checkpoint interleaves them:
the loader de-interleaves the rows of its blocks and scales).

The base path runs ``ops.fused_moe_mxfp4`` (Triton: codes and scales decoded to a weight tile inside the GEMM's
K loop; elsewhere the torch reference). ``LoRAFusedExperts`` passes the blocks and scales to
``ops.moe_experts_lora`` (uint8 weights with ``w*_scale``: MXFP4), whose GEMMs decode the same way, so the LoRA
path computes the float model with the dequantised weights. ``w13`` / ``w2`` (dequantised on each access) are
for inspection and tests only.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization.quantized_experts import QuantizedFusedExperts
from loraplex.engine.quantization.replace import replace_experts
from loraplex.kernels import ops
from loraplex.kernels.mxfp4 import (BLOCK_SIZE, check_mxfp4, check_mxfp4_k, dequantize_mxfp4, is_kernel_layout,
                                   prepare_for_kernel, quantize_mxfp4, restore_from_kernel)

logger = logging.getLogger(__name__)


class Mxfp4FusedExperts(QuantizedFusedExperts):
    """FusedExperts with MXFP4 weight-only w13/w2 (uint8 blocks + E8M0 scales). Built by ``from_mxfp4`` (every
    path ends there, ``from_float`` too)."""

    BUFFERS = ("blocks", "scales")
    FORMAT = "mxfp4"

    @classmethod
    def check_float(cls, experts: FusedExperts) -> None:
        check_mxfp4_k(experts.hidden_size, "hidden_size (K of w13)")
        check_mxfp4_k(experts.w2.shape[-1], "the expert intermediate size per rank (K of w2)")

    @classmethod
    def check_codes(cls, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]) -> None:
        for name, (blocks, scales) in (("w13", w13), ("w2", w2)):
            check_mxfp4(blocks, scales, name)
            if blocks.dim() != 3:
                raise ValueError(f"MXFP4 experts: {name} blocks must be [E, N, K/2], got {tuple(blocks.shape)}")
        (e, two_i, h), (e2, h2, i) = cls.shapes(w13, "w13"), cls.shapes(w2, "w2")
        if (e2, h2, 2 * i) != (e, h, two_i):
            raise ValueError(f"MXFP4 experts: w13 [E, 2I, H] = {(e, two_i, h)} and w2 [E, H, I] = {(e2, h2, i)} do "
                             f"not belong together")

    @classmethod
    def shapes(cls, codes: tuple[torch.Tensor, torch.Tensor], name: str) -> tuple[int, int, int]:
        e, n, half_k = codes[0].shape  # blocks [E, N, K/2]
        return e, n, 2 * half_k

    @classmethod
    def from_codes(cls, w13, w2, **kw):
        """w13 = (blocks uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/32]) with rows [gate; up], w2 = (blocks
        [E, H, I/2], scales [E, H, I/32]); ``b13`` [E, 2I] / ``b2`` [E, H] float, ``activation``, ``alpha``,
        ``limit``, ``dtype`` (the float model's) as keywords. The tensors are adopted on their device, not copied.
        The one constructor of the format: a layout change for a kernel belongs here."""
        return super().from_codes(w13, w2, **kw)

    from_mxfp4 = from_codes

    @staticmethod
    def quantize_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_mxfp4(w)  # [N, K/2] uint8 codes, [N, K/32] uint8 scales

    def dequantize_expert(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_mxfp4(blocks, scales, self.dtype)

    @property
    def in_kernel_layout(self) -> bool:
        """True once ``use_kernel_layout`` repacked the codes for the CUDA GEMM (int32 words)."""
        return is_kernel_layout(self.w13_blocks)

    @torch.no_grad()
    def use_kernel_layout(self, *, any_device: bool = False) -> bool:
        """Repack w13 / w2 in place into the layout the CUDA GEMMs read fastest (``mxfp4.prepare_for_kernel``:
        int32 words, K padded to 64); CUDA only (``any_device``: wherever the weights are, for host-time probes of
        the CUDA path), once the module is on its device and sharded. Weights that layout cannot hold (rows not a
        multiple of 16, scales above 2^64) keep the plain layout, which the same ops read too. Returns whether the
        module is in the kernel layout."""
        if self.in_kernel_layout:
            return True
        if self.w13_blocks.device.type != "cuda" and not any_device:
            return False
        try:
            w13 = prepare_for_kernel(self.w13_blocks, self.w13_scales)
            w2 = prepare_for_kernel(self.w2_blocks, self.w2_scales)
        except ValueError as err:
            logger.warning("MXFP4 experts keep the checkpoint layout: %s", err)
            return False
        (self.w13_blocks, self.w13_scales), (self.w2_blocks, self.w2_scales) = w13, w2
        return True

    def stored_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, scales = super().stored_codes(name)
        if not is_kernel_layout(blocks):
            return blocks, scales
        k = self.hidden_size if name == "w13" else self.intermediate_size
        return restore_from_kernel(blocks, scales, k)

    def shard_intermediate(self, rows: torch.Tensor, cols: torch.Tensor) -> "Mxfp4FusedExperts":
        """The tensor-parallel shard keeping w13 rows ``rows`` (this rank's gate rows, then its up rows) and w2
        columns ``cols`` (a contiguous range starting and ending on a 32-element block), as a new module."""
        if self.in_kernel_layout:
            raise ValueError("shard MXFP4 experts before use_kernel_layout(): the kernel layout is not split")
        start, n = int(cols[0]), len(cols)
        if start % BLOCK_SIZE or n % BLOCK_SIZE or not torch.equal(cols.cpu(), torch.arange(start, start + n)):
            raise ValueError(f"MXFP4 experts split along I need whole {BLOCK_SIZE}-element blocks per rank: "
                             f"{self.intermediate_size} / ranks = {n} is not a multiple of {BLOCK_SIZE}")
        rows = rows.to(self.w13_blocks.device)
        w13 = (self.w13_blocks[:, rows].contiguous(), self.w13_scales[:, rows].contiguous())
        w2 = (self.w2_blocks[:, :, start // 2:(start + n) // 2].contiguous(),
              self.w2_scales[:, :, start // BLOCK_SIZE:(start + n) // BLOCK_SIZE].contiguous())
        b13 = None if self.b13 is None else self.b13.data[:, rows].contiguous()
        b2 = None if self.b2 is None else self.b2.data.clone()
        return type(self).from_mxfp4(w13, w2, b13=b13, b2=b2, activation=self.activation, alpha=self.alpha,
                                     limit=self.limit, dtype=self.dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, A] float32; topk_ids [T, A] -> [T, H]."""
        return ops.fused_moe_mxfp4(x, self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales,
                                   topk_weights, topk_ids, activation=self.activation, b13=self.b13, b2=self.b2,
                                   alpha=self.alpha, limit=self.limit)


@torch.no_grad()
def quantize_experts_mxfp4(model: nn.Module, lora_slots=None) -> int:
    """Replace every float FusedExperts of ``model`` by an Mxfp4FusedExperts, in place; returns how many.
    Before or after multi-LoRA is attached; ``lora_slots``: see ``replace.replace_experts``."""
    return replace_experts(model, Mxfp4FusedExperts.from_float, lora_slots=lora_slots, what="mxfp4")


def use_mxfp4_kernel_layout(model: nn.Module, *, any_device: bool = False) -> int:
    """Repack every Mxfp4FusedExperts of ``model`` for the CUDA GEMMs (``Mxfp4FusedExperts.use_kernel_layout``),
    also those behind a LoRA wrapper (which keeps its base outside the module tree); returns how many are in the
    kernel layout. A no-op off CUDA unless ``any_device`` (host-time probes of the CUDA path)."""
    bases = (getattr(m, "base", m) for m in model.modules())
    return sum(m.use_kernel_layout(any_device=any_device) for m in bases if isinstance(m, Mxfp4FusedExperts))


__all__ = ["Mxfp4FusedExperts", "quantize_experts_mxfp4", "use_mxfp4_kernel_layout"]
