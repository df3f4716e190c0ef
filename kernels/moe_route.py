"""Fused MoE top-k routing in Triton: one program per token, the whole expert row in registers (E <= 256).

    scoring="softmax"       probs = softmax(logits) over all E; top-k of probs; optionally / sum of the k
                            (Mixtral, Qwen3-MoE)
    scoring="topk_softmax"  top-k of the logits; softmax over those k values (GPT-OSS)

Top-k is k rounds of argmax, highest first (the order ``torch.topk`` returns). Ties go to the lowest expert
index; ``torch.topk`` leaves tie order unspecified, so exactly tied logits may list their ids in another order
than the reference. Logits are assumed finite. No host sync: CUDA-graph capturable.

``moe_route_linear`` also computes the router logits (x @ w.T + b) in the same program, for decode-sized steps:
one launch per MoE layer instead of a cuBLAS GEMM of E = 32 columns (a fixed ~6 µs on Hopper) and this kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch

MAX_EXPERTS = 256
LINEAR_MAX_TOKENS = 128  # moe_route_linear: its own kernel up to this many tokens; cuBLAS + moe_route above
TARGET_PROGRAMS = 264  # moe_route_linear: (token, K slice) programs to aim for, two per SM of an H100 / H200
MAX_SPLIT_K = 16
SCORINGS = ("softmax", "topk_softmax")


@triton.jit
def _route_row(score, valid, experts, row, weights_ptr, ids_ptr, stride_wt, stride_it,
               TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr):
    """Score, pick and store one token's top-k from its float32 logits ``score`` [BLOCK_E] (padding lanes -inf)."""
    # ---- softmax over all experts (padding lanes: exp(-inf) = 0)
    if SOFTMAX_FIRST:
        score = tl.exp(score - tl.max(score, axis=0))
        score = score / tl.sum(score, axis=0)
        score = tl.where(valid, score, float("-inf"))
    # ---- top-k by repeated argmax: highest first, lowest expert index on ties
    slots = tl.arange(0, BLOCK_A)
    top_val = tl.zeros([BLOCK_A], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_A], dtype=tl.int64)
    for a in tl.static_range(TOP_K):
        best = tl.max(score, axis=0)
        best_id = tl.min(tl.where((score == best) & valid, experts, BLOCK_E), axis=0)
        top_val = tl.where(slots == a, best, top_val)
        top_id = tl.where(slots == a, best_id.to(tl.int64), top_id)
        score = tl.where(experts == best_id, float("-inf"), score)
    in_k = slots < TOP_K
    # ---- weights of the k picks
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            top_val = top_val / tl.sum(tl.where(in_k, top_val, 0.0), axis=0)
    else:
        top_val = tl.where(in_k, tl.exp(top_val - tl.max(tl.where(in_k, top_val, float("-inf")), axis=0)), 0.0)
        top_val = top_val / tl.sum(top_val, axis=0)
    tl.store(weights_ptr + row * stride_wt + slots, top_val, mask=in_k)
    tl.store(ids_ptr + row * stride_it + slots, top_id, mask=in_k)


@cached_launch
@triton.jit
def _moe_route_kernel(
    logits_ptr, weights_ptr, ids_ptr,  # logits [T, E] (any float dtype); weights [T, A] float32; ids [T, A] int64
    E, stride_lt, stride_wt, stride_it,
    TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    score = tl.load(logits_ptr + row * stride_lt + experts, mask=valid, other=float("-inf")).to(tl.float32)
    _route_row(score, valid, experts, row, weights_ptr, ids_ptr, stride_wt, stride_it,
               TOP_K, SOFTMAX_FIRST, RENORMALIZE, BLOCK_E, BLOCK_A)


@cached_launch
@triton.jit(do_not_specialize=["K_PER_SPLIT"])
def _moe_route_linear_kernel(
    x_ptr, w_ptr, b_ptr, weights_ptr, ids_ptr, part_ptr, count_ptr,
    # x [T, K]; router w [E, K]; b [E]; weights [T, A] f32; ids [T, A] i64; part [T, SPLIT_K, BLOCK_E] f32; count [T]
    E, K, K_PER_SPLIT, stride_xt, stride_we, stride_wt, stride_it,
    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    k = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + k) < k_end
        xk = tl.load(x_ptr + row * stride_xt + k0 + k, mask=k_ok, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + experts[:, None].to(tl.int64) * stride_we + (k0 + k)[None, :],
                     mask=valid[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += wt * xk[None, :]
    logits = tl.sum(acc, axis=1)
    last = True
    if SPLIT_K > 1:  # every slice leaves its partial sums; the token's last slice to arrive routes
        part = part_ptr + row * (SPLIT_K * BLOCK_E)
        tl.store(part + split * BLOCK_E + experts, logits)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        last = tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            logits = tl.zeros([BLOCK_E], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                logits += tl.load(part + s * BLOCK_E + experts, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + row, 0)
    if last:
        if HAS_BIAS:
            logits += tl.load(b_ptr + experts, mask=valid, other=0.0).to(tl.float32)
        # rounded once to the activations' dtype, as F.linear's output that moe_route reads
        logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
        score = tl.where(valid, logits, float("-inf"))
        _route_row(score, valid, experts, row, weights_ptr, ids_ptr, stride_wt, stride_it,
                   TOP_K, SOFTMAX_FIRST, RENORMALIZE, BLOCK_E, BLOCK_A)


class _Workspace:
    """Per-device partial logits and per-token arrival counters of the split router, grown on demand and never
    freed (CUDA graphs keep the pointers they were captured with); counters are back at 0 after every launch."""

    def __init__(self) -> None:
        self.parts: dict[torch.device, torch.Tensor] = {}
        self.counts: dict[torch.device, torch.Tensor] = {}
        self._kept: list[torch.Tensor] = []

    def get(self, device: torch.device, part_elems: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, count = self.parts.get(device), self.counts.get(device)
        if part is None or part.numel() < part_elems:
            part = torch.empty(max(part_elems, 2 * (part.numel() if part is not None else 0)), dtype=torch.float32,
                               device=device)
            self._kept.append(part)
            self.parts[device] = part
        if count is None or count.numel() < tokens:
            count = torch.zeros(max(tokens, 2 * (count.numel() if count is not None else 0)), dtype=torch.int32,
                                device=device)
            self._kept.append(count)
            self.counts[device] = count
        return part, count


_WORKSPACE = _Workspace()


def linear_split_k(num_tokens: int, k_in: int, block_k: int, target_programs: int = TARGET_PROGRAMS) -> int:
    """K slices per token: enough programs for about ``target_programs`` (two per SM of an H100 / H200), each slice
    at least one BLOCK_K step, at most MAX_SPLIT_K."""
    return max(1, min(MAX_SPLIT_K, cdiv(k_in, block_k), cdiv(target_programs, max(num_tokens, 1))))


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.moe_route``: router_logits [T, E] (E <= 256) -> (topk_weights [T, A] float32,
    topk_ids [T, A] int64). ``renormalize`` only applies to scoring="softmax" (topk_softmax sums to 1)."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown MoE scoring {scoring!r}")
    if router_logits.dim() != 2:
        raise ValueError(f"moe_route expects router_logits [T, E], got {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"moe_route needs 1 <= top_k <= E <= {MAX_EXPERTS}, got top_k={top_k}, E={num_experts}")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        block_e = next_power_of_2(num_experts)
        _moe_route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), weights.stride(0), ids.stride(0),
            TOP_K=top_k, SOFTMAX_FIRST=scoring == "softmax", RENORMALIZE=renormalize,
            BLOCK_E=block_e, BLOCK_A=next_power_of_2(top_k), num_warps=1 if block_e <= 64 else 2,
        )
    return weights, ids


def moe_route_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, *, scoring: str,
                     renormalize: bool, split_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_route(F.linear(x, weight, bias), ...)`` (``reference.moe_route_linear``). Up to LINEAR_MAX_TOKENS
    tokens one launch of (token, K slice) programs: each sums its slice of the token's router logits in fp32; the
    slice that arrives last adds the others' sums and the bias, rounds the logits once to x's dtype (as
    ``F.linear``'s output is) and routes them. The router weight (E x K, 184 KB for GPT-OSS-20B) is read from L2 by
    all but the first token's programs. ``split_k``: K slices per token (default ``linear_split_k``). Larger steps
    run cuBLAS then ``moe_route``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"moe_route_linear: x {tuple(x.shape)} and router weight {tuple(weight.shape)} do not make "
                         f"x @ w.T")
    num_tokens, k_in = x.shape
    num_experts = weight.shape[0]
    if num_tokens > LINEAR_MAX_TOKENS or num_experts > MAX_EXPERTS or weight.dtype != x.dtype \
            or (bias is not None and bias.dtype != x.dtype):
        return moe_route(F.linear(x, weight, bias), top_k, scoring=scoring, renormalize=renormalize)
    if scoring not in SCORINGS:
        raise ValueError(f"unknown MoE scoring {scoring!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_route needs 1 <= top_k <= E <= {MAX_EXPERTS}, got top_k={top_k}, E={num_experts}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    if num_tokens:
        block_e = next_power_of_2(num_experts)
        block_k = max(16, min(128, 4096 // block_e))
        split = split_k if split_k is not None else linear_split_k(num_tokens, k_in, block_k)
        k_per_split = cdiv(cdiv(k_in, split), block_k) * block_k  # whole BLOCK_K steps per slice
        split = cdiv(k_in, k_per_split)  # no empty slice
        if split > 1:
            part, count = _WORKSPACE.get(x.device, num_tokens * split * block_e, num_tokens)
        else:
            part = count = weights  # unused
        _moe_route_linear_kernel[(num_tokens, split)](
            x, weight, bias if bias is not None else x, weights, ids, part, count, num_experts, k_in, k_per_split,
            x.stride(0), weight.stride(0), weights.stride(0), ids.stride(0),
            HAS_BIAS=bias is not None, TOP_K=top_k, SOFTMAX_FIRST=scoring == "softmax", RENORMALIZE=renormalize,
            BLOCK_E=block_e, BLOCK_A=next_power_of_2(top_k), BLOCK_K=block_k, SPLIT_K=split, num_warps=4,
        )
    return weights, ids
