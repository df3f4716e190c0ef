"""Fused MoE top-k routing in Triton: one program per token, the whole expert row in registers (E <= 256).

    scoring="softmax"       probs = softmax(logits) over all E; top-k of probs; optionally / sum of the k
                            (Mixtral, Qwen3-MoE)
    scoring="topk_softmax"  top-k of the logits; softmax over those k values (GPT-OSS)

Top-k is k rounds of argmax, highest first (the order ``torch.topk`` returns). Ties go to the lowest expert
index; ``torch.topk`` leaves tie order unspecified, so exactly tied logits may list their ids in another order
than the reference. Logits are assumed finite. No host sync: CUDA-graph capturable. On sm_90+ a PDL launch
(``slot_blocks.step_pdl``), its launch overlapping the kernel that writes the logits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.slot_blocks import pdl_launch, pdl_trigger, pdl_wait, step_pdl

MAX_EXPERTS = 256
SCORINGS = ("softmax", "topk_softmax")


@cached_launch
@triton.jit
def _moe_route_kernel(
    logits_ptr, weights_ptr, ids_ptr,  # logits [T, E] (any float dtype); weights [T, A] float32; ids [T, A] int64
    E, stride_lt, stride_wt, stride_it,
    TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    score = tl.load(logits_ptr + row * stride_lt + experts, mask=valid, other=float("-inf")).to(tl.float32)
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
        pdl = step_pdl(router_logits.device)
        _moe_route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), weights.stride(0), ids.stride(0),
            TOP_K=top_k, SOFTMAX_FIRST=scoring == "softmax", RENORMALIZE=renormalize,
            BLOCK_E=block_e, BLOCK_A=next_power_of_2(top_k), USE_PDL=pdl, num_warps=1 if block_e <= 64 else 2,
            **pdl_launch(pdl),
        )
    return weights, ids
