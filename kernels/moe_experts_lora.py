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
the pre-activation before the gate_up delta). At decode and verify-step sizes (the MXFP4 config's row blocks of at
most EPILOGUE_MAX_BLOCK_M pairs) the expands move into the MXFP4 GEMMs' epilogues instead:

    moe_lora_shrink(x, A13) ─> h13 ─> gate_up GEMM + bias + gate_up delta + activation ─> h [T*A, I]
    moe_lora_shrink(h, A2)  ─> h2  ─> down GEMM + bias + down delta, * routing weight (split-K kept) ─> sum over A

two launches fewer per target, no pre-activation round trip, and the down GEMM keeps its split-K.

Launched with PDL (the MXFP4 config's "PDL" on sm_90+), each MXFP4 GEMM streams its weights through its K loop
while the shrink launched before it runs, and waits for it only before its epilogue (``late_wait``,
``fused_moe_mxfp4.LORA_LATE_WAIT``). Above the epilogue's row blocks the shrinks then move before their GEMMs too:

    moe_lora_shrink(x, A13) ─> gate_up GEMM ─> moe_lora_expand(pre) ─> act ─> moe_lora_shrink(h, A2) ─> down GEMM
    ─> moe_lora_expand(out) ─> sum over A          (a FUSED LoRA config: its one kernel after the GEMM, as above)
"""
from __future__ import annotations

import torch

from loraplex.kernels import tuning
from loraplex.kernels import fused_moe_lora as fml
from loraplex.kernels import fused_moe_mxfp4 as fm4
from loraplex.kernels.activation import silu_and_mul, swiglu_clamp_and_mul
from loraplex.kernels.fused_moe import check_moe, down, gate_up, moe_config
from loraplex.kernels.lora_table import LoRATable
from loraplex.kernels.moe_align import moe_align, moe_align_lora, moe_align_pair
from loraplex.kernels.mxfp4 import is_kernel_layout
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


# MXFP4 kernel-layout GEMMs at row blocks up to this size (the tuned decode and verify-step tiles, M up to ~160) add
# the LoRA deltas in their epilogues; with larger blocks (prefill tiles of 64+ pairs, many slots each) the epilogue's
# slot-by-slot products cost more than the expand launches they replace
EPILOGUE_MAX_BLOCK_M = 16


def _kernel_layout_epilogue(x, w13, s13, w2, s2, topk_weights, topk_ids, token_lora_idx, scaling, cfg, align, cfgs,
                            lora_align, w13_lora, w2_lora, *, activation, b13, b2, alpha, limit) -> torch.Tensor:
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
                    lora=gu_lora, late_wait=gu_lora is not None)  # [T*A, I]
    if "down" in cfgs:
        buf = fml.moe_lora_shrink(h, w2_lora, topk_ids, token_lora_idx, scaling, out_features=w2.shape[1],
                                  config=cfgs["down"], align=lora_align)
        dn_lora = fm4.LoRAEpilogue(buf, w2_lora, slots)
    out = fm4.down(h, w2, s2, topk_weights, align, cfg, b2=b2, lora=dn_lora, late_wait=dn_lora is not None)
    return fm4.sum_pairs(out, num_tokens, top_k, x.dtype, pdl=fm4.use_pdl(cfg, x.device))


def _shrink_first(cfg: dict, device: torch.device) -> bool:
    """Whether the expands-apart path launches each shrink before its base GEMM: where that GEMM is a PDL launch
    (its K loop then runs beside the shrink), unless ``LORA_LATE_WAIT`` is off."""
    return fm4.LORA_LATE_WAIT and fm4.use_pdl(cfg, device)


def _kernel_layout_apart(x, w13, s13, w2, s2, topk_weights, topk_ids, token_lora_idx, scaling, cfg, align, cfgs,
                         lora_align, w13_lora, w2_lora, *, activation, b13, b2, alpha, limit) -> torch.Tensor:
    """MXFP4 kernel layout above the epilogue's row blocks (prefill): the base GEMMs, each target's
    delta added by the LoRA kernels. With PDL each target's shrink is launched before its GEMM, which runs its K loop
    beside it (``late_wait``), and the expand follows the GEMM; a FUSED LoRA config (one kernel) runs after it."""
    num_tokens, top_k = topk_ids.shape
    early = {t: _shrink_first(cfg, x.device) and not int(c.get("FUSED", 0)) for t, c in cfgs.items()}

    def shrink(target, inp, lora, width):
        if not early.get(target):
            return None
        return fml.moe_lora_shrink(inp, lora, topk_ids, token_lora_idx, scaling, out_features=width,
                                   config=cfgs[target], align=lora_align)

    def delta(target, y, inp, lora, buf, weights):
        if buf is not None:
            fml.moe_lora_expand(y, inp, buf, lora, topk_ids, token_lora_idx, scaling, weights, config=cfgs[target],
                                align=lora_align)
        elif target in cfgs:
            fml.fused_moe_lora(y, inp, lora, None, topk_ids, token_lora_idx, scaling, weights, config=cfgs[target],
                               align=lora_align)

    buf = shrink("gate_up", x, w13_lora, w13.shape[1])
    pre = fm4.gate_up(x, w13, s13, align, cfg, top_k=top_k, activation=None, b13=b13,
                      late_wait=buf is not None)  # [T*A, 2I]
    delta("gate_up", pre, x, w13_lora, buf, None)
    h = silu_and_mul(pre) if activation == "silu" else swiglu_clamp_and_mul(pre, alpha, limit)  # [T*A, I]
    buf = shrink("down", h, w2_lora, w2.shape[1])
    # no split-K: the down LoRA adds into the pair outputs
    out = fm4.down(h, w2, s2, topk_weights, align, cfg, b2=b2, split_k=1, late_wait=buf is not None)  # [T*A, H]
    delta("down", out, h, w2_lora, buf, topk_weights)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def moe_experts_lora(x, w13, w2, topk_weights, topk_ids, token_lora_idx, scaling, *, w13_lora=None, w2_lora=None,
                     activation="silu", b13=None, b2=None, alpha=1.702, limit=7.0, w13_scale=None, w2_scale=None,
                     config: dict | None = None, lora_config_override: dict | None = None) -> torch.Tensor:
    """Same contract as ``reference_lora.moe_experts_lora``. ``config`` overrides the base GEMMs' tuned config,
    ``lora_config_override`` both LoRA calls' (tests and the tuner)."""
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
    lora_align = None
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
                                       b13=b13, b2=b2, alpha=alpha, limit=limit)
    if kernel_layout:
        return _kernel_layout_apart(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, token_lora_idx, scaling,
                                    cfg, align, cfgs, lora_align, w13_lora, w2_lora, activation=activation, b13=b13,
                                    b2=b2, alpha=alpha, limit=limit)
    pre = gate_up(x, w13, align, cfg, top_k=top_k, activation=None, b13=b13, w13_scale=w13_scale)
    if "gate_up" in cfgs:
        fml.fused_moe_lora(pre, x, w13_lora, None, topk_ids, token_lora_idx, scaling, None, config=cfgs["gate_up"],
                           align=lora_align)
    h = silu_and_mul(pre) if activation == "silu" else swiglu_clamp_and_mul(pre, alpha, limit)  # [T*A, I]
    out = down(h, w2, topk_weights, align, cfg, b2=b2, w2_scale=w2_scale)
    if "down" in cfgs:
        fml.fused_moe_lora(out, h, w2_lora, None, topk_ids, token_lora_idx, scaling, topk_weights,
                           config=cfgs["down"], align=lora_align)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
