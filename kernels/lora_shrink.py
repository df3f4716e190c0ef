"""LoRA shrink in Triton: buf[s, t] = scaling[l] * x[t] @ lora_a[s, l].T for tokens grouped by adapter.

Tokens are grouped by adapter slot on the device (a counting sort, no host sync); grid (token blocks of all
slots together, slices * SPLIT_K), each program finding its slot from the segment lengths (``slot_blocks``),
so tokens without an adapter and idle slots launch nothing. Split-K programs add their partial sums with relaxed
atomics into a zeroed fp32 buffer. The token count is not a compile-time constant: one compile serves every
batch size and context length.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels import tuning
from loraplex.kernels.dot import dot
from loraplex.kernels.slot_blocks import flat_blocks, slot_block

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}


def split_k_for(k: int, block_k: int) -> int:
    """Split-K for a shape without a tuned entry: a rank-R shrink has few (token block, slot) programs, so the
    K loop is split until each split walks about 4 BLOCK_K tiles (at most 16 splits). K = 2880 on the H200:
    32.7 us with SPLIT_K = 1, 5.2 us tuned with SPLIT_K = 16 (docs/performance.md)."""
    return max(1, min(16, -(-k // (4 * block_k))))


def default_config(k: int) -> dict:
    """DEFAULT_CONFIG with split-K sized for K (used when the tuning file has no entry for the shape)."""
    cfg = dict(DEFAULT_CONFIG)
    cfg["SPLIT_K"] = split_k_for(k, cfg["BLOCK_K"])
    if cfg["SPLIT_K"] > 1:
        cfg.update(num_warps=2, num_stages=3)
    return cfg


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, scaling_ptr,
    # x [T, K]; lora_a [S, L, R, K]; buf [S, T, R] fp32; order [T] tokens sorted by slot; seg_* [L]; scaling [L]
    K, R, L,
    stride_xt, stride_as, stride_al, stride_ar, stride_bs, stride_bt,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_L: tl.constexpr,
):
    lora, pid_m, past = slot_block(tl.program_id(0), seg_len_ptr, L, BLOCK_M, BLOCK_L, False)
    pid_z = tl.program_id(1)
    if past:  # past the token blocks the slots use
        return
    count = tl.load(seg_len_ptr + lora)
    sl = pid_z // SPLIT_K
    pid_k = pid_z % SPLIT_K
    start = tl.load(seg_start_ptr + lora)
    idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = idx < count
    tok = tl.load(order_ptr + start + idx, mask=row_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + k[None, :]
    a_ptrs = a_ptr + sl * stride_as + lora.to(tl.int64) * stride_al + r[None, :] * stride_ar + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    # ---- K loop (this split's share)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot(xt, at.to(xt.dtype))
        x_ptrs += BLOCK_K * SPLIT_K
        a_ptrs += BLOCK_K * SPLIT_K
    acc *= tl.load(scaling_ptr + lora).to(tl.float32)
    # ---- write (split-K: relaxed atomic adds into the zeroed buffer)
    out_ptrs = buf_ptr + sl * stride_bs + tok[:, None] * stride_bt + r[None, :]
    out_mask = row_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


def lora_segments(token_lora_idx: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens grouped by adapter slot, on the device: (order [T] int32, seg_start [L] int32, seg_len [L] int32).

    Slot l's tokens are order[seg_start[l] : seg_start[l] + seg_len[l]] in token order; tokens without an
    adapter (-1) are in no segment. One small Triton launch (moe_align's counting sort; no radix sort).
    The engine should compute it once per step and pass it to every layer's shrink and expand (``segments=``).
    """
    from loraplex.kernels.moe_align import group_by_slot

    return group_by_slot(token_lora_idx, max_loras)


def shape_of(x: torch.Tensor, lora_a: torch.Tensor) -> dict[str, int]:
    """Tuning-file shape key dims."""
    s, l, r, k = lora_a.shape
    return {"S": s, "L": l, "R": r, "K": k}


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora_idx: torch.Tensor, scaling: torch.Tensor, *,
                config: dict | None = None,
                segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same contract as ``reference_lora.lora_shrink``; ``config`` overrides the tuned config (the tuner),
    ``segments`` reuses a ``lora_segments`` result of the step."""
    num_tokens, in_features = x.shape
    num_slices, max_loras, rank, k_a = lora_a.shape
    if k_a != in_features:
        raise ValueError(f"lora_a has K={k_a} but x has {in_features} features")
    if token_lora_idx.shape != (num_tokens,) or scaling.shape != (max_loras,):
        raise ValueError(f"token_lora_idx must be [T={num_tokens}] and scaling [L={max_loras}], got "
                         f"{tuple(token_lora_idx.shape)} and {tuple(scaling.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not lora_a.is_contiguous():
        raise ValueError("lora_a must be contiguous [S, L, R, K]")
    cfg = config or tuning.get_config("lora_shrink", shape_of(x, lora_a), num_tokens,
                                      default_config(in_features))
    split_k = int(cfg["SPLIT_K"])
    alloc = torch.zeros if split_k > 1 else torch.empty
    buf = alloc(num_slices, num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return buf
    if split_k == 1:
        buf.zero_()  # rows of tokens without an adapter stay zero
    order, seg_start, seg_len = segments or lora_segments(token_lora_idx, max_loras)
    block_m, block_k = int(cfg["BLOCK_M"]), int(cfg["BLOCK_K"])
    grid = (flat_blocks(num_tokens, max_loras, block_m), num_slices * split_k)
    _lora_shrink_kernel[grid](
        x, lora_a, buf, order, seg_start, seg_len, scaling, in_features, rank, max_loras,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), buf.stride(0), buf.stride(1),
        BLOCK_M=block_m, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_K=in_features % (block_k * split_k) == 0, BLOCK_L=triton.next_power_of_2(max_loras),
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
    )
    return buf
