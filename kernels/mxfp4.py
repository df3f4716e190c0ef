"""MXFP4 (OCP Microscaling, FP4 E2M1 elements) in torch: the weight format of GPT-OSS's experts.

A row of K weights is cut into blocks of 32 along K; each block shares one E8M0 scale (a power of two, stored as
its biased exponent, bias 127) and each element is a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit):

    code & 7    0    1    2    3    4    5    6    7        w ≈ (-1)^(code >> 3) * E2M1[code & 7] * 2^(scale - 127)
    E2M1        0   0.5   1   1.5   2    3    4    6

    w [.., N, K] float  ->  blocks uint8 [.., N, K/2]   two codes a byte, low nibble = even k
                            scales uint8 [.., N, K/32]  E8M0 biased exponents

4.25 bits per weight (4 + 8/32). The layout is the GPT-OSS checkpoint's ``*_blocks`` [.., N, K/32, 16] /
``*_scales`` [.., N, K/32] with the last two block dims merged. Quantisation follows the OCP MX rule: shared
exponent = floor(log2(absmax of the block)) - 2 (E2M1's largest exponent), elements rounded to the nearest E2M1
value (ties to the even code), saturating at 6. Torch only (the reference path and load-time quantisation run
on machines without Triton); the in-kernel dequantisation is ``mxfp4_dequant.mxfp4_tile``.
"""
from __future__ import annotations

import torch

BLOCK_SIZE = 32  # K elements per shared scale
SCALE_BIAS = 127  # E8M0 exponent bias
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
# Rounding thresholds between consecutive E2M1 magnitudes; a tie rounds to the even code: up where the lower
# code is odd ("ge"), down where it is even ("gt").
_THRESHOLDS = ((0.25, "gt"), (0.75, "ge"), (1.25, "gt"), (1.75, "ge"), (2.5, "gt"), (3.5, "ge"), (5.0, "gt"))


def check_mxfp4_k(k: int, what: str = "K") -> None:
    """MXFP4 needs whole 32-element blocks along K."""
    if k % BLOCK_SIZE:
        raise ValueError(f"MXFP4 needs {what} to be a multiple of {BLOCK_SIZE} (one shared scale per {BLOCK_SIZE} "
                         f"elements along K); got {k}")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] float (K a multiple of 32) -> (blocks uint8 [.., N, K/2], scales uint8 [.., N, K/32])."""
    if w.dim() < 1 or not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4 needs a floating-point tensor [.., N, K], got {w.dtype} {tuple(w.shape)}")
    k = w.shape[-1]
    check_mxfp4_k(k)
    wf = w.float().reshape(*w.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
    if not torch.isfinite(wf).all():
        raise ValueError("quantize_mxfp4: the weights hold NaN or Inf")
    amax = wf.abs().amax(dim=-1)  # [.., N, K/32]
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = torch.where(amax > 0, exp - 1 - 2, torch.full_like(exp, -SCALE_BIAS)).clamp(-SCALE_BIAS, SCALE_BIAS)
    mag = torch.ldexp(wf.abs(), -shared[..., None].float())  # exact: a power-of-two rescale
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=w.device)
    for t, rule in _THRESHOLDS:  # counts the thresholds passed: 0..7, saturating at 6.0 (code 7)
        code += (mag >= t if rule == "ge" else mag > t).to(torch.uint8)
    code |= (wf < 0).to(torch.uint8) << 3  # -0.0 rounds to +0 (code 0), as it must for a zero magnitude
    code = code.where(code != 8, torch.zeros_like(code)).reshape(*w.shape[:-1], k)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (shared + SCALE_BIAS).to(torch.uint8)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """[16] float32: the value of each 4-bit code (sign bit 3)."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mag, -mag])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(blocks uint8 [.., N, K/2], scales uint8 [.., N, K/32]) -> w [.., N, K] in ``dtype``.

    Every MXFP4 value (an E2M1 value times a power of two) is exact in float32 and, bar underflow below 2^-133,
    in bfloat16 / float16's range, so the result does not depend on where the cast happens."""
    check_mxfp4(blocks, scales)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()  # [.., N, K], even k first
    vals = _e2m1_table(blocks.device)[codes]
    k = vals.shape[-1]
    vals = vals.view(*vals.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
    out = torch.ldexp(vals, (scales.float() - SCALE_BIAS)[..., None])
    return out.reshape(*blocks.shape[:-1], k).to(dtype)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, what: str = "weights") -> None:
    """blocks uint8 [.., N, K/2] and scales uint8 [.., N, K/32] of one MXFP4 tensor."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 {what} need uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}")
    if (blocks.dim() < 1 or scales.shape[:-1] != blocks.shape[:-1]
            or blocks.shape[-1] != scales.shape[-1] * BLOCK_SIZE // 2):
        raise ValueError(f"MXFP4 {what}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                         f"match; expected blocks [.., N, K/2] and scales [.., N, K/32]")


__all__ = ["BLOCK_SIZE", "E2M1_VALUES", "SCALE_BIAS", "check_mxfp4", "check_mxfp4_k", "dequantize_mxfp4",
           "quantize_mxfp4"]
