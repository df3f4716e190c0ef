"""Fused MoE in Triton: grouped GEMMs over the routed experts (bf16/fp16/fp32, or INT8 / MXFP4 weight-only).

    moe_align ──> gate_up GEMM + bias + act(gate) * up ──> down GEMM + bias, * routing weight ──> sum over A
                  inter [T*A, I]                            out [T*A, H]                         [T, H]

The gate_up kernel can also store the pre-activation [gate | up] [T*A, 2I] (ACT_NONE) so that a LoRA delta is
added before the activation (``moe_experts_lora``); ``gate_up`` / ``down`` launch one GEMM each for that op.

Both GEMMs walk BLOCK_M-row blocks of pairs sorted by expert (one expert per block, so one weight tile per
program). Programs are ordered in groups of GROUP_M blocks per column block for L2 reuse; blocks past the
padded pair count leave at once. INT8 weights are widened in registers and the per-output-channel scale is
applied to the fp32 accumulator (dequantisation fused). MXFP4 weights (uint8: two K elements a byte, W_MXFP4)
are decoded to a weight tile in the K loop (``mxfp4_dequant``), their per-32 E8M0 scales on the tile. The pair
count is not a compile-time constant. A config with ``"TMA": 1`` runs ``fused_moe_tma``'s kernels instead (16/32-bit
weights read through a TMA tensor descriptor).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.activation import gated_act
from loraplex.kernels.dot import dot
from loraplex.kernels.moe_align import moe_align
from loraplex.kernels.mxfp4_dequant import load_mxfp4_tile
from loraplex.kernels.intmath import cdiv
from loraplex.kernels.launch import cached_launch

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
ACT_CODES = {"silu": 0, "swiglu_clamp": 1}
ACT_NONE = 2  # gate_up stores the pre-activation [gate | up] (out [T*A, 2N])


@triton.jit
def _grouped_pid(pid, num_m, NUM_N: tl.constexpr, GROUP_M: tl.constexpr):
    per_group = GROUP_M * NUM_N
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """(dead, expert int64, pairs [BLOCK_M], row_ok [BLOCK_M]) of row block pid_m: from moe_align's tables (a block
    at or past num_post is dead: its caller returns), or with DIRECT one routed pair per block (pair pid_m of expert
    topk_ids[pid_m], read from ``expert_ids_ptr``; no tables)."""
    if DIRECT:
        dead = pid_m >= num_pairs
        expert = tl.load(expert_ids_ptr + pid_m, mask=pid_m < num_pairs, other=0).to(tl.int64)
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        dead = pid_m * BLOCK_M >= tl.load(num_post_ptr)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # -1 in dead blocks (unused)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return dead, expert, pairs, pairs < num_pairs


@triton.jit
def weight_tile(pid_n, N, w_ptr, scale_ptr, expert, stride_we, stride_wn, stride_se, stride_sn,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_MXFP4: tl.constexpr):
    """(cols, col_ok, weight pointers [BLOCK_K, BLOCK_N], scale pointers) of weight column block pid_n at K step 0.
    MXFP4: two K elements a byte ([BLOCK_K / 2, BLOCK_N] bytes) and one scale byte per 32 K ([BLOCK_K / 32,
    BLOCK_N]); otherwise the scale pointer is ``scale_ptr`` itself (INT8's per-row scales, read in the epilogue)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if W_MXFP4:
        w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + tl.arange(0, BLOCK_K // 2)[:, None]
        s_ptrs = scale_ptr + expert * stride_se + cols[None, :] * stride_sn + tl.arange(0, BLOCK_K // 32)[:, None]
    else:
        w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + tl.arange(0, BLOCK_K)[:, None]
        s_ptrs = scale_ptr
    return cols, cols < N, w_ptrs, s_ptrs


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _moe_gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # x [T, K]; w13 [E, 2N, K]; scale [E, 2N] (int8); bias [E, 2N]; out [T*A, N] ([T*A, 2N] if ACT_NONE); tables;
    # MXFP4: w13 [E, 2N, K/2] uint8, scale [E, 2N, K/32] uint8
    num_pairs, num_m, N, K, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ot,
    TOP_K: tl.constexpr, ACT: tl.constexpr, W_INT8: tl.constexpr, W_MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    dead, expert, pairs, row_ok = row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M, False)
    if dead:
        return
    tok = (pairs // TOP_K).to(tl.int64)
    cols, col_ok, wg_ptrs, sg_ptrs = weight_tile(pid_n, N, w_ptr, scale_ptr, expert, stride_we, stride_wn, stride_se,
                                                 stride_sn, BLOCK_N, BLOCK_K, W_MXFP4)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + k[None, :]
    wu_ptrs = wg_ptrs + N * stride_wn
    su_ptrs = sg_ptrs + N * stride_sn
    W_STEP: tl.constexpr = BLOCK_K // 2 if W_MXFP4 else BLOCK_K  # weight elements (MXFP4: bytes) per K step
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if W_MXFP4:
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                xt = tl.load(x_ptrs, mask=row_ok[:, None] & (k0 + k < K)[None, :], other=0.0)
            wg = load_mxfp4_tile(wg_ptrs, sg_ptrs, k0, K, col_ok, EVEN_K, BLOCK_K, BLOCK_N)
            wu = load_mxfp4_tile(wu_ptrs, su_ptrs, k0, K, col_ok, EVEN_K, BLOCK_K, BLOCK_N)
            sg_ptrs += BLOCK_K // 32
            su_ptrs += BLOCK_K // 32
        elif EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wg = tl.load(wg_ptrs, mask=col_ok[None, :], other=0)
            wu = tl.load(wu_ptrs, mask=col_ok[None, :], other=0)
        else:
            k_ok = k0 + k < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0)
            wu = tl.load(wu_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0)
        acc_g += dot(xt, wg.to(xt.dtype))
        acc_u += dot(xt, wu.to(xt.dtype))
        x_ptrs += BLOCK_K
        wg_ptrs += W_STEP
        wu_ptrs += W_STEP
    # ---- epilogue: dequant scale, bias, activation
    if W_INT8:
        acc_g *= tl.load(scale_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)[None, :]
        acc_u *= tl.load(scale_ptr + expert * stride_se + N + cols, mask=col_ok, other=0.0)[None, :]
    gate_up_store(acc_g, acc_u, bias_ptr, out_ptr, expert, pairs, row_ok, cols, col_ok, N, alpha, limit, stride_be,
                  stride_ot, ACT, HAS_BIAS)


@triton.jit
def gate_up_store(acc_g, acc_u, bias_ptr, out_ptr, expert, pairs, row_ok, cols, col_ok, N, alpha, limit, stride_be,
                  stride_ot, ACT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """gate_up's epilogue after any dequant scale: bias, then act(gate) * up, or [gate | up] (ACT_NONE), stored to
    the pairs' rows. Shared with ``fused_moe_tma``."""
    if HAS_BIAS:
        acc_g += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + expert * stride_be + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACT == 2:  # pre-activation: gate to columns [0, N), up to [N, 2N)
        tl.store(out_ptrs, acc_g.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + N, acc_u.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        h = gated_act(acc_g, acc_u, ACT, alpha, limit)
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _moe_down_kernel(
    h_ptr, w_ptr, scale_ptr, bias_ptr, weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # h [T*A, K]; w2 [E, N, K]; scale [E, N]; bias [E, N]; topk_weights [T*A]; out [T*A, N]; tables;
    # MXFP4: w2 [E, N, K/2] uint8, scale [E, N, K/32] uint8
    num_pairs, num_m, N, K,
    stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ot,
    W_INT8: tl.constexpr, W_MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    dead, expert, pairs, row_ok = row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M, False)
    if dead:
        return
    pairs64 = pairs.to(tl.int64)
    cols, col_ok, w_ptrs, ws_ptrs = weight_tile(pid_n, N, w_ptr, scale_ptr, expert, stride_we, stride_wn, stride_se,
                                                stride_sn, BLOCK_N, BLOCK_K, W_MXFP4)
    k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs64[:, None] * stride_ht + k[None, :]
    W_STEP: tl.constexpr = BLOCK_K // 2 if W_MXFP4 else BLOCK_K  # weight elements (MXFP4: bytes) per K step
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if W_MXFP4:
            if EVEN_K:
                ht = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                ht = tl.load(h_ptrs, mask=row_ok[:, None] & (k0 + k < K)[None, :], other=0.0)
            wt = load_mxfp4_tile(w_ptrs, ws_ptrs, k0, K, col_ok, EVEN_K, BLOCK_K, BLOCK_N)
            ws_ptrs += BLOCK_K // 32
        elif EVEN_K:
            ht = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=col_ok[None, :], other=0)
        else:
            k_ok = k0 + k < K
            ht = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0)
        acc += dot(ht, wt.to(ht.dtype))
        h_ptrs += BLOCK_K
        w_ptrs += W_STEP
    # ---- epilogue: dequant scale, bias, routing weight
    if W_INT8:
        acc *= tl.load(scale_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs64, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs64[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def shape_of(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> dict[str, int]:
    """Tuning-file shape key dims: experts, top-k, hidden, intermediate."""
    return {"E": w13.shape[0], "A": topk_ids.shape[1], "H": x.shape[1], "I": w13.shape[1] // 2}


def check_moe(x, w13, w2, topk_weights, topk_ids, activation: str) -> None:
    """Shape, layout and activation checks shared by the fused MoE launchers."""
    if activation not in ACT_CODES:
        raise ValueError(f"unknown activation {activation!r}; expected 'silu' or 'swiglu_clamp'")
    num_tokens, hidden = x.shape
    num_experts, two_i, h13 = w13.shape
    pack = 2 if w13.dtype == torch.uint8 else 1  # MXFP4 blocks: two K elements a byte
    if h13 * pack != hidden or w2.shape != (num_experts, hidden, two_i // 2 // pack):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match x "
                         f"[T, {hidden}]: expected w13 [E, 2I, H] and w2 [E, H, I]"
                         f"{' (uint8 MXFP4 blocks: K halved)' if pack > 1 else ''}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [T={num_tokens}, A]")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def moe_config(op: str, x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
               config: dict | None = None) -> dict:
    """``config``, else the tuned config of ``op`` ("fused_moe" / "fused_moe_int8" / "fused_moe_mxfp4") at this
    shape and M."""
    return dict(config) if config else tuning.get_config(op, shape_of(x, w13, topk_ids), x.shape[0],
                                                         DEFAULT_CONFIG)


def uses_tma(cfg: dict) -> bool:
    """The config reads the expert weights through TMA (``fused_moe_tma``; bf16 / fp16 / fp32 weights only)."""
    return bool(int(cfg.get("TMA", 0)))


def _launch_args(cfg: dict) -> tuple[int, int, int, int, dict]:
    bm, bn, bk, gm = (int(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"))
    return bm, bn, bk, gm, dict(num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))


def gate_up(x, w13, align, cfg: dict, *, top_k: int, activation: str | None, b13=None, w13_scale=None,
            alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The gate_up grouped GEMM over ``align`` = moe_align(topk_ids, E, cfg BLOCK_M): x [T, H] ->
    act(gate) * up [T*A, I], or the pre-activation [gate | up] [T*A, 2I] when ``activation`` is None."""
    bm, bn, bk, gm, launch = _launch_args(cfg)
    sorted_ids, expert_ids, num_post = align
    num_pairs, hidden = x.shape[0] * top_k, x.shape[1]
    inter = w13.shape[1] // 2
    num_m = expert_ids.shape[0]
    if sorted_ids.shape[0] != num_m * bm:
        raise ValueError(f"align tables were made with block size {sorted_ids.shape[0] // max(num_m, 1)} but the "
                         f"config's BLOCK_M is {bm}")
    mxfp4 = w13.dtype == torch.uint8  # MXFP4 blocks; w13_scale their E8M0 scales
    if mxfp4 and (w13_scale is None or bk < 32 or bk & (bk - 1)):
        raise ValueError(f"MXFP4 weights need their scales and BLOCK_K a power of two >= 32, got BLOCK_K {bk}")
    int8 = w13_scale is not None and not mxfp4
    out = torch.empty(num_pairs, inter if activation else 2 * inter, dtype=x.dtype, device=x.device)
    act = ACT_CODES[activation] if activation else ACT_NONE
    if uses_tma(cfg):
        from loraplex.kernels import fused_moe_tma  # imports this module
        return fused_moe_tma.gate_up(x, w13, align, cfg, out, top_k=top_k, act=act, b13=b13, alpha=alpha,
                                     limit=limit, launch=launch)
    num_n = cdiv(inter, bn)
    _moe_gate_up_kernel[(num_m * num_n,)](
        x, w13, w13_scale if w13_scale is not None else x, b13 if b13 is not None else x, out, sorted_ids, expert_ids,
        num_post, num_pairs, num_m, inter, hidden, float(alpha), float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), *(w13_scale.stride()[:2] if w13_scale is not None else (0, 0)),
        b13.stride(0) if b13 is not None else 0, out.stride(0),
        TOP_K=top_k, ACT=act, W_INT8=int8, W_MXFP4=mxfp4,
        HAS_BIAS=b13 is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_N=num_n, EVEN_K=hidden % bk == 0, **launch)
    return out


def down(h, w2, topk_weights, align, cfg: dict, *, b2=None, w2_scale=None) -> torch.Tensor:
    """The down grouped GEMM, routing weight in the epilogue: h [T*A, I] (pair rows) -> [T*A, H]."""
    bm, bn, bk, gm, launch = _launch_args(cfg)
    sorted_ids, expert_ids, num_post = align
    num_pairs, inter = h.shape
    hidden = w2.shape[1]
    num_m = expert_ids.shape[0]
    mxfp4 = w2.dtype == torch.uint8  # MXFP4 blocks; w2_scale their E8M0 scales
    if mxfp4 and (w2_scale is None or bk < 32 or bk & (bk - 1)):
        raise ValueError(f"MXFP4 weights need their scales and BLOCK_K a power of two >= 32, got BLOCK_K {bk}")
    int8 = w2_scale is not None and not mxfp4
    out = torch.empty(num_pairs, hidden, dtype=h.dtype, device=h.device)
    weights = topk_weights.reshape(-1).contiguous()
    if uses_tma(cfg):
        from loraplex.kernels import fused_moe_tma  # imports this module
        return fused_moe_tma.down(h, w2, weights, align, cfg, out, b2=b2, launch=launch)
    num_n = cdiv(hidden, bn)
    _moe_down_kernel[(num_m * num_n,)](
        h, w2, w2_scale if w2_scale is not None else h, b2 if b2 is not None else h, weights, out, sorted_ids,
        expert_ids, num_post, num_pairs, num_m, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), *(w2_scale.stride()[:2] if w2_scale is not None else (0, 0)),
        b2.stride(0) if b2 is not None else 0, out.stride(0),
        W_INT8=int8, W_MXFP4=mxfp4, HAS_BIAS=b2 is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_N=num_n, EVEN_K=inter % bk == 0, **launch)
    return out


def run_moe(x, w13, w2, topk_weights, topk_ids, *, activation, b13, b2, alpha, limit, w13_scale=None,
            w2_scale=None, config: dict | None = None, op: str = "fused_moe") -> torch.Tensor:
    """Every fused MoE launcher ends here (``w*_scale`` given: INT8 weights, or MXFP4 for uint8 ones)."""
    check_moe(x, w13, w2, topk_weights, topk_ids, activation)
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(x)
    cfg = moe_config(op, x, w13, topk_ids, config)
    align = moe_align(topk_ids, w13.shape[0], int(cfg["BLOCK_M"]))
    h = gate_up(x, w13, align, cfg, top_k=top_k, activation=activation, b13=b13, w13_scale=w13_scale, alpha=alpha,
                limit=limit)
    out = down(h, w2, topk_weights, align, cfg, b2=b2, w2_scale=w2_scale)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, activation="silu", b13=None, b2=None, alpha=1.702, limit=7.0,
              config: dict | None = None) -> torch.Tensor:
    """Same contract as ``reference.fused_moe``; ``config`` overrides the tuned config (the tuner)."""
    return run_moe(x, w13, w2, topk_weights, topk_ids, activation=activation, b13=b13, b2=b2, alpha=alpha,
                   limit=limit, config=config)
