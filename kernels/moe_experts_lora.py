"""The fused expert path with multi-LoRA in Triton: no per-expert loop, no host sync, allocations that depend
on shapes only, so a CUDA graph can capture it (same contract as ``reference_lora.moe_experts_lora``).

    moe_align_pair: moe_align (base BLOCK_M) and moe_align_lora (LoRA BLOCK_M, shared by both LoRA calls), one launch
                                 gate_up GEMM + bias (+ INT8 / MXFP4 dequant) ─> pre [T*A, 2I]  (pre-activation)
                                 fused_moe_lora(pre, x, A13, B13)                   (delta added in place)
                                 act(gate) * up ─> h [T*A, I]
                                 down GEMM + bias (+ INT8 / MXFP4 dequant), * routing weight ─> out [T*A, H]
                                 fused_moe_lora(out, h, A2, B2, topk_weights)       (routing-weighted delta)
                                 sum over A ─> [T, H]

Tokens without an adapter (token_lora_idx -1) are in no LoRA table and cost nothing in the LoRA kernels; with
``token_lora_idx`` None the op is fused_moe with the activation launched separately. The LoRA alignment is
made once, before the gate_up GEMM, with the gate_up LoRA config's BLOCK_M (the down one's if gate_up has no
LoRA); the down LoRA call runs at that BLOCK_M too (its other tuned parameters kept). MXFP4 weights in the kernel
layout (int32 words, ``mxfp4.prepare_for_kernel``) run ``fused_moe_mxfp4``'s GEMMs (its tuned config; the down
GEMM without split-K, since the down delta is added to the pair outputs; a gate_up split-K sums its partials into
the pre-activation before the gate_up delta). At decode sizes (the MXFP4 config's row blocks of at most
EPILOGUE_MAX_BLOCK_M pairs) the expands move into the MXFP4 GEMMs' epilogues instead:

    moe_lora_shrink(x, A13) ─> h13 ─> gate_up GEMM + bias + gate_up delta + activation ─> h [T*A, I]
    moe_lora_shrink(h, A2)  ─> h2  ─> down GEMM + bias + down delta, * routing weight (split-K kept) ─> sum over A

two launches fewer per target, no pre-activation round trip, and the down GEMM keeps its split-K.

With ``LORAPLEX_MOE_DOWN_DELTA=sum`` (``DOWN_DELTA_IN_SUM``) the down delta moves from the down GEMM's epilogue
into the sum over each token's pairs (``fused_moe_mxfp4.sum_pairs_lora``), so the down shrink no longer gates the
GEMM: given a ``shrink_stream`` it runs there, beside the down GEMM, and the sum joins both:

    step stream:  gate_up GEMM (+ delta, act) ─> h ──fork──> down GEMM (no LoRA) ─────join──> sum_pairs_lora
    side stream:                                   └───> moe_lora_shrink(h, A2) ─> h2 ──┘     (+ w * B2 @ h2)

With ``LORAPLEX_MOE_SHRINK_STREAM=1`` (``SHRINK_STREAM_APART``) the expands-apart path likewise runs each target's
shrink on the ``shrink_stream`` beside its base GEMM (``fused_moe_lora.moe_lora_shrink``), then the expand
(``moe_lora_expand``) after both. Both switches are off by default.
"""
from __future__ import annotations

import os

import torch

from loraplex.kernels import tuning
from loraplex.kernels import fused_moe_lora as fml
from loraplex.kernels import fused_moe_mxfp4 as fm4
from loraplex.kernels.activation import silu_and_mul, swiglu_clamp_and_mul
from loraplex.kernels.fused_moe import check_moe, down, gate_up, moe_config
from loraplex.kernels.lora_table import LoRATable
from loraplex.kernels.moe_align import moe_align, moe_align_lora, moe_align_pair
from loraplex.kernels.mxfp4 import is_kernel_layout
from loraplex.kernels.side_stream import fork, join
from loraplex.kernels.reference_lora import as_expert_table, check_int8_weights, check_mxfp4_weights


class _Shape:
    """Stands for a tensor whose shape alone a config lookup reads (looked up before the tensor exists)."""

    def __init__(self, *shape: int) -> None:
        self.shape = torch.Size(shape)


def lora_config(y, x, lora_a, topk_ids: torch.Tensor) -> dict:
    """The config ``fused_moe_lora`` would look up itself for this call (tuned file, nearest M, or default);
    ``y`` / ``x`` need only a ``shape``."""
    k = lora_a.in_features if isinstance(lora_a, LoRATable) else lora_a.shape[-1]
    return tuning.get_config("fused_moe_lora", fml.shape_of(y, x, lora_a, topk_ids), topk_ids.shape[0],
                             fml.default_config(k))


# MXFP4 kernel-layout GEMMs at row blocks up to this size (decode up to ~16 tokens) add the LoRA deltas in their
# epilogues; with larger blocks (more slots per block) the epilogue costs more than the expand launches it replaces
EPILOGUE_MAX_BLOCK_M = 8


def _down_delta_in_sum() -> bool:
    value = os.environ.get("LORAPLEX_MOE_DOWN_DELTA", "epilogue")
    if value not in ("epilogue", "sum"):
        raise ValueError(f"LORAPLEX_MOE_DOWN_DELTA must be 'epilogue' or 'sum', got {value!r}")
    return value == "sum"


# the epilogue path's down delta: in the down GEMM's epilogue (False) or in the pair sum, the down shrink beside the
# down GEMM on the caller's shrink stream (True)
DOWN_DELTA_IN_SUM = _down_delta_in_sum()
# the expands-apart path (row blocks above EPILOGUE_MAX_BLOCK_M: verify steps, prefill): each target's shrink on the
# caller's shrink stream beside its base GEMM, the expand after both (LORAPLEX_MOE_SHRINK_STREAM=1)
SHRINK_STREAM_APART = os.environ.get("LORAPLEX_MOE_SHRINK_STREAM", "0") == "1"


def _kernel_layout_epilogue(x, w13, s13, w2, s2, topk_weights, topk_ids, token_lora_idx, scaling, cfg, align, cfgs,
                            lora_align, w13_lora, w2_lora, *, activation, b13, b2, alpha, limit,
                            shrink_stream=None) -> torch.Tensor:
    """MXFP4 kernel layout at decode sizes: each target's shrink, then its GEMM adds the expand in its epilogue
    (gate_up before the activation, down before the routing weight), so neither the expand launches nor the
    activation's nor the pre-activation's round trip through memory remain; both GEMMs keep their split-K."""
    num_tokens, top_k = topk_ids.shape
    slots = token_lora_idx.contiguous()
    gu_lora = dn_lora = None
    if "gate_up" in cfgs:
        buf = fml.moe_lora_shrink(x, w13_lora, topk_ids, token_lora_idx, scaling, out_features=w13.shape[1],
                                  config=cfgs["gate_up"], align=lora_align)
        gu_lora = fm4.LoRAEpilogue(buf, w13_lora, slots)
    h = fm4.gate_up(x, w13, s13, align, cfg, top_k=top_k, activation=activation, b13=b13, alpha=alpha, limit=limit,
                    lora=gu_lora)  # [T*A, I]
    if "down" in cfgs and DOWN_DELTA_IN_SUM:
        return _down_delta_in_sum_path(h, w2, s2, topk_weights, topk_ids, token_lora_idx, scaling, cfg, align,
                                       cfgs["down"], lora_align, w2_lora, slots, x.dtype, b2=b2,
                                       shrink_stream=shrink_stream)
    if "down" in cfgs:
        buf = fml.moe_lora_shrink(h, w2_lora, topk_ids, token_lora_idx, scaling, out_features=w2.shape[1],
                                  config=cfgs["down"], align=lora_align)
        dn_lora = fm4.LoRAEpilogue(buf, w2_lora, slots)
    out = fm4.down(h, w2, s2, topk_weights, align, cfg, b2=b2, lora=dn_lora)
    return fm4.sum_pairs(out, num_tokens, top_k, x.dtype, pdl=fm4.use_pdl(cfg, x.device))


def _down_delta_in_sum_path(h, w2, s2, topk_weights, topk_ids, token_lora_idx, scaling, cfg, align, lora_cfg,
                            lora_align, w2_lora, slots, dtype, *, b2, shrink_stream) -> torch.Tensor:
    """The down GEMM without LoRA and the down shrink side by side (the shrink on ``shrink_stream`` when given),
    then ``sum_pairs_lora`` adds the partials and the routing-weighted down delta per token."""
    def shrink():
        return fml.moe_lora_shrink(h, w2_lora, topk_ids, token_lora_idx, scaling, out_features=w2.shape[1],
                                   config=lora_cfg, align=lora_align)

    buf = fork(shrink_stream, shrink) if shrink_stream is not None else shrink()
    out = fm4.down(h, w2, s2, topk_weights, align, cfg, b2=b2)
    if shrink_stream is not None:
        join(shrink_stream)
    # PDL only on one stream: the sum's other input comes through the join, not from the kernel before it
    return fm4.sum_pairs_lora(out, fm4.LoRAEpilogue(buf, w2_lora, slots), topk_ids, topk_weights, dtype,
                              pdl=shrink_stream is None and fm4.use_pdl(cfg, h.device))


def moe_experts_lora(x, w13, w2, topk_weights, topk_ids, token_lora_idx, scaling, *, w13_lora=None, w2_lora=None,
                     activation="silu", b13=None, b2=None, alpha=1.702, limit=7.0, w13_scale=None, w2_scale=None,
                     shrink_stream=None, config: dict | None = None,
                     lora_config_override: dict | None = None) -> torch.Tensor:
    """Same contract as ``reference_lora.moe_experts_lora``. ``config`` overrides the base GEMMs' tuned config,
    ``lora_config_override`` both LoRA calls' (tests and the tuner); ``shrink_stream``: a CUDA stream of the
    tensors' device that LoRA shrinks may run on beside the base GEMMs (``DOWN_DELTA_IN_SUM``,
    ``SHRINK_STREAM_APART``; None on CPUs)."""
    quantized = w13_scale is not None or w2_scale is not None
    kernel_layout = quantized and is_kernel_layout(w13)  # MXFP4 in the kernel layout (fused_moe_mxfp4's GEMMs)
    if kernel_layout:
        check_mxfp4_weights(w13, w13_scale, w2, w2_scale)
        fm4.check_kernel_weights(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation)
    else:
        check_moe(x, w13, w2, topk_weights, topk_ids, activation)
    mxfp4 = quantized and w13.dtype == torch.uint8  # MXFP4 blocks + E8M0 scales (else INT8 + per-channel scales)
    if mxfp4:
        check_mxfp4_weights(w13, w13_scale, w2, w2_scale)
        w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    elif quantized and not kernel_layout:
        check_int8_weights(w13, w13_scale, w2, w2_scale)
        w13_scale, w2_scale = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(x)
    num_experts, two_i, hidden = w13.shape[0], w13.shape[1], x.shape[1]
    num_pairs = num_tokens * top_k
    w13_lora, w2_lora = as_expert_table(w13_lora), as_expert_table(w2_lora)  # LoRATables (stacked pairs accepted)
    if kernel_layout:
        cfg = fm4.kernel_config(x, w13, topk_ids, config)
    else:
        op = "fused_moe_mxfp4" if mxfp4 else "fused_moe_int8" if quantized else "fused_moe"
        cfg = moe_config(op, x, w13, topk_ids, config)
    cfgs = {}  # LoRA config of each target with LoRA this call
    if token_lora_idx is not None:
        calls = {"gate_up": (w13_lora, _Shape(num_pairs, two_i), x),
                 "down": (w2_lora, _Shape(num_pairs, hidden), _Shape(num_pairs, two_i // 2))}
        for target, (pair, y, inp) in calls.items():
            if pair is not None:
                cfgs[target] = dict(lora_config_override or lora_config(y, inp, pair, topk_ids))
    if cfgs:  # one alignment for both LoRA calls, made early (PDL kernels may read it before they wait)
        block_m = int(next(iter(cfgs.values()))["BLOCK_M"])
        for c in cfgs.values():
            c["BLOCK_M"] = block_m
        max_loras = (w13_lora or w2_lora).num_slots
    if cfgs and not (kernel_layout and int(cfg.get("DIRECT", 0))):  # both alignments in one launch
        align, lora_align = moe_align_pair(topk_ids, token_lora_idx, num_experts, max_loras, int(cfg["BLOCK_M"]),
                                           block_m)
    else:  # DIRECT rows read topk_ids itself: no base alignment to pair the LoRA one with
        align = fm4.route_tables(topk_ids, num_experts, cfg) if kernel_layout else moe_align(topk_ids, num_experts,
                                                                                               int(cfg["BLOCK_M"]))
        if cfgs:
            lora_align = moe_align_lora(topk_ids, token_lora_idx, num_experts, max_loras, block_m)
    if kernel_layout and cfgs and int(cfg["BLOCK_M"]) <= EPILOGUE_MAX_BLOCK_M:
        return _kernel_layout_epilogue(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, token_lora_idx,
                                       scaling, cfg, align, cfgs, lora_align, w13_lora, w2_lora, activation=activation,
                                       b13=b13, b2=b2, alpha=alpha, limit=limit, shrink_stream=shrink_stream)
    side = shrink_stream if SHRINK_STREAM_APART else None
    # a target's shrink beside its base GEMM (its own kernel: not a FUSED config); PDL off for both halves, whose
    # launches then follow a fork / join instead of each other
    apart = {t: {**c, "PDL": 0} for t, c in cfgs.items() if side is not None and not int(c.get("FUSED", 0))}
    buf13 = fork(side, lambda: fml.moe_lora_shrink(x, w13_lora, topk_ids, token_lora_idx, scaling,
                                                    out_features=two_i, config=apart["gate_up"],
                                                    align=lora_align)) if "gate_up" in apart else None
    if kernel_layout:
        pre = fm4.gate_up(x, w13, w13_scale, align, cfg, top_k=top_k, activation=None, b13=b13)  # [T*A, 2I]
    else:
        pre = gate_up(x, w13, align, cfg, top_k=top_k, activation=None, b13=b13, w13_scale=w13_scale)
    if buf13 is not None:
        join(side)
        fml.moe_lora_expand(pre, x, buf13, w13_lora, topk_ids, token_lora_idx, scaling, None,
                            config=apart["gate_up"], align=lora_align)
    elif "gate_up" in cfgs:
        fml.fused_moe_lora(pre, x, w13_lora, None, topk_ids, token_lora_idx, scaling, None, config=cfgs["gate_up"],
                           align=lora_align)
    h = silu_and_mul(pre) if activation == "silu" else swiglu_clamp_and_mul(pre, alpha, limit)  # [T*A, I]
    buf2 = fork(side, lambda: fml.moe_lora_shrink(h, w2_lora, topk_ids, token_lora_idx, scaling,
                                                   out_features=hidden, config=apart["down"],
                                                   align=lora_align)) if "down" in apart else None
    if kernel_layout:  # no split-K: the down LoRA adds into the pair outputs
        out = fm4.down(h, w2, w2_scale, topk_weights, align, cfg, b2=b2, split_k=1)  # [T*A, H], routing-weighted
    else:
        out = down(h, w2, topk_weights, align, cfg, b2=b2, w2_scale=w2_scale)
    if buf2 is not None:
        join(side)
        fml.moe_lora_expand(out, h, buf2, w2_lora, topk_ids, token_lora_idx, scaling, topk_weights,
                            config=apart["down"], align=lora_align)
    elif "down" in cfgs:
        fml.fused_moe_lora(out, h, w2_lora, None, topk_ids, token_lora_idx, scaling, topk_weights,
                           config=cfgs["down"], align=lora_align)
    return out.view(num_tokens, top_k, -1).sum(dim=1)

