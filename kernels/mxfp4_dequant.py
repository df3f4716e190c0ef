"""MXFP4 dequantisation inside a Triton GEMM's K loop (the format: ``mxfp4.py``).

    packed [BLOCK_K/2, BLOCK_N] uint8 (byte j of a column: k = 2j low nibble, 2j + 1 high)
    scales [BLOCK_K/32, BLOCK_N] uint8 (E8M0)                ──>  w [BLOCK_K, BLOCK_N] float32

A code becomes a float32 in three integer operations: shifted to bits 31..28, then arithmetically right by 6,
its sign lands on bit 31 and its exponent / mantissa bits on 24..22 (mask 0x81C00000 clears the smeared sign),
which is E2M1(code) * 2^-126 as a float32 (a subnormal for the codes 0.5 and 0); times 2^126, then times the scale
2^(scale-127) (a float32 built from its exponent bits; the E8M0 byte 0, 2^-127, reads as 0). Every step is exact,
so the tile equals ``dequantize_mxfp4`` and casting it to bf16 / fp16 is exact too. The two nibble planes are
interleaved back into K order with join / permute / reshape, and each scale row is broadcast over its 32 K rows.
Kept apart from ``mxfp4.py`` so that importing the torch format never imports Triton.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mxfp4_tile(packed, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """packed [BLOCK_K/2, BLOCK_N] uint8, scales [BLOCK_K/32, BLOCK_N] uint8 -> [BLOCK_K, BLOCK_N] float32
    (BLOCK_K a power of two >= 32; the caller casts to the dot's dtype, exactly)."""
    p = packed.to(tl.int32)
    lo = ((p << 28) >> 6) & -2118123520  # 0x81C00000: k = 2j (low nibble)
    hi = ((p << 24) >> 6) & -2118123520  # k = 2j + 1 (high nibble)
    w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N)).to(tl.float32, bitcast=True)
    s = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # [BLOCK_K/32, BLOCK_N]
    s = tl.reshape(tl.broadcast_to(tl.expand_dims(s, 1), (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
    w = w * 8.507059173023462e37  # 2^126: E2M1 values
    return w * s


@triton.jit
def load_mxfp4_tile(w_ptrs, s_ptrs, k0, K, col_ok, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile of K rows k0 .. k0 + BLOCK_K from byte pointers ``w_ptrs``
    [BLOCK_K/2, BLOCK_N] and scale pointers ``s_ptrs`` [BLOCK_K/32, BLOCK_N] (K a multiple of 32, so a masked
    row pair or scale row lies wholly past K; masked codes and scales load as 0, i.e. weight 0)."""
    if EVEN_K:
        packed = tl.load(w_ptrs, mask=col_ok[None, :], other=0)
        scales = tl.load(s_ptrs, mask=col_ok[None, :], other=0)
    else:
        kb = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        ks = k0 + 32 * tl.arange(0, BLOCK_K // 32)
        packed = tl.load(w_ptrs, mask=col_ok[None, :] & (kb < K)[:, None], other=0)
        scales = tl.load(s_ptrs, mask=col_ok[None, :] & (ks < K)[:, None], other=0)
    return mxfp4_tile(packed, scales, BLOCK_K, BLOCK_N)
