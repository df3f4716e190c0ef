"""Fused MoE with MXFP4 weight-only experts (GPT-OSS's format, ``mxfp4.py``), dequantisation inside the GEMMs.

Two storage layouts, told apart by the blocks' dtype:

- checkpoint layout (uint8 blocks [E, N, K/2], scales [E, N, K/32]): ``fused_moe``'s kernels with W_MXFP4 set,
  each K step decoding a [BLOCK_K/2, BLOCK_N] byte tile (``mxfp4_dequant.mxfp4_tile``) before the dot;
- kernel layout (int32 words [E, N, KP/8], scales [E, N, KP/32], ``mxfp4.prepare_for_kernel``, KP = K rounded up
  to 64): the kernels below, what the engine runs on CUDA.

The kernel-layout GEMMs compute the transposed product, weight rows on the MMA's M dimension and the block's
routed pairs on its N (swap-AB):

    acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] (decoded in registers) @ x^T [BLOCK_K, BLOCK_M] (shared memory)

At decode a block holds a few tokens: with weights on M the MMA does no padded work on weights and the decoded
tile is the MMA's register operand, never stored to shared memory. Each thread loads its fragment's codes (16
bytes per 64-K atom and row group) and scales (4 bytes), and decodes them with bit operations and one bf16x2
multiply per two weights (``mxfp4_dequant.decode_kernel_tile``). The MMA follows from the tile: wgmma (Triton's
MMAv3) where BLOCK_M >= 16, the product's rows are a multiple of 64 and num_warps a multiple of 4, else mma.sync
(MMAv2: 1 or 2 warps, or BLOCK_M 8), which at decode issues about a third fewer instructions per weight (no
warpgroup fence and wait per 16-K step, and an n8 tile at BLOCK_M 8). Same pair tables as ``fused_moe``
(moe_align; one expert per BLOCK_M block, GROUP_M ordering). The gate_up kernel keeps a gate and an up accumulator,
or with GU_FUSED one over BLOCK_N / 2 gate rows and the same rows of up (one accumulator per warpgroup: half the
registers, so larger BLOCK_M or two CTAs per SM), and applies bias and activation in the epilogue (or stores the
pre-activation for the LoRA path). Either GEMM can split K (SPLIT_K for down, GU_SPLIT_K for gate_up: float32
partial sums per split, bias on split 0, routing weight on each; ``_gate_up_finish_kernel`` adds gate_up's splits
and applies the activation, ``_sum_pairs_kernel`` adds down's splits and top-k in one pass); without a down split
the pairs' outputs are written and the top-k sum is torch's, as in ``fused_moe``.

Expert LoRA in the epilogue (``LoRAEpilogue``, what ``moe_experts_lora`` passes at decode sizes): after the bias,
each program adds B_l[e] @ h for the block's pairs, one product per adapter slot present in the block (h: the
shrink's scaled rows, its split-K partials summed; B^T [E, r, N] read through the ``LoRATable``), split 0 only;
gate_up then applies its activation, down its routing weight, so the delta is where the separate expand would have
put it. The rows' slots and B addresses are read before the K loop (made before the step), the first slot's B tiles
before the wait for the shrink, each next slot's tiles before this slot's product.

Config keys (tuned files of op "fused_moe_mxfp4", ``loraplex tune``; else DEFAULT_CONFIG): BLOCK_M (pairs per
block, the MMA's N, 8 or more), BLOCK_N (weight rows, a multiple of 16; of 32 with GU_FUSED), BLOCK_K (a multiple
of 64), GROUP_M, SPLIT_K (down), GU_SPLIT_K (gate_up), GU_FUSED, PREFETCH (1: the next K step loaded into
registers while this one computes, instead of Triton's cp.async pipeline; launched with num_stages 1), PDL (1:
every kernel of the op launched with programmatic dependent launch on sm_90+: it starts while the previous kernel
drains, waits for it before reading, and lets the next one start after its K loop), DECODE
("asm": the scale multiply as inline PTX; "bits": the same in plain Triton), DIRECT (1: one routed pair per block
and no moe_align launch, ``route_tables``; for a token or two), LORA_L2 (1: with a LoRA epilogue, its B tiles
prefetched into L2 before the K loop, ``lora_l2``; on GPUs only), TMA (1: the words and scales copied into shared
memory through TMA descriptors, one 64-K atom a box, ``tma_descriptors`` / ``load_kernel_atom``; not with PREFETCH),
num_warps, num_stages, and DOWN_<key> (the down GEMM's own BLOCK_N, BLOCK_K, PREFETCH, DECODE, TMA, num_warps or
num_stages: its K is I and its N is H, not gate_up's
shape, and it has one accumulator where gate_up has two, so its best tile differs). Under TRITON_INTERPRET the
decode runs in float32 (``DECODE_EMULATE``: the interpreter's bf16 bitcasts and dots are wrong) and bf16 dots in
float32.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from loraplex.kernels import tuning
from loraplex.kernels.activation import gated_act
from loraplex.kernels.dot import dot
from loraplex.kernels.fused_moe import ACT_CODES, ACT_NONE, _grouped_pid, row_block, run_moe
from loraplex.kernels.moe_align import moe_align
from loraplex.kernels.mxfp4 import K_ATOM, ROW_GROUP, check_kernel_layout, is_kernel_layout, kernel_k
from loraplex.kernels.mxfp4_dequant import (BF16_FOLD, DECODE_ASM, DECODE_BITS, DECODE_EMULATE, decode_kernel_tile,
                                            kernel_tile_ptrs, load_kernel_atom, load_kernel_tile, row_groups)
from loraplex.kernels.reference_lora import check_mxfp4_weights
from loraplex.kernels.slot_blocks import pdl_enabled, pdl_launch, pdl_trigger, pdl_wait, tl_dtype
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.lora_shrink import block_r
from loraplex.kernels.lora_table import LoRATable

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "GU_SPLIT_K": 1,
                  "GU_FUSED": 0, "PREFETCH": 0, "PDL": 0, "DECODE": "asm", "DIRECT": 0, "num_warps": 4,
                  "num_stages": 4}
DECODES = {"asm": DECODE_ASM, "bits": DECODE_BITS}
FUSED_MAX_WARPS = 4  # GU_FUSED is applied with one warpgroup at most (``gate_up_constexprs``)


@triton.jit
def _mma(w, xt, acc, DECODE: tl.constexpr):
    """acc += w @ xt; DECODE_EMULATE (the interpreter) multiplies bf16 operands in float32."""
    if DECODE == DECODE_EMULATE and w.dtype == tl.bfloat16:
        return acc + dot(w.to(tl.float32), xt.to(tl.float32))
    else:
        return acc + dot(w, xt)


@triton.jit
def _lora_h(buf_ptr, pairs64, row_ok, R, stride_split, PARTS: tl.constexpr, BLOCK_R: tl.constexpr):
    """h [BLOCK_M, BLOCK_R] float32 of the block's pairs: the expert LoRA shrink's rows (scaled), its split-K
    partials added up (``fused_moe_lora.moe_lora_shrink``)."""
    r = tl.arange(0, BLOCK_R)
    ptrs = buf_ptr + pairs64[:, None] * R + r[None, :]
    ok = row_ok[:, None] & (r < R)[None, :]
    h = tl.load(ptrs, mask=ok, other=0.0)
    for part in tl.static_range(1, PARTS):
        h += tl.load(ptrs + part * stride_split, mask=ok, other=0.0)
    return h


@triton.jit
def _lora_rows(entries_ptr, slots, stride_el):
    """(address of B^T [BLOCK_M] int64, rank [BLOCK_M]) of each row's adapter slot (``slots``, -1: none; rank 0
    for those) from the ``LoRATable`` entries: read before the K loop, so the epilogue starts at the B tiles."""
    has = slots >= 0
    base = entries_ptr + tl.where(has, slots, 0).to(tl.int64) * stride_el
    return tl.load(base + 1, mask=has, other=0), tl.load(base + 2, mask=has, other=0).to(tl.int32)


@triton.jit
def _prefetch_l2(ptrs, ok):
    """Ask L2 for the lines at ``ptrs`` where ``ok`` (sm_80+ ``prefetch.global.L2``; nothing waits for them)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _lora_prefetch(slots, b_addr, b_rank, first_split, expert, col0, N, NOUT, OFF2, TWO: tl.constexpr,
                   ROWS: tl.constexpr, LINE: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Before the K loop: every B tile the epilogue will read (each lead row's slot, B^T rows up to its rank,
    columns [col0, col0 + ROWS) below N, and with TWO the same OFF2 columns further) pulled into L2, one prefetch
    per ``LINE`` elements (128 bytes), so that its bytes arrive while the K loop streams the weights and the
    epilogue reads them from L2."""
    NL: tl.constexpr = (ROWS + LINE - 1) // LINE
    lead, _ = _lora_leads(slots, b_rank, first_split)
    r = tl.arange(0, BLOCK_R)
    cols = col0 + tl.arange(0, NL) * LINE
    base = tl.where(lead, b_addr, 0).to(tl.pointer_type(W_DTYPE))
    ptrs = (base[:, None, None] + ((expert * b_rank[:, None] + r[None, :]).to(tl.int64) * NOUT)[:, :, None]
            + cols[None, None, :])
    ok = (lead[:, None] & (r[None, :] < b_rank[:, None]))[:, :, None] & (cols < N)[None, None, :]
    _prefetch_l2(ptrs, ok)
    if TWO:
        _prefetch_l2(ptrs + OFF2, ok)


@triton.jit
def _lora_leads(slots, b_rank, first_split):
    """(the rows that bring a slot with weights first [BLOCK_M], how many): each slot's B tile is read once, at its
    first row; only the first split-K split (``first_split``) adds it. Row by row (BLOCK_M is small): one
    reduction over the block's rows each, outside the K loop."""
    BLOCK_M: tl.constexpr = slots.shape[0]
    idx = tl.arange(0, BLOCK_M)
    dup = tl.zeros([BLOCK_M], tl.int32)
    for j in tl.static_range(BLOCK_M):
        dup += ((slots == tl.sum(tl.where(idx == j, slots, 0), 0)) & (idx > j)).to(tl.int32)
    lead = (b_rank > 0) & (dup == 0) & first_split
    return lead, tl.sum(lead.to(tl.int32), 0)


@triton.jit
def _lora_tile(after, lead, slots, b_addr, b_rank, expert, rows, rows_ok, NOUT, OFF2, TWO: tl.constexpr,
               W_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr):
    """(row, slot, rank, B tile [BLOCK_R, ROWS], and with TWO the tile OFF2 columns further) of the first lead row
    past row ``after``; row BLOCK_M and tiles masked to zeros (no memory read) where there is none."""
    BLOCK_M: tl.constexpr = slots.shape[0]
    idx = tl.arange(0, BLOCK_M)
    row = tl.min(tl.where(lead & (idx > after), idx, BLOCK_M), 0)
    pick = idx == row
    slot = tl.sum(tl.where(pick, slots, 0), 0)
    rank = tl.sum(tl.where(pick, b_rank, 0), 0)
    r = tl.arange(0, BLOCK_R)
    b_ptrs = (tl.multiple_of(tl.sum(tl.where(pick, b_addr, 0), 0).to(tl.pointer_type(W_DTYPE)), 16)
              + (expert * rank + r[:, None]) * NOUT + rows[None, :])
    b_ok = (r < rank)[:, None] & rows_ok[None, :]
    b = tl.load(b_ptrs, mask=b_ok, other=0.0)
    b2 = b
    if TWO:
        b2 = tl.load(b_ptrs + OFF2, mask=b_ok, other=0.0)
    return row, slot, rank, b, b2


@triton.jit
def _lora_epilogue(acc, acc2, h, slots, lead, count, row, slot, rank, b, b2, b_addr, b_rank, expert, rows, rows_ok,
                   NOUT, OFF2, TWO: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, DECODE: tl.constexpr):
    """The expert LoRA expand in the GEMM's epilogue: for each adapter slot l among the block's pairs (``slots``
    [BLOCK_M], -1 for padding and pairs without an adapter), acc [ROWS, BLOCK_M] += B_l[e][rows, :] @ h^T masked
    to l's pairs (B stored as B^T [E, r, NOUT]); with TWO, acc2 the same for output columns OFF2 + rows (gate_up's
    up half). ``row``, ``slot``, ``rank``, ``b``, ``b2``: the first lead's, from ``_lora_tile``, loaded by the
    caller before it waits for the shrink; each next slot's tiles are loaded before this slot's product. A block
    holds the pairs of one expert, so each (slot, expert, column tile) is read by one program."""
    r = tl.arange(0, BLOCK_R)
    for t in range(count):
        nxt = _lora_tile(row, lead, slots, b_addr, b_rank, expert, rows, rows_ok, NOUT, OFF2, TWO, W_DTYPE, BLOCK_R)
        # l's pairs and ranks only: rows of a slot without weights (rank 0) were never written
        ht = tl.trans(tl.where((slots == slot)[:, None] & (r < rank)[None, :], h, 0.0)).to(W_DTYPE)
        acc = _mma(tl.trans(b), ht, acc, DECODE)
        if TWO:
            acc2 = _mma(tl.trans(b2), ht, acc2, DECODE)
        row, slot, rank, b, b2 = nxt
    return acc, acc2


@triton.jit
def _split_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, split):
    """K range [k_begin, k_end) of split ``split``: an equal share of the BLOCK_K steps, the last split the rest."""
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = split * steps * BLOCK_K
    return k_begin, tl.minimum(k_begin + steps * BLOCK_K, K)


@triton.jit
def _load_xt(x_ptrs, k0, limit, row_ok, MASKED: tl.constexpr, BLOCK_K: tl.constexpr):
    """x^T [BLOCK_K, BLOCK_M] of K rows k0 ..; with MASKED, rows at or past ``limit`` read as 0."""
    if MASKED:
        return tl.load(x_ptrs, mask=row_ok[None, :] & (k0 + tl.arange(0, BLOCK_K) < limit)[:, None], other=0.0)
    else:
        return tl.load(x_ptrs, mask=row_ok[None, :], other=0.0)


@triton.jit
def _k_loop(acc, acc2, x_ptrs, w_ptrs, s_ptrs, w2_offset, s2_offset, row_ok, k_begin, k_end,
            TWO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            DECODE: tl.constexpr, PREFETCH: tl.constexpr, TMA: tl.constexpr = False, expert=0, rg0=0):
    """acc [BLOCK_N, BLOCK_M] += w @ x^T over K [k_begin, k_end), and with TWO acc2 += the tile ``w2_offset`` words
    / ``s2_offset`` scale words further (gate_up's up rows) against the same x^T.

    PREFETCH 0: plain loads in the loop, which Triton's software pipeliner turns into cp.async copies through
    shared memory (num_stages deep); PREFETCH 1 (num_stages 1): the next step's words, scales and x^T are loaded
    into registers while this step decodes and multiplies (one step of lookahead, no shared-memory round trip for
    the weights). TMA: ``w_ptrs`` / ``s_ptrs`` are the descriptors of ``load_kernel_atom`` (``expert``'s row groups
    from ``rg0``; with TWO, acc2's rows are the next half), each K step one TMA copy per 64-K atom, pipelined
    num_stages deep by Triton; ``x_ptrs`` then covers 64 rows of x^T, one atom."""
    atom_end = tl.cdiv(k_end, 64)
    if TMA:
        for k0 in range(k_begin, k_end, BLOCK_K):
            for a in tl.static_range(BLOCK_K // 64):
                xt = _load_xt(x_ptrs, k0 + 64 * a, k_end, row_ok, not EVEN_K, 64)
                words, scales = load_kernel_atom(w_ptrs, s_ptrs, expert, 0, rg0, k0 // 64 + a)
                acc = _mma(decode_kernel_tile(words, scales, BLOCK_N, 64, xt.dtype, DECODE), xt, acc, DECODE)
                if TWO:
                    words, scales = load_kernel_atom(w_ptrs, s_ptrs, expert, 1, rg0, k0 // 64 + a)
                    acc2 = _mma(decode_kernel_tile(words, scales, BLOCK_N, 64, xt.dtype, DECODE), xt, acc2, DECODE)
                x_ptrs += 64
    elif PREFETCH:
        xt = _load_xt(x_ptrs, k_begin, k_end, row_ok, True, BLOCK_K)
        words, scales = load_kernel_tile(w_ptrs, s_ptrs, k_begin // 64, atom_end, True, BLOCK_K)
        if TWO:
            words2, scales2 = load_kernel_tile(w_ptrs + w2_offset, s_ptrs + s2_offset, k_begin // 64, atom_end,
                                               True, BLOCK_K)
        for k0 in range(k_begin, k_end, BLOCK_K):
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * 2
            s_ptrs += BLOCK_K // 8
            xt_next = _load_xt(x_ptrs, k0 + BLOCK_K, k_end, row_ok, True, BLOCK_K)
            words_next, scales_next = load_kernel_tile(w_ptrs, s_ptrs, (k0 + BLOCK_K) // 64, atom_end, True,
                                                       BLOCK_K)
            if TWO:
                words2_next, scales2_next = load_kernel_tile(w_ptrs + w2_offset, s_ptrs + s2_offset,
                                                             (k0 + BLOCK_K) // 64, atom_end, True, BLOCK_K)
                acc2 = _mma(decode_kernel_tile(words2, scales2, BLOCK_N, BLOCK_K, xt.dtype, DECODE), xt, acc2,
                            DECODE)
                words2, scales2 = words2_next, scales2_next
            acc = _mma(decode_kernel_tile(words, scales, BLOCK_N, BLOCK_K, xt.dtype, DECODE), xt, acc, DECODE)
            xt, words, scales = xt_next, words_next, scales_next
    else:
        for k0 in range(k_begin, k_end, BLOCK_K):
            xt = _load_xt(x_ptrs, k0, k_end, row_ok, not EVEN_K, BLOCK_K)
            words, scales = load_kernel_tile(w_ptrs, s_ptrs, k0 // 64, atom_end, not EVEN_K, BLOCK_K)
            acc = _mma(decode_kernel_tile(words, scales, BLOCK_N, BLOCK_K, xt.dtype, DECODE), xt, acc, DECODE)
            if TWO:
                words, scales = load_kernel_tile(w_ptrs + w2_offset, s_ptrs + s2_offset, k0 // 64, atom_end,
                                                 not EVEN_K, BLOCK_K)
                acc2 = _mma(decode_kernel_tile(words, scales, BLOCK_N, BLOCK_K, xt.dtype, DECODE), xt, acc2, DECODE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * 2
            s_ptrs += BLOCK_K // 8
    return acc, acc2


@triton.jit
def gate_up_tile(x_ptr, w_ptr, s_ptr, expert, tok, row_ok, pid_n, k_begin, k_end, N, K, stride_xt, stride_we,
                 stride_se, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 DECODE: tl.constexpr, FUSED: tl.constexpr, PREFETCH: tl.constexpr, TMA: tl.constexpr = False):
    """(gate, up) accumulators [ROWS, BLOCK_M] float32 of row tile ``pid_n`` (ROWS = BLOCK_N, or BLOCK_N / 2 with
    FUSED: gate and up rows in one product) of expert ``expert``'s w13 (kernel layout: gate rows [0, N), up rows
    [N, 2N)) against the x rows ``tok`` over K [k_begin, k_end); no fold, bias or activation. TMA: ``w_ptr`` /
    ``s_ptr`` are ``load_kernel_atom``'s descriptors (box halves 2 with FUSED, else 1)."""
    if TMA:
        x_ptrs = x_ptr + tok[None, :] * stride_xt + (k_begin + tl.arange(0, 64))[:, None]  # x^T [64, BLOCK_M]
        RGT: tl.constexpr = BLOCK_N // 32 if FUSED else BLOCK_N // 16
        acc_g, acc_u = _k_loop(tl.zeros([BLOCK_N, BLOCK_M], tl.float32), tl.zeros([BLOCK_N, BLOCK_M], tl.float32),
                               x_ptrs, w_ptr, s_ptr, 0, 0, row_ok, k_begin, k_end, not FUSED, BLOCK_N, BLOCK_K,
                               EVEN_K, DECODE, False, True, expert.to(tl.int32), pid_n * RGT)
        if FUSED:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc_g, (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0)))
    else:
        atoms = (K + 63) // 64
        groups = N // 16
        w_e = w_ptr + expert * stride_we + k_begin * 2
        s_e = s_ptr.to(tl.pointer_type(tl.int32)) + expert * (stride_se // 4) + k_begin // 8
        x_ptrs = x_ptr + tok[None, :] * stride_xt + (k_begin + tl.arange(0, BLOCK_K))[:, None]  # x^T [BLOCK_K, BLOCK_M]
        if FUSED:  # one [BLOCK_N, BLOCK_M] product: gate rows, then the same rows of up (N further)
            RGH: tl.constexpr = BLOCK_N // 32
            ROWS: tl.constexpr = BLOCK_N // 2
            i = tl.arange(0, 2 * RGH)
            rg = tl.minimum(pid_n * RGH + i % RGH, groups - 1) + (i // RGH) * groups
            w_ptrs, s_ptrs = kernel_tile_ptrs(w_e, s_e, rg, atoms, BLOCK_K)
            acc, _ = _k_loop(tl.zeros([BLOCK_N, BLOCK_M], tl.float32), 0, x_ptrs, w_ptrs, s_ptrs, 0, 0, row_ok,
                             k_begin, k_end, False, BLOCK_N, BLOCK_K, EVEN_K, DECODE, PREFETCH)
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, ROWS, BLOCK_M)), (1, 2, 0)))
        else:  # gate rows [pid_n * BLOCK_N, + BLOCK_N) and the up rows N further (row group + N / 16)
            w_ptrs, s_ptrs = kernel_tile_ptrs(w_e, s_e, row_groups(pid_n * (BLOCK_N // 16), groups, BLOCK_N // 16),
                                              atoms, BLOCK_K)
            acc_g, acc_u = _k_loop(tl.zeros([BLOCK_N, BLOCK_M], tl.float32), tl.zeros([BLOCK_N, BLOCK_M], tl.float32),
                                   x_ptrs, w_ptrs, s_ptrs, groups * atoms * 128, groups * atoms * 8, row_ok, k_begin,
                                   k_end, True, BLOCK_N, BLOCK_K, EVEN_K, DECODE, PREFETCH)
    return acc_g, acc_u


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    lora_buf_ptr, lora_entries_ptr, lora_slot_ptr,
    # x [T, K]; w13 words [E, 2N, KP/8] int32; scales [E, 2N, KP/32] uint8 (read as int32); bias [E, 2N];
    # out [T*A, N] ([T*A, 2N] if ACT_NONE; float32 partial sums [SPLIT_K, T*A, 2N] if SPLIT_K > 1); tables;
    # with LORA: shrink's h [LORA_PARTS, T*A, lora_r] float32, the LoRATable entries [L, 1, 3], token slots [T]
    num_pairs, num_m, N, K, alpha, limit, lora_r,
    stride_xt, stride_we, stride_se, stride_be, stride_ot, stride_os, stride_lora_el, stride_lora_split,
    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_N: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DECODE: tl.constexpr, DIRECT: tl.constexpr,
    FUSED: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
    LORA: tl.constexpr = False, LORA_PARTS: tl.constexpr = 1, LORA_BLOCK_R: tl.constexpr = 16,
    LORA_DTYPE: tl.constexpr = tl.bfloat16, LATE_WAIT: tl.constexpr = False, LORA_L2: tl.constexpr = False,
    LORA_LINE: tl.constexpr = 64, TMA: tl.constexpr = False,
):
    if not LATE_WAIT:
        pdl_wait(USE_PDL)  # the tables and x come from the kernels just before
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    split = tl.program_id(1)
    dead, expert, pairs, row_ok = row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M, DIRECT)
    if dead:
        if LATE_WAIT:  # so that this grid never ends before the kernel it depends on
            pdl_wait(USE_PDL)
        return
    tok = (pairs // TOP_K).to(tl.int64)
    if LORA:  # the rows' slots and B addresses (made before the step) read before the K loop
        slots = tl.load(lora_slot_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
        b_addr, b_rank = _lora_rows(lora_entries_ptr, slots, stride_lora_el)
    k_begin, k_end = _split_range(K, BLOCK_K, SPLIT_K, split)
    ROWS: tl.constexpr = BLOCK_N // 2 if FUSED else BLOCK_N  # output columns of this program
    if LORA and LORA_L2:  # the epilogue's B tiles (gate columns, then up) on their way to L2 during the K loop
        _lora_prefetch(slots, b_addr, b_rank, split == 0, expert, pid_n * ROWS, N, 2 * N, N, True, ROWS, LORA_LINE,
                       LORA_DTYPE, LORA_BLOCK_R)
    acc_g, acc_u = gate_up_tile(x_ptr, w_ptr, s_ptr, expert, tok, row_ok, pid_n, k_begin, k_end, N, K, stride_xt,
                                stride_we, stride_se, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DECODE, FUSED, PREFETCH, TMA)
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    rows_ok = rows < N
    if LORA:  # the first slot's B tiles (gate columns, then up) in flight while the shrink's rows are awaited
        lead, count = _lora_leads(slots, b_rank, split == 0)
        row0, slot0, rank0, b0, b20 = _lora_tile(-1, lead, slots, b_addr, b_rank, expert, rows, rows_ok, 2 * N, N,
                                                 True, LORA_DTYPE, LORA_BLOCK_R)
    if LATE_WAIT:  # the kernel before (a LoRA shrink) may have run beside the K loop until here
        pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)  # the next kernel may launch (it waits for this grid to finish before reading)
    # ---- epilogue: the bf16 decode's 2^63, bias (split 0), activation; out[pair, n] = acc[n, pair]
    if x_ptr.dtype.element_ty == tl.bfloat16:
        acc_g *= BF16_FOLD
        acc_u *= BF16_FOLD
    if HAS_BIAS:
        first = (split == 0).to(tl.float32)
        acc_g += (tl.load(bias_ptr + expert * stride_be + rows, mask=rows_ok, other=0.0).to(tl.float32)
                  * first)[:, None]
        acc_u += (tl.load(bias_ptr + expert * stride_be + N + rows, mask=rows_ok, other=0.0).to(tl.float32)
                  * first)[:, None]
    if LORA:  # the gate_up LoRA delta (B^T [E, r, 2N]: gate columns, then up), before the activation
        pairs64 = pairs.to(tl.int64)
        h = _lora_h(lora_buf_ptr, pairs64, row_ok, lora_r, stride_lora_split, LORA_PARTS, LORA_BLOCK_R)
        acc_g, acc_u = _lora_epilogue(acc_g, acc_u, h, slots, lead, count, row0, slot0, rank0, b0, b20, b_addr,
                                      b_rank, expert, rows, rows_ok, 2 * N, N, True, LORA_DTYPE, LORA_BLOCK_R, DECODE)
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + pairs.to(tl.int64)[None, :] * stride_ot + rows[:, None]
    mask = row_ok[None, :] & rows_ok[:, None]
    if ACT == 2 or SPLIT_K > 1:  # pre-activation (or its partial sum): gate to columns [0, N), up to [N, 2N)
        tl.store(out_ptrs, acc_g.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + N, acc_u.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, gated_act(acc_g, acc_u, ACT, alpha, limit).to(out_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _gate_up_finish_kernel(part_ptr, out_ptr, N, alpha, limit, stride_ps, stride_pt, stride_ot,
                           # part [SPLIT_K, T*A, 2N] float32 (bias in split 0) -> out [T*A, N] = act(gate) * up,
                           # or [T*A, 2N] the pre-activation (ACT_NONE)
                           ACT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.zeros([BLOCK], tl.float32)
    up = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        gate += tl.load(part_ptr + s * stride_ps + p * stride_pt + cols, mask=ok, other=0.0)
        up += tl.load(part_ptr + s * stride_ps + p * stride_pt + N + cols, mask=ok, other=0.0)
    if ACT == 2:
        tl.store(out_ptr + p * stride_ot + cols, gate.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + p * stride_ot + N + cols, up.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + p * stride_ot + cols, gated_act(gate, up, ACT, alpha, limit).to(out_ptr.dtype.element_ty),
                 mask=ok)


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _down_kernel(
    h_ptr, w_ptr, s_ptr, bias_ptr, weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    lora_buf_ptr, lora_entries_ptr, lora_slot_ptr,
    # h [T*A, K]; w2 words [E, N, KP/8] int32; scales [E, N, KP/32] uint8; bias [E, N]; topk_weights [T*A];
    # out [T*A, N] (SPLIT_K 1) or float32 partial sums [SPLIT_K, T*A, N]; tables; LoRA as in _gate_up_kernel
    num_pairs, num_m, N, K, lora_r, lora_top_k,
    stride_ht, stride_we, stride_se, stride_be, stride_ot, stride_os, stride_lora_el, stride_lora_split,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_N: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DECODE: tl.constexpr,
    DIRECT: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
    LORA: tl.constexpr = False, LORA_PARTS: tl.constexpr = 1, LORA_BLOCK_R: tl.constexpr = 16,
    LORA_DTYPE: tl.constexpr = tl.bfloat16, LATE_WAIT: tl.constexpr = False, LORA_L2: tl.constexpr = False,
    LORA_LINE: tl.constexpr = 64, TMA: tl.constexpr = False,
):
    if not LATE_WAIT:
        pdl_wait(USE_PDL)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    split = tl.program_id(1)
    dead, expert, pairs, row_ok = row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M, DIRECT)
    if dead:
        if LATE_WAIT:  # so that this grid never ends before the kernel it depends on
            pdl_wait(USE_PDL)
        return
    pairs64 = pairs.to(tl.int64)
    if LORA:  # as in _gate_up_kernel
        slots = tl.load(lora_slot_ptr + pairs64 // lora_top_k, mask=row_ok, other=-1).to(tl.int32)
        b_addr, b_rank = _lora_rows(lora_entries_ptr, slots, stride_lora_el)
    if LORA and LORA_L2:  # as in _gate_up_kernel
        _lora_prefetch(slots, b_addr, b_rank, split == 0, expert, pid_n * BLOCK_N, N, N, 0, False, BLOCK_N,
                       LORA_LINE, LORA_DTYPE, LORA_BLOCK_R)
    k_begin, k_end = _split_range(K, BLOCK_K, SPLIT_K, split)
    if TMA:  # w_ptr / s_ptr: load_kernel_atom's descriptors; h^T [64, BLOCK_M], one atom a copy
        h_ptrs = h_ptr + pairs64[None, :] * stride_ht + (k_begin + tl.arange(0, 64))[:, None]
        acc, _ = _k_loop(tl.zeros([BLOCK_N, BLOCK_M], tl.float32), 0, h_ptrs, w_ptr, s_ptr, 0, 0, row_ok, k_begin,
                         k_end, False, BLOCK_N, BLOCK_K, EVEN_K, DECODE, False, True, expert.to(tl.int32),
                         pid_n * (BLOCK_N // 16))
    else:
        w_ptrs, s_ptrs = kernel_tile_ptrs(w_ptr + expert * stride_we + k_begin * 2,
                                          s_ptr.to(tl.pointer_type(tl.int32)) + expert * (stride_se // 4)
                                          + k_begin // 8,
                                          row_groups(pid_n * (BLOCK_N // 16), N // 16, BLOCK_N // 16),
                                          (K + 63) // 64, BLOCK_K)
        h_ptrs = h_ptr + pairs64[None, :] * stride_ht + (k_begin + tl.arange(0, BLOCK_K))[:, None]  # h^T [K, M]
        acc, _ = _k_loop(tl.zeros([BLOCK_N, BLOCK_M], tl.float32), 0, h_ptrs, w_ptrs, s_ptrs, 0, 0, row_ok, k_begin,
                         k_end, False, BLOCK_N, BLOCK_K, EVEN_K, DECODE, PREFETCH)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    if LORA:
        lead, count = _lora_leads(slots, b_rank, split == 0)
        row0, slot0, rank0, b0, b20 = _lora_tile(-1, lead, slots, b_addr, b_rank, expert, rows, rows_ok, N, 0,
                                                 False, LORA_DTYPE, LORA_BLOCK_R)
    if LATE_WAIT:
        pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    # ---- epilogue: the bf16 decode's 2^63, bias (split 0), routing weight; out[pair, n] = acc[n, pair]
    if h_ptr.dtype.element_ty == tl.bfloat16:
        acc *= BF16_FOLD
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + rows, mask=rows_ok, other=0.0).to(tl.float32)
        acc += (bias * (split == 0).to(tl.float32))[:, None]
    if LORA:  # the down LoRA delta, routing-weighted with the rest below
        h = _lora_h(lora_buf_ptr, pairs64, row_ok, lora_r, stride_lora_split, LORA_PARTS, LORA_BLOCK_R)
        acc, _ = _lora_epilogue(acc, 0, h, slots, lead, count, row0, slot0, rank0, b0, b20, b_addr, b_rank, expert,
                                rows, rows_ok, N, 0, False, LORA_DTYPE, LORA_BLOCK_R, DECODE)
    acc *= tl.load(weights_ptr + pairs64, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + pairs64[None, :] * stride_ot + rows[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & rows_ok[:, None])


@cached_launch
@triton.jit
def _sum_pairs_kernel(part_ptr, out_ptr, N, stride_ps, stride_pt, stride_ot,
                      # part [SPLIT_K, T*A, N] float32 -> out [T, N]: sum over splits and the token's A pairs
                      TOP_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        for a in tl.static_range(TOP_K):
            acc += tl.load(part_ptr + s * stride_ps + (t * TOP_K + a) * stride_pt + cols, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class LoRAEpilogue:
    """An expert LoRA delta that ``gate_up`` / ``down`` add in their epilogue instead of a separate expand launch:
    ``buf`` the shrink's rows [parts, T*A, R] float32 (``fused_moe_lora.moe_lora_shrink``: scaled, split-K
    partials summed in the epilogue), ``table`` the target's ``LoRATable`` (B read through its entries),
    ``token_slots`` [T] each token's step slot (-1: no adapter)."""
    buf: torch.Tensor
    table: LoRATable
    token_slots: torch.Tensor


# ``late_wait``: a PDL-launched GEMM runs its K loop before it waits for the kernel launched just before it (a LoRA
# shrink, whose rows only the epilogue or a later kernel reads), so the shrink overlaps the GEMM's weight stream
# (LORAPLEX_MOE_LORA_LATE_WAIT=0: the GEMM waits first, as everywhere else)
LORA_LATE_WAIT = os.environ.get("LORAPLEX_MOE_LORA_LATE_WAIT", "1") != "0"


def lora_l2(cfg: dict, device: torch.device) -> bool:
    """Whether cfg "LORA_L2" (1: each GEMM with a LoRA epilogue asks L2 for its B tiles before its K loop, so that
    they arrive beside the weight stream instead of after it) applies on ``device`` (a GPU, not the interpreter,
    which has no inline PTX)."""
    return bool(int(cfg.get("LORA_L2", 0))) and device.type == "cuda" and not _interpreting()


def _lora_args(lora: LoRAEpilogue | None, fallback: torch.Tensor, cfg: dict):
    """(pointers, lora_r, strides, constexprs) for the kernels' LoRA parameters (``fallback`` stands in unused;
    without LoRA the constexprs keep the kernels' defaults; with it, cfg's LORA_L2 where ``lora_l2`` applies)."""
    if lora is None:
        return [fallback] * 3, 0, [0, 0], {}
    if lora.token_slots.dim() != 1 or not lora.token_slots.is_contiguous():
        raise ValueError(f"token_slots must be a contiguous [T] tensor, got {tuple(lora.token_slots.shape)}")
    meta = dict(LORA=True, LORA_PARTS=lora.buf.shape[0], LORA_BLOCK_R=block_r(lora.table.max_rank),
                LORA_DTYPE=tl_dtype(lora.table.dtype))
    if lora_l2(cfg, fallback.device):
        meta.update(LORA_L2=True, LORA_LINE=128 // (torch.finfo(lora.table.dtype).bits // 8))
    return ([lora.buf, lora.table.entries, lora.token_slots], lora.buf.shape[2],
            [lora.table.entries.stride(0), lora.buf.stride(0)], meta)


# keys a config may set for the down GEMM alone with a DOWN_ prefix (DOWN_BLOCK_N 128: gate_up keeps BLOCK_N, down
# runs 128-row tiles); the row blocks (BLOCK_M, GROUP_M, DIRECT) come from the one alignment both GEMMs share
DOWN_KEYS = ("BLOCK_N", "BLOCK_K", "PREFETCH", "DECODE", "TMA", "num_warps", "num_stages")


def down_config(cfg: dict) -> dict:
    """``cfg`` as the down GEMM runs it: each ``DOWN_<key>`` (a key of DOWN_KEYS) in place of ``<key>``."""
    over = {k[5:]: v for k, v in cfg.items() if k.startswith("DOWN_")}
    bad = sorted(set(over) - set(DOWN_KEYS))
    if bad:
        raise ValueError(f"config keys {', '.join('DOWN_' + k for k in bad)}: the down GEMM may override only "
                         f"{', '.join(DOWN_KEYS)} (its row blocks are gate_up's)")
    return {**cfg, **over} if over else cfg


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def decode_mode(cfg: dict) -> int:
    """The kernels' DECODE constexpr for a config ("asm" / "bits"; DECODE_EMULATE under the interpreter)."""
    name = cfg.get("DECODE", DEFAULT_CONFIG["DECODE"])
    if name not in DECODES:
        raise ValueError(f"DECODE {name!r}: expected one of {sorted(DECODES)}")
    return int(DECODE_EMULATE) if _interpreting() else int(DECODES[name])


def _launch(cfg: dict) -> tuple[int, int, int, int, dict]:
    bm, bn, bk, gm = (int(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"))
    if bn % ROW_GROUP or bk % K_ATOM:
        raise ValueError(f"the MXFP4 kernel layout needs BLOCK_N a multiple of {ROW_GROUP} and BLOCK_K of {K_ATOM}, "
                         f"got BLOCK_N {bn}, BLOCK_K {bk}")
    prefetch = int(cfg.get("PREFETCH", 0))
    if prefetch not in (0, 1):
        raise ValueError(f"PREFETCH {prefetch!r}: expected 0 or 1")
    if prefetch and _tma(cfg):
        raise ValueError("TMA and PREFETCH exclude each other: TMA copies are pipelined by num_stages, PREFETCH "
                         "loads into registers; drop one")
    stages = 1 if prefetch else int(cfg["num_stages"])  # PREFETCH pipelines in registers, not through Triton's
    return bm, bn, bk, gm, dict(num_warps=int(cfg["num_warps"]), num_stages=stages)


def _tma(cfg: dict) -> bool:
    tma = int(cfg.get("TMA", 0))
    if tma not in (0, 1):
        raise ValueError(f"TMA {tma!r}: expected 0 or 1")
    return bool(tma)


def tma_descriptors(words: torch.Tensor, scales: torch.Tensor, *, halves: int, box_halves: int,
                    block_n: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The descriptors ``load_kernel_atom`` reads kernel-layout weights through (config key "TMA"): words [E, rows,
    KP/8] int32 as [E, halves, groups, atoms * 4, 32] and scales [E, rows, KP/32] uint8 as int32 [E, halves,
    groups, atoms * 8], ``halves`` 2 for w13 (gate rows, then up), 1 for w2; boxes of ``box_halves`` halves (2:
    GU_FUSED's one product over both) and ``block_n`` / (16 ``box_halves``) row groups, one 64-K atom deep."""
    num_experts, rows, kw = words.shape
    groups, atoms = rows // ROW_GROUP // halves, kw // 8
    rg = block_n // ROW_GROUP // box_halves
    w = words.view(num_experts, halves, groups, atoms * 4, 32)
    s = scales.view(num_experts, halves, groups, atoms * 32).view(torch.int32)
    return (TensorDescriptor.from_tensor(w, [1, box_halves, rg, 4, 32]),
            TensorDescriptor.from_tensor(s, [1, box_halves, rg, 8]))


def use_pdl(cfg: dict, device: torch.device) -> bool:
    """Whether cfg "PDL" (1: every launch of the op with programmatic dependent launch, so that each starts while
    the one before drains; each kernel waits for it before reading) applies on ``device`` (sm_90+, not the
    interpreter)."""
    return bool(int(cfg.get("PDL", 0))) and pdl_enabled(device)


def route_tables(topk_ids: torch.Tensor, num_experts: int, cfg: dict):
    """The row blocks' tables for ``gate_up`` / ``down``: moe_align's (sorted_ids, expert_ids, num_post), or with
    cfg DIRECT (one routed pair per block, for a batch of one or two tokens: no alignment launch, but an expert
    two pairs share is read twice) topk_ids flattened in every slot (the kernels read it as each block's expert)."""
    if int(cfg.get("DIRECT", 0)):
        ids = topk_ids.reshape(-1)
        return ids, ids, ids
    return moe_align(topk_ids, num_experts, int(cfg["BLOCK_M"]))


def _check_align(align, bm: int, direct: bool) -> None:
    sorted_ids, expert_ids, _ = align
    num_m = expert_ids.shape[0]
    if not direct and sorted_ids.shape[0] != num_m * bm:
        raise ValueError(f"align tables were made with block size {sorted_ids.shape[0] // max(num_m, 1)} but the "
                         f"config's BLOCK_M is {bm}")


def check_kernel_weights(x, w13, s13, w2, s2, topk_weights, topk_ids, activation: str) -> None:
    """Shapes of kernel-layout expert weights against x [T, H]: w13 words [E, 2I, KP(H)/8], w2 [E, H, KP(I)/8]."""
    if activation not in ACT_CODES:
        raise ValueError(f"unknown activation {activation!r}; expected 'silu' or 'swiglu_clamp'")
    check_kernel_layout(w13, s13, "w13")
    check_kernel_layout(w2, s2, "w2")
    hidden = x.shape[1]
    num_experts, two_i = w13.shape[:2]
    if (w13.shape[2] != kernel_k(hidden) // 8 or two_i % 32
            or w2.shape != (num_experts, hidden, kernel_k(two_i // 2) // 8)):
        raise ValueError(f"kernel-layout expert words w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match "
                         f"x [T, {hidden}]: expected w13 [E, 2I, KP(H)/8] and w2 [E, H, KP(I)/8], KP = K rounded up "
                         f"to {K_ATOM}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [T={x.shape[0]}, A]")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("w13 scales", s13), ("w2 scales", s2)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def gate_up_constexprs(cfg: dict, *, hidden: int, inter: int, top_k: int, act: int, has_bias: bool,
                       pdl: bool) -> dict:
    """The constexprs ``gate_up`` launches ``_gate_up_kernel`` with for ``cfg`` at x [T, hidden] and
    w13 [E, 2 * inter, ..] (``act``: an ACT_CODES value or ACT_NONE; ``pdl``: ``use_pdl``'s answer)."""
    bm, bn, bk, gm, launch = _launch(cfg)
    # GU_FUSED splits the one accumulator into its gate and up halves; with two warpgroups (num_warps 8) the halves
    # sit in different warps, and Triton 3.6's code for that split gives wrong values (measured on the GPU: the
    # pre-activation store is off by ~20% relative at M = 1727 and 2048, at times NaN). So a fused config of more
    # than one warpgroup runs as two products, as GU_FUSED 0 with the same tile.
    fused = bool(int(cfg.get("GU_FUSED", 0))) and launch["num_warps"] <= FUSED_MAX_WARPS
    if fused and bn % (2 * ROW_GROUP):
        raise ValueError(f"GU_FUSED needs BLOCK_N a multiple of {2 * ROW_GROUP} (gate and up halves of whole row "
                         f"groups), got {bn}")
    return dict(TOP_K=top_k, ACT=act, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                NUM_N=cdiv(inter, bn // 2 if fused else bn),
                SPLIT_K=max(1, min(int(cfg.get("GU_SPLIT_K", 1)), cdiv(hidden, bk))),
                EVEN_K=hidden % bk == 0, DECODE=decode_mode(cfg), DIRECT=bool(int(cfg.get("DIRECT", 0))),
                FUSED=fused, PREFETCH=int(cfg.get("PREFETCH", 0)), USE_PDL=pdl, TMA=_tma(cfg))


def down_constexprs(cfg: dict, *, hidden: int, inter: int, has_bias: bool, pdl: bool,
                    split_k: int | None = None) -> dict:
    """The constexprs ``down`` launches ``_down_kernel`` with for ``cfg`` at h [T*A, inter] and w2 [E, hidden, ..]
    (``split_k``: default cfg SPLIT_K, at most one split per K step; ``DOWN_`` keys applied, ``down_config``)."""
    cfg = down_config(cfg)
    bm, bn, bk, gm, _ = _launch(cfg)
    splits = int(cfg.get("SPLIT_K", 1) if split_k is None else split_k)
    return dict(HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_N=cdiv(hidden, bn),
                SPLIT_K=max(1, min(splits, cdiv(inter, bk))), EVEN_K=inter % bk == 0,
                DECODE=decode_mode(cfg), DIRECT=bool(int(cfg.get("DIRECT", 0))),
                PREFETCH=int(cfg.get("PREFETCH", 0)), USE_PDL=pdl, TMA=_tma(cfg))


@tuning.plan_cache
def _gate_up_plan(cfg: dict, *, interpreting: bool, **shape) -> tuple[dict, dict]:
    """(constexprs, launch options) of ``gate_up`` (``gate_up_constexprs``' keywords; ``interpreting`` keys
    decode_mode's answer), remembered per (config, shape)."""
    return gate_up_constexprs(cfg, **shape), _launch(cfg)[4]


@tuning.plan_cache
def _down_plan(cfg: dict, *, interpreting: bool, **shape) -> tuple[dict, dict]:
    """(constexprs, launch options) of ``down`` (as ``_gate_up_plan``)."""
    return down_constexprs(cfg, **shape), _launch(down_config(cfg))[4]


def gate_up(x, w13, s13, align, cfg: dict, *, top_k: int, activation: str | None, b13=None, alpha: float = 1.702,
            limit: float = 7.0, lora: LoRAEpilogue | None = None, late_wait: bool = False) -> torch.Tensor:
    """Kernel-layout gate_up over ``align`` = route_tables(topk_ids, E, cfg): x [T, H] -> act(gate) * up [T*A, I],
    or the pre-activation [gate | up] [T*A, 2I] when ``activation`` is None. cfg GU_SPLIT_K > 1 splits K: float32
    partial sums [S, T*A, 2I], then one launch adds them and applies the activation. ``lora``: the gate_up LoRA
    delta added before the activation (split 0 adds it). ``late_wait``: the kernel launched just before is a LoRA
    shrink (``LORA_LATE_WAIT``); x, the tables and the weights must come from earlier kernels."""
    num_pairs, hidden = x.shape[0] * top_k, x.shape[1]
    inter = w13.shape[1] // 2
    pdl = use_pdl(cfg, x.device)
    act = ACT_CODES[activation] if activation else ACT_NONE
    meta, launch = _gate_up_plan(cfg, interpreting=_interpreting(), hidden=hidden, inter=inter, top_k=top_k, act=act,
                                 has_bias=b13 is not None, pdl=pdl)
    _check_align(align, meta["BLOCK_M"], meta["DIRECT"])
    sorted_ids, expert_ids, num_post = align
    num_m = expert_ids.shape[0]
    splits = meta["SPLIT_K"]
    width = inter if activation else 2 * inter
    out = torch.empty(num_pairs, width, dtype=x.dtype, device=x.device)
    dest = out if splits == 1 else torch.empty(splits, num_pairs, 2 * inter, dtype=torch.float32, device=x.device)
    lora_ptrs, lora_r, lora_strides, lora_meta = _lora_args(lora, x, cfg)
    w_arg, s_arg = w13, s13
    if meta["TMA"]:
        w_arg, s_arg = tma_descriptors(w13, s13, halves=2, box_halves=2 if meta["FUSED"] else 1,
                                       block_n=meta["BLOCK_N"])
    _gate_up_kernel[(num_m * meta["NUM_N"], splits)](
        x, w_arg, s_arg, b13 if b13 is not None else x, dest, sorted_ids, expert_ids, num_post, *lora_ptrs,
        num_pairs, num_m, inter, hidden, float(alpha), float(limit), lora_r,
        x.stride(0), w13.stride(0), s13.stride(0), b13.stride(0) if b13 is not None else 0, dest.stride(-2),
        dest.stride(0) if splits > 1 else 0, *lora_strides, **meta, **lora_meta,
        LATE_WAIT=pdl and late_wait and LORA_LATE_WAIT, **launch, **pdl_launch(pdl))
    if splits > 1:
        block = min(1024, next_power_of_2(inter))
        _gate_up_finish_kernel[(num_pairs, cdiv(inter, block))](
            dest, out, inter, float(alpha), float(limit), dest.stride(0), dest.stride(1), out.stride(0), ACT=act,
            SPLIT_K=splits, BLOCK=block, USE_PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out


def down(h, w2, s2, topk_weights, align, cfg: dict, *, b2=None, split_k: int | None = None,
         lora: LoRAEpilogue | None = None, late_wait: bool = False) -> torch.Tensor:
    """Kernel-layout down GEMM, routing weight in the epilogue: h [T*A, I] (pair rows) -> [T*A, H]; with
    ``split_k`` (default cfg SPLIT_K) > 1 the float32 partial sums [SPLIT_K, T*A, H] (``sum_pairs`` adds them).
    ``lora``: the down LoRA delta, routing-weighted with the rest (split 0 adds it); ``late_wait`` as in ``gate_up``
    (h, too, from earlier kernels). cfg's ``DOWN_`` keys set down's own tile (``down_config``)."""
    num_pairs, inter = h.shape
    hidden = w2.shape[1]
    pdl = use_pdl(cfg, h.device)
    meta, launch = _down_plan(cfg, interpreting=_interpreting(), hidden=hidden, inter=inter, has_bias=b2 is not None,
                              pdl=pdl, split_k=split_k)
    _check_align(align, meta["BLOCK_M"], meta["DIRECT"])
    sorted_ids, expert_ids, num_post = align
    num_m = expert_ids.shape[0]
    splits = meta["SPLIT_K"]
    if splits == 1:
        out = torch.empty(num_pairs, hidden, dtype=h.dtype, device=h.device)
    else:
        out = torch.empty(splits, num_pairs, hidden, dtype=torch.float32, device=h.device)
    lora_ptrs, lora_r, lora_strides, lora_meta = _lora_args(lora, h, cfg)
    top_k = num_pairs // lora.token_slots.shape[0] if lora is not None else 1  # pair p's token: p // top_k
    w_arg, s_arg = w2, s2
    if meta["TMA"]:
        w_arg, s_arg = tma_descriptors(w2, s2, halves=1, box_halves=1, block_n=meta["BLOCK_N"])
    _down_kernel[(num_m * meta["NUM_N"], splits)](
        h, w_arg, s_arg, b2 if b2 is not None else h, topk_weights.reshape(-1).contiguous(), out, sorted_ids,
        expert_ids, num_post, *lora_ptrs, num_pairs, num_m, hidden, inter, lora_r, top_k,
        h.stride(0), w2.stride(0), s2.stride(0), b2.stride(0) if b2 is not None else 0, out.stride(-2),
        out.stride(0) if splits > 1 else 0, *lora_strides, **meta, **lora_meta,
        LATE_WAIT=pdl and late_wait and LORA_LATE_WAIT, **launch, **pdl_launch(pdl))
    return out


def sum_pairs(out: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype, *,
              pdl: bool = False) -> torch.Tensor:
    """[T*A, H] pair outputs -> [T, H] (torch's sum), or float32 split partials [S, T*A, H] -> [T, H] in ``dtype``
    (one launch; with ``pdl`` a PDL launch)."""
    if out.dim() == 2:
        return out.view(num_tokens, top_k, -1).sum(dim=1)
    splits, _, hidden = out.shape
    res = torch.empty(num_tokens, hidden, dtype=dtype, device=out.device)
    block = min(1024, next_power_of_2(hidden))
    _sum_pairs_kernel[(num_tokens, cdiv(hidden, block))](
        out, res, hidden, out.stride(0), out.stride(1), res.stride(0), TOP_K=top_k, SPLIT_K=splits, BLOCK=block,
        USE_PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return res


def kernel_config(x, w13, topk_ids, config: dict | None = None) -> dict:
    """``config`` (missing keys from DEFAULT_CONFIG), else the tuned "fused_moe_mxfp4" config at this shape."""
    if config:
        return {**DEFAULT_CONFIG, **config}
    from loraplex.kernels.fused_moe import shape_of

    return tuning.get_config("fused_moe_mxfp4", shape_of(x, w13, topk_ids), x.shape[0], DEFAULT_CONFIG)


def fused_moe_mxfp4(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids, *, activation="silu",
                    b13=None, b2=None, alpha=1.702, limit=7.0, config: dict | None = None) -> torch.Tensor:
    """Same contract as ``reference_lora.fused_moe_mxfp4`` (either layout); ``config`` overrides the tuned config
    (the tuner)."""
    check_mxfp4_weights(w13_blocks, w13_scales, w2_blocks, w2_scales)
    if not is_kernel_layout(w13_blocks):
        return run_moe(x, w13_blocks, w2_blocks, topk_weights, topk_ids, activation=activation, b13=b13, b2=b2,
                       alpha=alpha, limit=limit, w13_scale=w13_scales.contiguous(), w2_scale=w2_scales.contiguous(),
                       config=config, op="fused_moe_mxfp4")
    check_kernel_weights(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids, activation)
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(x)
    cfg = kernel_config(x, w13_blocks, topk_ids, config)
    if int(cfg.get("ONE_LAUNCH", 0)):  # both GEMMs in one launch (a token or two; fused_moe_mxfp4_one_launch)
        from loraplex.kernels.fused_moe_mxfp4_one_launch import one_launch

        return one_launch(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids, cfg,
                          activation=activation, b13=b13, b2=b2, alpha=alpha, limit=limit)
    align = route_tables(topk_ids, w13_blocks.shape[0], cfg)
    h = gate_up(x, w13_blocks, w13_scales, align, cfg, top_k=top_k, activation=activation, b13=b13, alpha=alpha,
                limit=limit)
    out = down(h, w2_blocks, w2_scales, topk_weights, align, cfg, b2=b2)
    return sum_pairs(out, num_tokens, top_k, x.dtype, pdl=use_pdl(cfg, x.device))


__all__ = ["DEFAULT_CONFIG", "DOWN_KEYS", "LoRAEpilogue", "check_kernel_weights", "decode_mode", "down", "down_config",
           "down_constexprs", "fused_moe_mxfp4", "gate_up", "gate_up_constexprs", "kernel_config", "lora_l2",
           "route_tables", "sum_pairs", "tma_descriptors", "use_pdl"]
