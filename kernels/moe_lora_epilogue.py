"""Expert LoRA with its expands in the base expert GEMMs' epilogues (the other body of ``moe_experts_lora``).

    moe_align (base BLOCK_M), moe_align_lora (LoRA BLOCK_M)      made by moe_experts_lora, as for its other path
    shrink1  s1 [P, T*A, R] fp32 = scaling[l] * x[t] @ A13[l, e].T          (fused_moe_lora.moe_lora_shrink)
    gate_up GEMM; epilogue: (* INT8 scale) + b13 + s1[p] @ B13[l, e].T, act(gate) * up ─> h [T*A, I]
    shrink2  s2 = scaling[l] * h[p] @ A2[l, e].T
    down GEMM;    epilogue: (* INT8 scale) + b2 + s2[p] @ B2[l, e].T, * routing weight ─> out [T*A, H]
    sum over A (the caller)

Against the other composition this drops both expand launches, the activation launch and the [T*A, 2I]
pre-activation round trip: at decode the base GEMMs sit at the HBM roofline and the B tiles they now also read
are about 2.5% of the expert bytes. The delta is added in fp32 to the accumulator, after the INT8 scale (which
applies to the base product only) and the bias, before the activation / routing weight, as in
``reference_lora.moe_experts_lora``. Rows of one GEMM block share an expert, not an adapter: the epilogue
runs one small tensor-core dot per distinct adapter slot of the block (``fused_moe._lora_delta``), so each
slot's B tile is read once per block and rows of tokens without an adapter load nothing. (A per-row gather of
B as a [BLOCK_M, BLOCK_N, R-chunk] product needs ~30% more registers at the decode tile 16 x 64.) Launches and
allocations depend on shapes only (CUDA-graph capturable).

Chosen per call by ``enabled``: LORAPLEX_MOE_LORA_EPILOGUE=1 / 0 forces it on / off; unset, the LoRA tuning
config's key "EPILOGUE" (absent: off). The shrinks use the LoRA config of their target (BLOCK_M, BLOCK_K,
SPLIT_K, PDL; FUSED, BLOCK_N and GROUP_M do not apply); the GEMMs the base config.
"""
from __future__ import annotations

import os

import torch

from loraplex.kernels.fused_moe import LoraEpilogue, down, gate_up
from loraplex.kernels.fused_moe_lora import moe_lora_shrink

EPILOGUE_ENV = "LORAPLEX_MOE_LORA_EPILOGUE"


def enabled(lora_cfg: dict) -> bool:
    """Whether ``moe_experts_lora`` takes this path: the env var if it is "0" / "1", else ``lora_cfg["EPILOGUE"]``."""
    env = os.environ.get(EPILOGUE_ENV, "")
    if env in ("0", "1"):
        return env == "1"
    return bool(int(lora_cfg.get("EPILOGUE", 0)))


def experts_lora_epilogue(x, w13, w2, topk_weights, topk_ids, token_lora_idx, scaling, *, align, cfg, lora_align,
                          lora_cfgs: dict, w13_lora=None, w2_lora=None, activation="silu", b13=None, b2=None,
                          alpha=1.702, limit=7.0, w13_scale=None, w2_scale=None) -> torch.Tensor:
    """Per-pair routing-weighted outputs [T*A, H] (the caller sums over A), inputs as checked by
    ``moe_experts_lora``: ``align`` = moe_align at ``cfg``'s BLOCK_M, ``lora_align`` = moe_align_lora at the
    BLOCK_M of every config in ``lora_cfgs`` ({"gate_up": cfg, "down": cfg}, a target with LoRA this call
    only); ``w13_scale`` / ``w2_scale`` float32 contiguous for INT8 weights."""
    for name, pair in (("w13_lora", w13_lora), ("w2_lora", w2_lora)):
        if pair is not None and not (pair[0].is_contiguous() and pair[1].is_contiguous()):
            raise ValueError(f"{name} lora_a and lora_b must be contiguous")
    token_lora_idx = token_lora_idx.contiguous()
    top_k = topk_ids.shape[1]

    def epilogue(target: str, inp: torch.Tensor, pair) -> LoraEpilogue | None:
        if target not in lora_cfgs:
            return None
        lora_a, lora_b = pair
        buf = moe_lora_shrink(inp, lora_a, topk_ids, scaling, lora_align, lora_cfgs[target])
        return LoraEpilogue(buf, lora_b, token_lora_idx)

    h = gate_up(x, w13, align, cfg, top_k=top_k, activation=activation, b13=b13, w13_scale=w13_scale, alpha=alpha,
                limit=limit, lora=epilogue("gate_up", x, w13_lora))  # [T*A, I]
    return down(h, w2, topk_weights, align, cfg, b2=b2, w2_scale=w2_scale, lora=epilogue("down", h, w2_lora))
