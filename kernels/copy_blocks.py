"""Copy-on-write block copies of one step, for every layer's K and V cache, in one Triton launch.

The caches are reached through a table of base addresses (one per layer and K/V), so the layers need not
share storage. Grid: (copy pairs, 2 * layers, chunks of one block).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.intmath import cdiv, next_power_of_2
from loraplex.kernels.launch import cached_launch

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
              torch.uint8: tl.uint8, torch.int8: tl.int8}


@cached_launch
@triton.jit
def _copy_blocks_kernel(
    cache_ptrs, mapping_ptr,  # [2 * layers] int64 base addresses; block_mapping [N, 2]
    block_numel,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + pair * 2).to(tl.int64)
    dst = tl.load(mapping_ptr + pair * 2 + 1).to(tl.int64)
    base = tl.load(cache_ptrs + cache).to(tl.pointer_type(DTYPE))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    vals = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, vals, mask=mask)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Same contract as ``reference.copy_blocks`` (in place). Caches [NB, BS, KV, D], contiguous, one dtype."""
    if block_mapping.numel() == 0 or not k_caches:
        return
    caches = [c for pair in zip(k_caches, v_caches) for c in pair]
    shape, dtype = caches[0].shape, caches[0].dtype
    for c in caches:
        if c.shape != shape or c.dtype != dtype or not c.is_contiguous():
            raise ValueError("copy_blocks needs contiguous caches of one shape and dtype across layers")
    if dtype not in _TL_DTYPES:
        raise ValueError(f"copy_blocks does not support cache dtype {dtype}")
    mapping = block_mapping.to(device=caches[0].device, dtype=torch.int64).contiguous()
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [N, 2] (src, dst), got {tuple(block_mapping.shape)}")
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=caches[0].device)
    block_numel = caches[0][0].numel()
    block = min(2048, next_power_of_2(block_numel))
    grid = (mapping.shape[0], len(caches), cdiv(block_numel, block))
    _copy_blocks_kernel[grid](ptrs, mapping, block_numel, DTYPE=_TL_DTYPES[dtype], BLOCK=block, num_warps=4)
