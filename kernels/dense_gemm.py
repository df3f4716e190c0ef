"""Dense projections of few rows (decode steps) in Triton: y = x @ w.T (+ bias), 16-bit, x [M, K], w [N, K].

At decode sizes a projection is a read of its weight: M = 16 rows against a 2880 x 5120 weight is 29 MB of bytes
for 0.5 GFLOP. Each program owns a BLOCK_M x BLOCK_N tile of y over one of SPLIT_K slices of K, so even N = 2880
fills the SMs with narrow column tiles and several K slices each keep loads in flight. With SPLIT_K > 1 every slice
stores its fp32 partial tile in a workspace and bumps the tile's arrival counter (after a CTA barrier, with release
semantics); the slice that arrives last adds the others' partials (read from L2), the bias, stores y and sets the
counter back to 0. One launch, no zeroing pass, and CUDA-graph safe: the workspace and counters persist per device
and are only ever grown (earlier buffers stay alive for graphs captured on them). Launches on one device must be
stream-ordered (the engine runs its forward on one stream).

``linear`` runs the kernel only where the device's tuning folder has a ``dense_gemm`` entry for the shape (N, K)
and M <= MAX_M (``loraplex tune`` or ``benchmarks/kernels/dense_linear_gpu.py --tune`` write the fastest config per
M, with ``"CUBLAS": 1`` where cuBLAS was faster); everywhere else, and for float32, it is ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.dot import dot
from loraplex.kernels.intmath import cdiv
from loraplex.kernels.launch import cached_launch

OP = "dense_gemm"
MAX_M = 64  # rows; larger steps are compute-bound enough for cuBLAS
DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 4}


@cached_launch
@triton.jit(do_not_specialize=["M"])
def _dense_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
    # x [M, K]; w [N, K]; b [N]; y [M, N]; part [SPLIT_K, tiles, BLOCK_M, BLOCK_N] fp32; count [tiles] int32
    M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile // num_n
    pid_n = tile % num_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_start + k)[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_start + k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:  # every K slice is whole BLOCK_K steps
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + k) < k_end
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot(xt, wt)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    y_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        num_tiles = tl.num_programs(0)
        inner = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_base = tile.to(tl.int64) * (BLOCK_M * BLOCK_N)
        split_stride = num_tiles.to(tl.int64) * (BLOCK_M * BLOCK_N)
        tl.store(part_ptr + pid_k * split_stride + tile_base + inner, acc)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last slice of this tile: sum, bias, store, reset
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * split_stride + tile_base + inner, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(count_ptr + tile, 0)


class _Workspace:
    """Per-device split-K partials and tile counters, grown on demand and never freed (graphs keep pointers)."""

    def __init__(self) -> None:
        self.parts: dict[torch.device, torch.Tensor] = {}
        self.counts: dict[torch.device, torch.Tensor] = {}
        self._kept: list[torch.Tensor] = []

    def get(self, device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, count = self.parts.get(device), self.counts.get(device)
        if part is None or part.numel() < part_elems:
            part = torch.empty(max(part_elems, 2 * (part.numel() if part is not None else 0)), dtype=torch.float32,
                               device=device)
            self._kept.append(part)
            self.parts[device] = part
        if count is None or count.numel() < tiles:
            count = torch.zeros(max(tiles, 2 * (count.numel() if count is not None else 0)), dtype=torch.int32,
                                device=device)
            self._kept.append(count)
            self.counts[device] = count
        return part, count


_WORKSPACE = _Workspace()


def shape_of(n: int, k: int) -> dict[str, int]:
    """The tuning-file shape key of a projection: output and input features."""
    return {"N": int(n), "K": int(k)}


def tuned_config(m: int, n: int, k: int) -> dict | None:
    """The device's tuned ``dense_gemm`` config for (N, K) nearest to ``m`` rows, or None (``linear`` uses cuBLAS)."""
    return tuning.find_config(OP, shape_of(n, k), m, DEFAULT_CONFIG)


def dense_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias) through the kernel, whatever M (tests and the benchmark call it directly). x [M, K]
    with unit stride along K; w [N, K] contiguous; bias [N] or None."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not make x @ w.T")
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    block_m, block_n, block_k = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    split = max(1, int(cfg["SPLIT_K"]))
    # each K slice a whole number of BLOCK_K steps, and no slice empty
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per_split)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    if split > 1:
        part, count = _WORKSPACE.get(x.device, split * tiles * block_m * block_n, tiles)
    else:
        part = count = y  # unused
    _dense_gemm_kernel[(tiles, split)](
        x, w, bias if bias is not None else y, y, part, count,
        m, n, k, k_per_split, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        EVEN_K=k % block_k == 0, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
    )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the kernel where it is tuned to be faster (module docstring)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or weight.dim() != 2:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_M or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    cfg = tuned_config(rows, weight.shape[0], weight.shape[1])
    if cfg is None or cfg.get("CUBLAS"):  # untuned, or tuned to cuBLAS at this M
        return F.linear(x, weight, bias)
    y = dense_gemm(x.reshape(rows, x.shape[-1]), weight, bias, cfg)
    return y.view(*x.shape[:-1], weight.shape[0])
