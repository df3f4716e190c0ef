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

The kernel layout (``prepare_for_kernel``, applied once per weight on CUDA) holds the same codes and scales,
reordered so that the GEMM of ``fused_moe_mxfp4`` loads each thread's MMA operand fragment with one 16-byte load
and turns 8 codes into 4 bf16x2 registers with a few bit operations (see ``prepare_for_kernel``).
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


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                     k: int | None = None) -> torch.Tensor:
    """(blocks uint8 [.., N, K/2], scales uint8 [.., N, K/32]) -> w [.., N, K] in ``dtype``.

    Every MXFP4 value (an E2M1 value times a power of two) is exact in float32 and, bar underflow below 2^-133,
    in bfloat16 / float16's range, so the result does not depend on where the cast happens. Tensors in the kernel
    layout (int32 blocks, ``prepare_for_kernel``) are accepted too: ``k`` is then their K before padding
    (default: the padded K)."""
    if is_kernel_layout(blocks):
        blocks, scales = restore_from_kernel(blocks, scales, k if k is not None else blocks.shape[-1] * 8)
    check_mxfp4(blocks, scales)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()  # [.., N, K], even k first
    vals = _e2m1_table(blocks.device)[codes]
    k = vals.shape[-1]
    vals = vals.view(*vals.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
    out = torch.ldexp(vals, (scales.float() - SCALE_BIAS)[..., None])
    return out.reshape(*blocks.shape[:-1], k).to(dtype)


def _check_plain(blocks: torch.Tensor, scales: torch.Tensor, what: str) -> None:
    """blocks uint8 [.., N, K/2] and scales uint8 [.., N, K/32] of one MXFP4 tensor."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 {what} need uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}")
    if (blocks.dim() < 1 or scales.shape[:-1] != blocks.shape[:-1]
            or blocks.shape[-1] != scales.shape[-1] * BLOCK_SIZE // 2):
        raise ValueError(f"MXFP4 {what}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                         f"match; expected blocks [.., N, K/2] and scales [.., N, K/32]")


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, what: str = "weights") -> None:
    """blocks uint8 [.., N, K/2] and scales uint8 [.., N, K/32] of one MXFP4 tensor, or the same in the kernel
    layout (int32 blocks [.., N, KP/8], uint8 scales [.., N, KP/32])."""
    if is_kernel_layout(blocks):
        check_kernel_layout(blocks, scales, what)
    else:
        _check_plain(blocks, scales, what)


# ------------------------------------------------------------------------------------------ kernel layout

ROW_GROUP = 16  # rows of one warp's MMA fragment
K_ATOM = 64  # K elements of one atom (four 16-K MMA steps)
KERNEL_MAX_SCALE = 191  # largest E8M0 byte the kernels' bf16 decode (factor 2^(s - 64)) represents
# Bit of a 16-bit half of a word that each code bit (sign, e1, e0, m) lands on, per register j = 2 * jk + jr of a
# word: the decode is r0 = w & M, r1 = (w << 3) & M, r2 = (w << 6) & M (M = 0x81C081C0: bf16 sign and the low two
# exponent bits and top mantissa bit of each half) and r3 = ((w & 0x6C006C00) * 1057 >> 8) & M in 64 bits: the
# multiply by 2^10 + 2^5 + 1 puts copies of bits 13, 11, 10, 14 at +2, -3, -3, -8 after the shift, on 15, 8, 7, 6,
# and no two copies of any bit of either half on the same bit (so no carries): 4 operations instead of 6 shifts
# and masks.
_CODE_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (13, 11, 10, 14))


def kernel_k(k: int) -> int:
    """K of the kernel layout: K rounded up to whole 64-element atoms (the padding holds zero codes)."""
    return -(-k // K_ATOM) * K_ATOM


def is_kernel_layout(blocks: torch.Tensor) -> bool:
    """Whether ``blocks`` are in the kernel layout (int32 words) rather than the checkpoint's (uint8 bytes)."""
    return blocks.dtype == torch.int32


def check_kernel_layout(words: torch.Tensor, scales: torch.Tensor, what: str = "weights") -> None:
    """words int32 [.., N, KP/8] and scales uint8 [.., N, KP/32] (N a multiple of 16, KP of 64)."""
    if words.dtype != torch.int32 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 {what} in the kernel layout need int32 words and uint8 scales, got {words.dtype} "
                         f"and {scales.dtype}")
    if (words.dim() < 2 or scales.shape[:-1] != words.shape[:-1] or words.shape[-1] % (K_ATOM // 8)
            or words.shape[-1] != scales.shape[-1] * BLOCK_SIZE // 8 or words.shape[-2] % ROW_GROUP):
        raise ValueError(f"MXFP4 {what} in the kernel layout: words {tuple(words.shape)} and scales "
                         f"{tuple(scales.shape)} do not match; expected words [.., N, KP/8] and scales [.., N, KP/32] "
                         f"with N a multiple of {ROW_GROUP} and KP of {K_ATOM}")


def _spread(code: torch.Tensor, j: int) -> torch.Tensor:
    """4-bit codes (int64) -> their bits at register j's positions of a 16-bit half."""
    out = torch.zeros_like(code)
    for bit, pos in zip((3, 2, 1, 0), _CODE_BITS[j]):
        out |= ((code >> bit) & 1) << pos
    return out


def _gather(half: torch.Tensor, j: int) -> torch.Tensor:
    """Inverse of ``_spread``: 16-bit halves (int64) -> register j's 4-bit codes."""
    out = torch.zeros_like(half)
    for bit, pos in zip((3, 2, 1, 0), _CODE_BITS[j]):
        out |= ((half >> pos) & 1) << bit
    return out


def prepare_for_kernel(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [.., N, K/2], scales uint8 [.., N, K/32]) -> (words int32 [.., N, KP/8], scales uint8
    [.., N, KP/32]): the layout ``fused_moe_mxfp4``'s GEMM reads, KP = ``kernel_k(K)``, N a multiple of 16.

    Rows come in groups of 16 (one warp's MMA fragment: rows g and g + 8 for lane 4g + q), K in atoms of 64.
    Per (row group, atom), 128 words in lane order then K step, so a warp's 16-byte loads read 512 contiguous
    bytes and each lane gets exactly its fragment:

        words  [N/16][KP/64][32 lanes: 4g + q][4 k steps kt]     word = 8 codes, row 16 rg + 8 jr + g,
                                                                  k = 64 ka + 16 kt + 8 jk + 2 q + h
        scales [N/16][KP/64][8 g][2 kb][2 jr]                    row 16 rg + 8 jr + g, k block 2 ka + kb

    Inside a word, register j = 2 jk + jr of the fragment (two bf16, h = 0 low) takes the codes' bits at
    ``_CODE_BITS[j]`` of each 16-bit half (h = 1: the high half). Padding past K holds code 0 and scale 0. Torch
    only, one matrix at a time (temporaries of one [N, KP] int64); the inverse is ``restore_from_kernel``. Scale
    bytes above ``KERNEL_MAX_SCALE`` (2^64) are refused: the kernels' bf16 decode cannot represent them."""
    _check_plain(blocks, scales, "weights")
    if scales.numel() and int(scales.max()) > KERNEL_MAX_SCALE:
        raise ValueError(f"MXFP4 scale byte {int(scales.max())} (2^{int(scales.max()) - SCALE_BIAS}) is above the "
                         f"kernel layout's limit {KERNEL_MAX_SCALE} (2^{KERNEL_MAX_SCALE - SCALE_BIAS}); keep these "
                         f"weights in the checkpoint layout")
    *lead, n, half_k = blocks.shape
    if n % ROW_GROUP:
        raise ValueError(f"the MXFP4 kernel layout needs N (rows) to be a multiple of {ROW_GROUP}, got {n}")
    k = half_k * 2
    kp = kernel_k(k)
    flat_b, flat_s = blocks.reshape(-1, n, half_k), scales.reshape(-1, n, k // BLOCK_SIZE)
    words = torch.empty(flat_b.shape[0], n, kp // 8, dtype=torch.int32, device=blocks.device)
    kscales = torch.empty(flat_b.shape[0], n, kp // BLOCK_SIZE, dtype=torch.uint8, device=blocks.device)
    for i in range(flat_b.shape[0]):
        b = flat_b[i].to(torch.int64)
        codes = torch.nn.functional.pad(torch.stack([b & 0xF, b >> 4], dim=-1).reshape(n, k), (0, kp - k))
        c = codes.view(n // 16, 2, 8, kp // 64, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 5, 1, 7)  # rg ka g q kt jk jr h
        word = torch.zeros(c.shape[:5], dtype=torch.int64, device=blocks.device)
        for jk in range(2):
            for jr in range(2):
                for h in range(2):
                    word |= _spread(c[..., jk, jr, h], 2 * jk + jr) << (16 * h)
        words[i] = torch.where(word >= 2 ** 31, word - 2 ** 32, word).reshape(n, kp // 8).to(torch.int32)
        sc = torch.nn.functional.pad(flat_s[i], (0, (kp - k) // BLOCK_SIZE))
        kscales[i] = sc.view(n // 16, 2, 8, kp // 64, 2).permute(0, 3, 2, 4, 1).reshape(n, kp // BLOCK_SIZE)
    return words.reshape(*lead, n, kp // 8), kscales.reshape(*lead, n, kp // BLOCK_SIZE)


def restore_from_kernel(words: torch.Tensor, scales: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``prepare_for_kernel``: (words int32 [.., N, KP/8], scales uint8 [.., N, KP/32]) and the
    original K -> (blocks uint8 [.., N, K/2], scales uint8 [.., N, K/32])."""
    check_kernel_layout(words, scales)
    *lead, n, kp8 = words.shape
    kp = kp8 * 8
    check_mxfp4_k(k)
    if kernel_k(k) != kp:
        raise ValueError(f"K = {k} does not match the kernel layout's padded K {kp}")
    flat_w, flat_s = words.reshape(-1, n, kp8), scales.reshape(-1, n, kp // BLOCK_SIZE)
    blocks = torch.empty(flat_w.shape[0], n, k // 2, dtype=torch.uint8, device=words.device)
    plain = torch.empty(flat_w.shape[0], n, k // BLOCK_SIZE, dtype=torch.uint8, device=words.device)
    for i in range(flat_w.shape[0]):
        w = (flat_w[i].to(torch.int64) & 0xFFFFFFFF).view(n // 16, kp // 64, 8, 4, 4)  # rg ka g q kt
        c = torch.stack([torch.stack([torch.stack([_gather((w >> (16 * h)) & 0xFFFF, 2 * jk + jr) for h in range(2)],
                                                  dim=-1) for jr in range(2)], dim=-2) for jk in range(2)], dim=-3)
        codes = c.permute(0, 6, 2, 1, 4, 5, 3, 7).reshape(n, kp)[:, :k]  # rg jr g ka kt jk q h
        blocks[i] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        sc = flat_s[i].view(n // 16, kp // 64, 8, 2, 2).permute(0, 4, 2, 1, 3).reshape(n, kp // BLOCK_SIZE)
        plain[i] = sc[:, :k // BLOCK_SIZE]
    return blocks.reshape(*lead, n, k // 2), plain.reshape(*lead, n, k // BLOCK_SIZE)


__all__ = ["BLOCK_SIZE", "E2M1_VALUES", "KERNEL_MAX_SCALE", "K_ATOM", "ROW_GROUP", "SCALE_BIAS", "check_kernel_layout",
           "check_mxfp4", "check_mxfp4_k", "dequantize_mxfp4", "is_kernel_layout", "kernel_k", "prepare_for_kernel",
           "quantize_mxfp4", "restore_from_kernel"]
