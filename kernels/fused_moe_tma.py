"""``fused_moe``'s two grouped GEMMs with the expert weights read through TMA (config key ``"TMA": 1``).

Same contract, tables and epilogues as ``fused_moe.gate_up`` / ``fused_moe.down`` (bias, gated activation or the
pre-activation, routing weight), for 16- and 32-bit float weights. Each program's weight tiles come from one host
``TensorDescriptor`` over the experts' rows (w13 as [E * 2I, H], w2 as [E * H, I]; box [BLOCK_N, BLOCK_K]): the copy
engine moves a whole tile into shared memory per K step instead of every thread issuing its own loads. A box that
runs past an expert's last row reads the next expert's rows (or zeros past the tensor), which the masked store
drops; K past the end reads zeros. The activation rows (x, or h for down) are gathered through pointers as before.

Used only where a tuned config asks for it: prefill sizes, where the GEMMs are compute-bound and the pointer loads'
issue slots cost tensor-core time (docs/performance.md, "bf16 expert GEMMs at an arrival's size"). Needs the
weights' rows 16-byte aligned (K × element size a multiple of 16) and a box row of at most 128 bytes; ``check_tma``
says what is missing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from loraplex.kernels.dot import dot
from loraplex.kernels.fused_moe import _grouped_pid, gate_up_store, row_block
from loraplex.kernels.launch import cached_launch

TMA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BOX_ROW_BYTES = 128  # the widest swizzled shared-memory row one box fills


def check_tma(w: torch.Tensor, cfg: dict) -> None:
    """Raise ValueError when ``cfg`` asks for TMA on weights it cannot read that way."""
    if w.dtype not in TMA_DTYPES:
        raise ValueError(f"TMA weight loads take bf16, fp16 or fp32 expert weights, not {w.dtype} (INT8 and MXFP4 "
                         f"experts: drop the config's TMA key)")
    k, size = w.shape[-1], w.element_size()
    if (k * size) % 16 or w.data_ptr() % 16:
        raise ValueError(f"TMA weight loads need 16-byte aligned weight rows; K = {k} of {w.dtype} is not")
    if int(cfg["BLOCK_K"]) * size > MAX_BOX_ROW_BYTES:
        raise ValueError(f"TMA weight loads take BLOCK_K × element size ≤ {MAX_BOX_ROW_BYTES} bytes; BLOCK_K "
                         f"{cfg['BLOCK_K']} of {w.dtype} is {int(cfg['BLOCK_K']) * size}")


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _gate_up_tma_kernel(
    x_ptr, w_desc, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # x [T, K]; w_desc over w13 [E * 2N, K]; bias [E, 2N]; out [T*A, N] ([T*A, 2N] if ACT_NONE); tables
    num_pairs, num_m, N, K, alpha, limit, stride_xt, stride_be, stride_ot,
    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    dead, expert, pairs, row_ok = row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M, False)
    if dead:
        return
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_xt + k[None, :]
    gate_row = (expert * 2 * N + pid_n * BLOCK_N).to(tl.int32)  # descriptor coordinates are 32-bit
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(x_ptrs + k0, mask=row_ok[:, None] & ((k0 + k < K) | EVEN_K)[None, :], other=0.0)
        acc_g += dot(xt, w_desc.load([gate_row, k0]).T)
        acc_u += dot(xt, w_desc.load([gate_row + N, k0]).T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_up_store(acc_g, acc_u, bias_ptr, out_ptr, expert, pairs, row_ok, cols, cols < N, N, alpha, limit, stride_be,
                  stride_ot, ACT, HAS_BIAS)


@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _down_tma_kernel(
    h_ptr, w_desc, bias_ptr, weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # h [T*A, K]; w_desc over w2 [E * N, K]; bias [E, N]; topk_weights [T*A]; out [T*A, N]; tables
    num_pairs, num_m, N, K, stride_ht, stride_be, stride_ot,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    dead, expert, pairs, row_ok = row_block(pid_m, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, BLOCK_M, False)
    if dead:
        return
    pairs64 = pairs.to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs64[:, None] * stride_ht + k[None, :]
    w_row = (expert * N + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ht = tl.load(h_ptrs + k0, mask=row_ok[:, None] & ((k0 + k < K) | EVEN_K)[None, :], other=0.0)
        acc += dot(ht, w_desc.load([w_row, k0]).T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs64, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs64[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _descriptor(w: torch.Tensor, cfg: dict) -> TensorDescriptor:
    check_tma(w, cfg)
    rows = w.shape[0] * w.shape[1]
    return TensorDescriptor.from_tensor(w.view(rows, w.shape[2]), [int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])])


def gate_up(x, w13, align, cfg: dict, out: torch.Tensor, *, top_k: int, act: int, b13=None, alpha: float,
            limit: float, launch: dict) -> torch.Tensor:
    """``fused_moe.gate_up`` for a TMA config: writes ``out`` ([T*A, I], or [T*A, 2I] for ACT_NONE)."""
    sorted_ids, expert_ids, num_post = align
    inter = w13.shape[1] // 2
    bm, bn = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
    num_m, num_n = expert_ids.shape[0], triton.cdiv(inter, bn)
    _gate_up_tma_kernel[(num_m * num_n,)](
        x, _descriptor(w13, cfg), b13 if b13 is not None else x, out, sorted_ids, expert_ids, num_post,
        x.shape[0] * top_k, num_m, inter, x.shape[1], float(alpha), float(limit), x.stride(0),
        b13.stride(0) if b13 is not None else 0, out.stride(0),
        TOP_K=top_k, ACT=act, HAS_BIAS=b13 is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=int(cfg["BLOCK_K"]),
        GROUP_M=int(cfg["GROUP_M"]), NUM_N=num_n, EVEN_K=x.shape[1] % int(cfg["BLOCK_K"]) == 0, **launch)
    return out


def down(h, w2, weights, align, cfg: dict, out: torch.Tensor, *, b2=None, launch: dict) -> torch.Tensor:
    """``fused_moe.down`` for a TMA config: writes ``out`` [T*A, H] (``weights``: the routing weights, flat)."""
    sorted_ids, expert_ids, num_post = align
    hidden = w2.shape[1]
    bm, bn = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
    num_m, num_n = expert_ids.shape[0], triton.cdiv(hidden, bn)
    _down_tma_kernel[(num_m * num_n,)](
        h, _descriptor(w2, cfg), b2 if b2 is not None else h, weights, out, sorted_ids, expert_ids, num_post,
        h.shape[0], num_m, hidden, h.shape[1], h.stride(0), b2.stride(0) if b2 is not None else 0, out.stride(0),
        HAS_BIAS=b2 is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=int(cfg["BLOCK_K"]), GROUP_M=int(cfg["GROUP_M"]),
        NUM_N=num_n, EVEN_K=h.shape[1] % int(cfg["BLOCK_K"]) == 0, **launch)
    return out
