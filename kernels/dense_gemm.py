"""Dense projections of a decode step in Triton: y = x @ w.T (+ bias), 16-bit, x [M, K] with M <= MAX_M, w [N, K].

At decode a projection is a read of its weight (GPT-OSS-20B's q/k/v: 29.5 MB for 16 rows), and a GEMM library's
kernel starts that read only once the kernel before it (a norm, the attention) has finished and it has been
launched. Here the projection is a PDL launch (sm_90+, ``slot_blocks.step_pdl``): each program, before it waits for
the kernel before it, issues one bulk L2 prefetch (``cp.async.bulk.prefetch.L2``) per weight row of its column
tile and loads its bias, so the weight stream starts while that kernel still runs; after the wait it reads x and
runs its K loop over rows already in (or on their way to) L2, then adds the bias. One program per BLOCK_N output
columns and BLOCK_M rows, no split of K: the prefetches, not the program count, keep the memory busy.

``linear`` runs the kernel where it pays: CUDA, 16-bit, at most MAX_M rows, a weight of at most MAX_WEIGHT_BYTES
(it must fit L2 beside the rest of the step: the attention projections, not the LM head or a dense MLP), where the
step's kernels launch with PDL; ``LORAPLEX_DENSE_GEMM=0`` keeps ``F.linear`` (A/B timing). Everywhere else it is
``F.linear``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplex.kernels.dot import dot
from loraplex.kernels.intmath import cdiv
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.slot_blocks import pdl_launch, pdl_trigger, pdl_wait, step_pdl

MAX_M = 16  # decode rows; verify and prefill steps stay on cuBLAS
MAX_WEIGHT_BYTES = 32 << 20  # fits the H100's / H200's 50 MB L2 with room for the rest of the step
DENSE_GEMM_ENV = "LORAPLEX_DENSE_GEMM"
CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}  # H100 sweep, M <= 16


@triton.jit
def _prefetch_rows_l2(row_ptrs, nbytes):
    """One bulk prefetch into L2 of ``nbytes`` [BLOCK_N] (0: none) at each pointer of ``row_ptrs`` (sm_90)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [row_ptrs.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@cached_launch
@triton.jit(do_not_specialize=["M"])
def _dense_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,  # x [M, K]; w [N, K]; b [N]; y [M, N]
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_L2: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    w_rows = w_ptr + cols.to(tl.int64) * stride_wn
    # ---- before the wait: only the weight (its rows' L2 prefetch) and the bias
    if PREFETCH_L2:
        _prefetch_rows_l2(w_rows, tl.where(col_ok & (pid_m == 0), K * 2, 0))
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :]
    w_ptrs = w_rows[None, :] + k[:, None]  # w^T tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + k) < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot(xt, wt)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += bias[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def dense_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None, *,
               pdl: bool = False, prefetch_l2: bool = False) -> torch.Tensor:
    """y = x @ w.T (+ bias) through the kernel, whatever M (tests call it directly). x [M, K] with unit stride
    along K; w [N, K] contiguous; bias [N] or None; ``pdl`` / ``prefetch_l2``: as ``linear`` launches it (sm_90)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not make x @ w.T")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"dense_gemm: bias {tuple(bias.shape)} for {w.shape[0]} outputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    cfg = {**CONFIG, **(config or {})}
    block_m, block_n, block_k = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    _dense_gemm_kernel[(cdiv(n, block_n), cdiv(m, block_m))](
        x, w, bias if bias is not None else y, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        USE_PDL=pdl, PREFETCH_L2=prefetch_l2, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
        **pdl_launch(pdl),
    )
    return y


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the operands are what the kernel is for: 16-bit, at most MAX_M rows, a contiguous weight of at most
    MAX_WEIGHT_BYTES whose rows a bulk prefetch can take (16-byte aligned, a multiple of 16 bytes)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or weight.dim() != 2:
        return False
    if not weight.is_contiguous() or (bias is not None and bias.dtype != x.dtype):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_M or weight.numel() * weight.element_size() > MAX_WEIGHT_BYTES:
        return False
    return weight.data_ptr() % 16 == 0 and (weight.shape[1] * weight.element_size()) % 16 == 0


def use_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear`` runs the kernel (module docstring): ``fits``, on a device whose step kernels launch with
    PDL (sm_90+), unless ``LORAPLEX_DENSE_GEMM=0``."""
    return fits(x, weight, bias) and os.environ.get(DENSE_GEMM_ENV, "1") != "0" and step_pdl(x.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (x [..., K], weight [N, K], bias [N]), through the kernel where ``use_kernel`` says so."""
    if not use_kernel(x, weight, bias):
        return F.linear(x, weight, bias)
    y = dense_gemm(x.reshape(-1, x.shape[-1]), weight, bias, pdl=True, prefetch_l2=True)
    return y.view(*x.shape[:-1], weight.shape[0])
