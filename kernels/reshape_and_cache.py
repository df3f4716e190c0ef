"""Write a step's new K/V rows into the paged caches in one Triton launch (one program per token)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import next_power_of_2
from loraplex.kernels.launch import cached_launch


@cached_launch
@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,  # key/value [T, KV, D]; caches [NB, BS, KV, D]; slots [T]
    stride_kt, stride_vt, stride_kc_slot, stride_vc_slot,
    ROW: tl.constexpr,  # KV * D (rows of one token are contiguous)
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    for start in range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + tok * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + offs, mask=mask)
        tl.store(kc_ptr + slot * stride_kc_slot + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * stride_vc_slot + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Same contract as ``reference.reshape_and_cache`` (in place)."""
    num_tokens, num_kv, head_dim = key.shape
    if k_cache.shape[2:] != (num_kv, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold [*, *, {num_kv}, "
                         f"{head_dim}] rows")
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} rows must be contiguous per token ([T, KV, D] with D and KV dense)")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if num_tokens == 0:
        return
    row = num_kv * head_dim
    block = min(1024, next_power_of_2(row))
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), value.stride(0), row, row, ROW=row, BLOCK=block, num_warps=4)
