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


# ---------------------------------------------------------------------------------------- kernel layout
# Tiles of the layout ``mxfp4.prepare_for_kernel`` writes (row groups of 16, 64-K atoms of 128 int32 words), decoded
# straight into the operand fragment of the MMA whose M dimension runs over weight rows (``fused_moe_mxfp4``):
#
#     words  [32 lanes, RG, KA, 4] int32  (RG = BLOCK_N / 16 row groups, KA = BLOCK_K / 64 atoms)
#     scales [32 lanes, RG, KA, 1] int32  (the lane's 4 scale bytes of the atom: k block kb x row half jr)
#                           ──> w [BLOCK_N, BLOCK_K] (bf16: value * 2^-63, see below)
#
# The words are loaded as a 2-D [KA * RG * 32, 4] tile (rows: atom, then row group, then lane; 16 contiguous bytes a
# row), which Triton 3.6, 3.7 and 3.9 lay out the same way: lane i gets the words of lane i, warps the row groups,
# registers the atoms, which is where wgmma and mma.sync want them, so the reshape / permute to [32, RG, KA, 4] and
# the ones at the end move no data. (Loaded as [32, RG, KA, 4] the layout depends on how the release orders equal-
# contiguity dims: Triton 3.6 gave the lanes the first dim, 3.7 and later spread them over the others, and there the
# decoded tile went through shared memory, about a fifth more instructions a word; benchmarks/kernels/sm90_loops.py.)
# Each word becomes four bf16x2 registers with 9 integer operations (``_bf16x2_codes``): value * 2^-126,
# 0.5 a subnormal. The scale multiply then folds the 2^126 in: bf16 factor 2^(s - 64) (exact for E8M0 bytes
# 65..191, i.e. scales 2^-62 .. 2^64), the MMA accumulates value * 2^-63 and the epilogue multiplies by 2^63.
# DECODE selects how: DECODE_ASM one bf16x2 multiply per register (inline PTX), DECODE_BITS the same product in
# plain Triton bf16 (ptxas pairs the scalar multiplies, with register swaps), DECODE_EMULATE in float32 (exact; the
# interpreter, whose bf16 bitcasts and dots are wrong, and fp32 / fp16 activations, where the scale is applied
# exactly without the fold: 2^126 * 2^(s - 127), the byte 0 reading as 0).

DECODE_EMULATE = tl.constexpr(0)
DECODE_BITS = tl.constexpr(1)
DECODE_ASM = tl.constexpr(2)
BF16_FOLD = tl.constexpr(9.223372036854775808e18)  # 2^63: what the bf16 decode leaves out of every weight
_MASK = tl.constexpr(-2118090304)  # 0x81C081C0


@triton.jit
def row_groups(first_row_group, num_row_groups, RG: tl.constexpr):
    """Row groups ``first_row_group`` .. + RG of a matrix with ``num_row_groups`` groups, those past the matrix
    clamped to its last one (their rows are computed and never stored)."""
    return tl.minimum(first_row_group + tl.arange(0, RG), num_row_groups - 1)


@triton.jit
def kernel_tile_ptrs(w_ptr, s_ptr, rg, atoms, BLOCK_K: tl.constexpr):
    """Pointers of the first K step: words [KA * RG * 32, 4] from int32 ``w_ptr`` and scales [KA * RG * 32, 1] from
    ``s_ptr`` (the scale bytes read as int32) of the row groups ``rg`` [RG] of a matrix with ``atoms`` 64-K atoms
    per group, row (ka, rg, lane); ``load_kernel_tile`` gives them the decode's shape. A K step of BLOCK_K moves the
    words by 2 * BLOCK_K and the scales by BLOCK_K / 8. The multiple-of hint keeps the 16-byte loads (Triton 3.7
    loses the offsets' divisibility through the reshape)."""
    KA: tl.constexpr = BLOCK_K // 64
    RG: tl.constexpr = rg.shape[0]
    atom = tl.arange(0, KA)[:, None, None] + rg[None, :, None] * atoms  # [KA, RG, 1]
    lane = tl.arange(0, 32)[None, None, :]
    quad = tl.multiple_of(tl.reshape((atom * 32 + lane) * 4, (KA * RG * 32, 1)), (4, 4))
    w_ptrs = w_ptr + quad + tl.arange(0, 4)[None, :]
    s_ptrs = s_ptr + tl.reshape(atom * 8 + lane // 4, (KA * RG * 32, 1))
    return w_ptrs, s_ptrs


@triton.jit
def load_kernel_tile(w_ptrs, s_ptrs, first_atom, limit, MASKED: tl.constexpr, BLOCK_K: tl.constexpr):
    """The words [32, RG, KA, 4] and scales [32, RG, KA, 1] at ``w_ptrs`` / ``s_ptrs`` (``kernel_tile_ptrs``);
    with MASKED, atoms ``first_atom`` + i at or past ``limit`` (the K tail, or a whole step past the end of a
    split) read as 0."""
    KA: tl.constexpr = BLOCK_K // 64
    RG: tl.constexpr = w_ptrs.shape[0] // (32 * KA)
    if MASKED:
        ok = (first_atom + tl.arange(0, KA * RG * 32) // (RG * 32) < limit)[:, None]
        words, scales = tl.load(w_ptrs, mask=ok, other=0), tl.load(s_ptrs, mask=ok, other=0)
    else:
        words, scales = tl.load(w_ptrs), tl.load(s_ptrs)
    words = tl.permute(tl.reshape(words, (KA, RG, 32, 4)), (2, 1, 0, 3))
    return words, tl.permute(tl.reshape(scales, (KA, RG, 32, 1)), (2, 1, 0, 3))


@triton.jit
def _bf16x2_codes(x):
    """int32 words -> registers j = 0..3, each two bf16 bit patterns of value * 2^-126."""
    r0 = x & _MASK
    r1 = (x << 3) & _MASK
    r2 = (x << 6) & _MASK
    r3 = (((x & 0x6C006C00).to(tl.int64) * 1057) >> 8).to(tl.int32) & _MASK  # mxfp4._CODE_BITS[3]
    return r0, r1, r2, r3


@triton.jit
def _pair_factor(b):
    """E8M0 bytes (int32) -> bf16x2 bit patterns of 2^(b - 64) in both halves: (b + 63) << 7 | (b + 63) << 23."""
    return b * 0x00800080 + 0x1F801F80


@triton.jit
def _halves(r):
    """int32 [..] -> int16 [.., 2]: the low, then the high 16 bits."""
    return tl.join(r.to(tl.int16), (r >> 16).to(tl.int16))


@triton.jit
def decode_kernel_tile(words, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                       DECODE: tl.constexpr):
    """words [32, RG, KA, 4] int32, scales [32, RG, KA, 1] int32 -> w [BLOCK_N, BLOCK_K] in DTYPE, row
    16 rg + 8 jr + g and k = 64 ka + 32 kb + 16 ks + 8 jk + 2 q + h for lane 4 g + q (``mxfp4.prepare_for_kernel``).
    bf16 (every DECODE): value * 2^-63, multiply the accumulator by BF16_FOLD; other dtypes: exact."""
    RG: tl.constexpr = BLOCK_N // 16
    KA: tl.constexpr = BLOCK_K // 64
    x = tl.reshape(words, (32, RG, KA, 2, 2))  # lane rg ka kb ks (k step kt = 2 kb + ks)
    r0, r1, r2, r3 = _bf16x2_codes(x)
    r = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [.., kb, ks, jr, jk]: register j = 2 jk + jr
    b0 = scales & 0xFF  # (kb 0, jr 0)
    b1 = (scales >> 8) & 0xFF  # (kb 0, jr 1)
    b2 = (scales >> 16) & 0xFF  # (kb 1, jr 0)
    b3 = (scales >> 24) & 0xFF  # (kb 1, jr 1)
    s0 = tl.reshape(tl.join(b0, b2), (32, RG, KA, 2))  # jr 0, by kb
    s1 = tl.reshape(tl.join(b1, b3), (32, RG, KA, 2))  # jr 1
    s = tl.expand_dims(tl.expand_dims(tl.join(s0, s1), 4), 6)  # [.., kb, 1, jr, 1]
    if DTYPE == tl.bfloat16 and DECODE == DECODE_ASM:
        # One instance per register: inputs $1 $2 (the word's register twice) and $3 $4 (its factor twice), output
        # $0 the two bf16 of the pair. bf16 straight out of an asm with side effects (is_pure False) hides the
        # int32 loads and the joins from the compiler's operand-width heuristic, so that mma.sync (Triton's MMAv2)
        # takes the fragment as decoded (kWidth 2) instead of shuffling it across lanes; wgmma takes it as decoded
        # either way. fma with -0 (exact: x * f + -0 = x * f, signed zeros kept) builds for sm_80 too; ptxas emits
        # the same one HMUL2.BF16 on sm_90 as for mul.rn.bf16x2.
        f = tl.broadcast_to(_pair_factor(s), r.shape)
        w = tl.inline_asm_elementwise("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $3, z; }",
                                      "=r,r,r,r,r", [tl.join(r, r), tl.join(f, f)], dtype=tl.bfloat16, is_pure=False,
                                      pack=2)  # [.., h]
    elif DTYPE == tl.bfloat16 and DECODE == DECODE_BITS:
        f = ((s + 63) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w = _halves(r).to(tl.bfloat16, bitcast=True) * tl.expand_dims(f, 7)
    else:
        w = tl.join((r << 16).to(tl.float32, bitcast=True), (r & -65536).to(tl.float32, bitcast=True))
        if DTYPE == tl.bfloat16:  # 2^(s - 64), as the bf16 decode
            w = w * tl.expand_dims(((s + 63) << 23).to(tl.float32, bitcast=True), 7)
        else:
            w = w * 8.507059173023462e37 * tl.expand_dims((s << 23).to(tl.float32, bitcast=True), 7)
    w = tl.reshape(w, (8, 4, RG, KA, 2, 2, 2, 2, 2))  # g q rg ka kb ks jr jk h
    w = tl.permute(w, (2, 6, 0, 3, 4, 5, 7, 1, 8))  # rg jr g ka kb ks jk q h
    return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DTYPE)


@triton.jit
def load_kernel_atom(w_desc, s_desc, expert, half, rg0, atom):
    """One 64-K atom of kernel-layout words and scales through TMA (``fused_moe_mxfp4``'s "TMA" key): words
    [32, HB * RG, 1, 4] and scales [32, HB * RG, 1, 1] int32, as ``load_kernel_tile`` gives them at BLOCK_K 64, of
    row groups ``rg0`` .. + RG of halves ``half`` .. + HB (gate_up's gate / up rows) of ``expert``. ``w_desc``: a
    descriptor over the words viewed as [E, halves, groups, atoms * 4, 32] (128-byte rows, lane 8 lq + lr at row
    lq, words 4 lr ..) with box [1, HB, RG, 4, 32]; ``s_desc`` over the scales as int32 [E, halves, groups,
    atoms * 8], box [1, HB, RG, 8]. A box past the groups or atoms reads zeros (code 0, scale 0: weight 0). One
    atom a load keeps the box's rows on the lanes alone, so the shared-memory tile is read straight into the
    MMA fragments (a BLOCK_K-deep box would put warps across K and cost a layout round trip per step)."""
    w = w_desc.load([expert, half, rg0, atom * 4, 0])
    HB: tl.constexpr = w.shape[1]
    RG: tl.constexpr = w.shape[2]
    w = tl.reshape(tl.permute(tl.reshape(w, (HB * RG, 4, 8, 4)), (1, 2, 0, 3)), (32, HB * RG, 1, 4))
    s = tl.permute(tl.reshape(s_desc.load([expert, half, rg0, atom * 8]), (HB * RG, 8)), (1, 0))  # [8, RG']
    s = tl.reshape(tl.broadcast_to(tl.expand_dims(s, 1), (8, 4, HB * RG)), (32, HB * RG, 1, 1))
    return w, s
