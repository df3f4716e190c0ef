"""Both MXFP4 expert GEMMs of a MoE layer in one launch, for a decode step of a token or two.

At one or two tokens the two kernel-layout GEMMs of ``fused_moe_mxfp4`` stream 53-93 MB of weights in 30-45 µs:
each launch's ramp and tail, the split-K finish launches and h's round trip through memory are a large share of
that. Here one program owns a tile of BLOCK_I intermediate columns of one row block (pairs of one expert):

    gate, up [BLOCK_I, BLOCK_M] = w13[e][tile rows] @ x^T            (decoded in registers, as ``gate_up``)
    h = act(gate + b_gate, up + b_up)                                (registers, rounded to x's dtype)
    for each BLOCK_H rows of H:  acc[tok, rows] += w(pair) * (w2[e][rows, tile] @ h  (+ b2[e][rows] in tile 0))

so every program streams its w13 tile and then the matching K slice of w2, and the programs' float32 partial sums
meet in ``acc`` [T, H] through atomic adds. The last program to finish (a counter after a memory fence in every
program) writes ``acc`` to the output in x's dtype: one launch, no h in memory, no finish launch. The atomic adds
make the sum's rounding order depend on which programs finish first, so the output's last bits may differ from run
to run (the split-K path's are fixed); the tuned configs take this path only where it was measured faster.

Config keys (the "fused_moe_mxfp4" config, ``fused_moe_mxfp4.kernel_config``): ONE_LAUNCH (1: ``fused_moe_mxfp4``
takes this path), ONE_BLOCK_I (intermediate columns per program, the down GEMM's K step: a multiple of 64),
ONE_BLOCK_H (down rows per step: a multiple of 16), and BLOCK_M, BLOCK_K (gate_up's K step), GU_FUSED, PREFETCH,
DECODE, DIRECT, PDL, TMA (gate_up's weights through TMA, ``fused_moe_mxfp4.tma_descriptors``; w2's K slices keep
pointer loads), num_warps and num_stages (both loops), each from its ``ONE_`` key where the config has one
(``one_config``), else shared with the two-launch GEMMs. A tuned entry keeps its two-launch keys for the expert
LoRA path (``moe_experts_lora`` runs the two GEMMs with their LoRA epilogues whatever ONE_LAUNCH says).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.activation import gated_act
from loraplex.kernels.fused_moe import ACT_CODES, row_block
from loraplex.kernels.fused_moe_mxfp4 import (FUSED_MAX_WARPS, _interpreting, _launch, _mma, _tma, decode_mode,
                                              gate_up_tile, route_tables, tma_descriptors, use_pdl)
from loraplex.kernels.intmath import cdiv
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.mxfp4 import K_ATOM, ROW_GROUP
from loraplex.kernels.mxfp4_dequant import BF16_FOLD, decode_kernel_tile, kernel_tile_ptrs, load_kernel_tile, row_groups
from loraplex.kernels.slot_blocks import pdl_launch, pdl_trigger, pdl_wait

FINAL_BLOCK = 1024  # output columns per step of the last program's copy


@triton.jit
def _fence_gpu(anchor):
    """fence.acq_rel.gpu in every thread: this thread's atomic adds are visible GPU-wide before what follows."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [anchor], dtype=tl.int32, is_pure=False,
                              pack=1)


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_m", "num_tokens"])
def _one_launch_kernel(
    x_ptr, w13_ptr, s13_ptr, b13_ptr, w2_ptr, s2_ptr, b2_ptr, weights_ptr, acc_ptr, done_ptr, out_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr,
    # x [T, H]; w13 words [E, 2I, KP(H)/8] int32, scales [E, 2I, KP(H)/32] uint8, bias [E, 2I]; w2 words
    # [E, H, KP(I)/8], scales [E, H, KP(I)/32], bias [E, H]; topk_weights [T*A]; acc [T, H] float32 and done (int32)
    # zeroed; out [T, H]; the row blocks' tables (``route_tables``)
    num_pairs, num_m, num_tokens, I, H, alpha, limit,
    stride_xt, stride_w13e, stride_s13e, stride_b13e, stride_w2e, stride_s2e, stride_b2e, stride_ot,
    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_B13: tl.constexpr, HAS_B2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, NUM_I: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_I: tl.constexpr, DECODE: tl.constexpr, DIRECT: tl.constexpr, FUSED: tl.constexpr, PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr, FENCE: tl.constexpr, FINAL: tl.constexpr, TMA: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # x, the tables and the zeroed acc come from the kernels just before
    pid = tl.program_id(0)
    pid_m = pid // NUM_I
    pid_i = pid % NUM_I
    dead, expert, pairs, row_ok = row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M, DIRECT)
    if not dead:
        tok = (pairs // TOP_K).to(tl.int64)
        # ---- gate_up: intermediate columns [pid_i * BLOCK_I, + BLOCK_I) over all of H
        GU_N: tl.constexpr = 2 * BLOCK_I if FUSED else BLOCK_I
        acc_g, acc_u = gate_up_tile(x_ptr, w13_ptr, s13_ptr, expert, tok, row_ok, pid_i, 0, H, I, H, stride_xt,
                                    stride_w13e, stride_s13e, BLOCK_M, GU_N, BLOCK_K, EVEN_K, DECODE, FUSED, PREFETCH,
                                    TMA)
        if x_ptr.dtype.element_ty == tl.bfloat16:
            acc_g *= BF16_FOLD
            acc_u *= BF16_FOLD
        cols = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        cols_ok = cols < I
        if HAS_B13:
            acc_g += tl.load(b13_ptr + expert * stride_b13e + cols, mask=cols_ok, other=0.0).to(tl.float32)[:, None]
            acc_u += tl.load(b13_ptr + expert * stride_b13e + I + cols, mask=cols_ok,
                             other=0.0).to(tl.float32)[:, None]
        # h^T [BLOCK_I, BLOCK_M] in x's dtype (what the two-launch path stores), zero past I
        h = tl.where(cols_ok[:, None], gated_act(acc_g, acc_u, ACT, alpha, limit), 0.0).to(x_ptr.dtype.element_ty)
        # ---- down: the K slice [pid_i * BLOCK_I, + BLOCK_I) of w2, BLOCK_H rows a step, into acc
        routing = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        first = (pid_i == 0).to(tl.float32)
        atoms = (I + 63) // 64
        w_e = w2_ptr + expert * stride_w2e + pid_i * BLOCK_I * 2
        s_e = s2_ptr.to(tl.pointer_type(tl.int32)) + expert * (stride_s2e // 4) + pid_i * (BLOCK_I // 8)
        RGH: tl.constexpr = BLOCK_H // 16
        for h0 in range(0, H, BLOCK_H):
            w_ptrs, s_ptrs = kernel_tile_ptrs(w_e, s_e, row_groups(h0 // 16, H // 16, RGH), atoms, BLOCK_I)
            words, scales = load_kernel_tile(w_ptrs, s_ptrs, pid_i * (BLOCK_I // 64), atoms, not EVEN_I, BLOCK_I)
            d = _mma(decode_kernel_tile(words, scales, BLOCK_H, BLOCK_I, h.dtype, DECODE), h,
                     tl.zeros([BLOCK_H, BLOCK_M], tl.float32), DECODE)
            if x_ptr.dtype.element_ty == tl.bfloat16:
                d *= BF16_FOLD
            rows = h0 + tl.arange(0, BLOCK_H)
            rows_ok = rows < H
            if HAS_B2:
                d += (tl.load(b2_ptr + expert * stride_b2e + rows, mask=rows_ok, other=0.0).to(tl.float32)
                      * first)[:, None]
            tl.atomic_add(acc_ptr + tok[None, :] * H + rows[:, None], d * routing[None, :],
                          mask=row_ok[None, :] & rows_ok[:, None], sem="relaxed")
    pdl_trigger(USE_PDL)
    # ---- the last program to get here writes acc out (every program's adds fenced before it counts itself)
    if FENCE:
        _fence_gpu(tl.zeros([1], tl.int32))
    tl.debug_barrier()
    count = tl.atomic_add(done_ptr, 1, sem="acq_rel")
    if count == tl.num_programs(0) - 1:
        if FENCE:
            _fence_gpu(tl.zeros([1], tl.int32))
        c = tl.arange(0, FINAL)
        for t in range(num_tokens):
            for c0 in range(0, H, FINAL):
                ok = c0 + c < H
                v = tl.load(acc_ptr + t * H + c0 + c, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + t * stride_ot + c0 + c, v.to(out_ptr.dtype.element_ty), mask=ok)


# keys a config may set for the one launch alone with a ONE_ prefix (ONE_num_stages 3: the one launch pipelines 3
# deep, the two-launch GEMMs that moe_experts_lora runs from the same config keep num_stages); ONE_LAUNCH,
# ONE_BLOCK_I and ONE_BLOCK_H are the one launch's own
ONE_KEYS = ("BLOCK_M", "BLOCK_K", "GU_FUSED", "PREFETCH", "DECODE", "DIRECT", "PDL", "TMA", "num_warps", "num_stages")
OWN_KEYS = ("ONE_LAUNCH", "ONE_BLOCK_I", "ONE_BLOCK_H")


def one_config(cfg: dict) -> dict:
    """``cfg`` as the one launch runs it: each ``ONE_<key>`` (a key of ONE_KEYS) in place of ``<key>``."""
    over = {k[4:]: v for k, v in cfg.items() if k.startswith("ONE_") and k not in OWN_KEYS}
    bad = sorted(set(over) - set(ONE_KEYS))
    if bad:
        raise ValueError(f"config keys {', '.join('ONE_' + k for k in bad)}: the one launch may override only "
                         f"{', '.join(ONE_KEYS)}")
    return {**cfg, **over} if over else cfg


def one_launch_constexprs(cfg: dict, *, hidden: int, inter: int, top_k: int, act: int, has_b13: bool,
                          has_b2: bool, pdl: bool, fence: bool) -> tuple[dict, dict]:
    """(constexprs, launch options) of ``_one_launch_kernel`` for ``cfg`` at x [T, hidden], w13 [E, 2 * inter, ..]
    (``fence``: the GPU's memory fence before the counter; off under the interpreter, which runs programs in turn)."""
    cfg = one_config(cfg)
    bm, _, bk, _, launch = _launch(cfg)
    bi, bh = int(cfg.get("ONE_BLOCK_I", 64)), int(cfg.get("ONE_BLOCK_H", 64))
    if bi <= 0 or bi % K_ATOM or bh <= 0 or bh % ROW_GROUP:
        raise ValueError(f"ONE_BLOCK_I must be a positive multiple of {K_ATOM} and ONE_BLOCK_H of {ROW_GROUP}, got "
                         f"{bi} and {bh}")
    fused = bool(int(cfg.get("GU_FUSED", 0))) and launch["num_warps"] <= FUSED_MAX_WARPS
    meta = dict(TOP_K=top_k, ACT=act, HAS_B13=has_b13, HAS_B2=has_b2, BLOCK_M=bm, BLOCK_I=bi, BLOCK_K=bk,
                BLOCK_H=bh, NUM_I=cdiv(inter, bi), EVEN_K=hidden % bk == 0, EVEN_I=inter % bi == 0,
                DECODE=decode_mode(cfg), DIRECT=bool(int(cfg.get("DIRECT", 0))), FUSED=fused,
                PREFETCH=int(cfg.get("PREFETCH", 0)), USE_PDL=pdl, FENCE=fence, FINAL=FINAL_BLOCK, TMA=_tma(cfg))
    return meta, launch


@tuning.plan_cache
def _plan(cfg: dict, *, interpreting: bool, **shape) -> tuple[dict, dict]:
    """``one_launch_constexprs`` remembered per (config, shape) (``interpreting`` keys decode_mode's answer), as the
    two-launch GEMMs' plans are: the same in every layer of a step."""
    return one_launch_constexprs(cfg, **shape)


def one_launch(x, w13, s13, w2, s2, topk_weights, topk_ids, cfg: dict, *, activation: str, b13=None, b2=None,
               alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The MoE layer's output [T, H] in x's dtype from kernel-layout weights (checked by the caller,
    ``fused_moe_mxfp4.check_kernel_weights``) in one launch after a zeroing one (``route_tables``' alignment launch
    too unless cfg DIRECT)."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w13.shape[1] // 2
    cfg = one_config(cfg)
    pdl = use_pdl(cfg, x.device)
    interpreting = _interpreting()
    meta, launch = _plan(cfg, interpreting=interpreting, hidden=hidden, inter=inter, top_k=top_k,
                         act=ACT_CODES[activation], has_b13=b13 is not None, has_b2=b2 is not None, pdl=pdl,
                         fence=x.device.type == "cuda" and not interpreting)
    sorted_ids, expert_ids, num_post = route_tables(topk_ids, w13.shape[0], cfg)  # made with this BLOCK_M
    num_m = expert_ids.shape[0]
    work = torch.zeros(num_tokens * hidden + 1, dtype=torch.float32, device=x.device)  # acc, then the counter
    acc, done = work[:-1], work[-1:].view(torch.int32)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    w13_arg, s13_arg = w13, s13
    if meta["TMA"]:  # gate_up's weights through TMA (``fused_moe_mxfp4.tma_descriptors``); w2 keeps pointer loads
        w13_arg, s13_arg = tma_descriptors(w13, s13, halves=2, box_halves=2 if meta["FUSED"] else 1,
                                           block_n=2 * meta["BLOCK_I"] if meta["FUSED"] else meta["BLOCK_I"])
    _one_launch_kernel[(num_m * meta["NUM_I"],)](
        x, w13_arg, s13_arg, b13 if b13 is not None else x, w2, s2, b2 if b2 is not None else x,
        topk_weights.reshape(-1).contiguous(), acc, done, out, sorted_ids, expert_ids, num_post,
        num_tokens * top_k, num_m, num_tokens, inter, hidden, float(alpha), float(limit),
        x.stride(0), w13.stride(0), s13.stride(0), b13.stride(0) if b13 is not None else 0, w2.stride(0),
        s2.stride(0), b2.stride(0) if b2 is not None else 0, out.stride(0), **meta, **launch, **pdl_launch(pdl))
    return out


__all__ = ["ONE_KEYS", "one_config", "one_launch", "one_launch_constexprs"]
