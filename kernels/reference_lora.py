"""Torch references of the multi-LoRA, MoE-alignment and INT8 / MXFP4-MoE ops (the spec their Triton launchers match).

Shape legend: T tokens, A activated experts per token, E experts, L step slots (the distinct adapters of the step),
r one adapter's rank, R the largest rank a slot may hold, K input features, N output features, S output slices of
a fused target.

    token_lora_idx [T] int32     step slot of each token's adapter, -1 = no adapter (its rows get no delta)
    scaling        [>= L] float32 factor of each step slot (the engine folds alpha / r into B and passes ones)
    lora weights   a ``LoRATable`` (``lora_table.py``): per step slot and slice, A and B at that adapter's own rank
                   dense slice s: A [r, K], B [N_s, r];  expert target (S = 1): A [E, r, K], B [E, N, r]
                   rank 0 / no entry: no delta. Stacked tensors (``lora_a [S, L, R, K]``, ``lora_b [L, N, R]``;
                   experts ``[L, E, R, K]`` / ``[L, E, N, R]``, every slot zero-padded to R) are accepted too and
                   mean that table (``LoRATable.from_stacked``).
                   (separate gate/up adapters on fused experts: stack their A along r and make B block-diagonal,
                   which is exact)

MoE alignment: the flat index of a routed pair is ``t * A + a``. ``sorted_ids`` lists the pairs grouped by
expert (token order kept), each expert's group padded with the sentinel ``T * A`` to a multiple of
``block_size``; ``expert_ids[j]`` is the expert of block j (-1 past the used blocks). Buffers have the static
length ``moe_align_capacity`` so no host sync is needed::

    sorted_ids  | e0 e0 e0 pad | e2 pad pad pad | e3 e3 e3 e3 | sentinel ...
    expert_ids  |      0       |       2       |      3      |   -1 ...
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.lora_table import LoRATable, as_table
from loraplex.kernels.mxfp4 import check_mxfp4, dequantize_mxfp4, is_kernel_layout, kernel_k, restore_from_kernel
from loraplex.kernels.reference import act_and_mul

# ------------------------------------------------------------------------------------------ dense LoRA


def _slots_of(token_lora_idx: torch.Tensor) -> list[int]:
    return [int(v) for v in token_lora_idx.unique().tolist() if v >= 0]


def lora_shrink(x: torch.Tensor, lora_a, token_lora_idx: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """buf[s, t, :r] = scaling[l] * x[t] @ A[l, s].T with l = token_lora_idx[t]; zero rows for l = -1, zero
    columns past the slot's rank r.

    x [T, K]; lora_a: LoRATable (or stacked [S, L, R, K]); token_lora_idx [T]; scaling [>= L]
    -> buf [S, T, R] float32 (R = the table's max_rank).
    """
    table = as_table(lora_a, which="a")
    buf = torch.zeros(table.num_slices, x.shape[0], table.max_rank, dtype=torch.float32, device=x.device)
    for lora in _slots_of(token_lora_idx):
        rows = torch.where(token_lora_idx == lora)[0]
        xs = x[rows].float()
        for s in range(table.num_slices):
            f = table.lookup(lora, s)
            if f is None or f[0] is None:
                continue
            a = f[0]
            buf[s, rows, :a.shape[0]] = (xs @ a.float().T) * scaling[lora].float()
    return buf


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b, token_lora_idx: torch.Tensor,
                output_slices: tuple[int, ...]) -> None:
    """In place: y[t, slice s] += buf[s, t, :r] @ B[l, s].T with l = token_lora_idx[t] (skip l = -1).

    y [T, N]; buf [S, T, R] (from lora_shrink); lora_b: LoRATable (or stacked [L, N, R]); output_slices: S widths
    summing to N.
    """
    table = as_table(lora_b, output_slices=output_slices, which="b")
    check_slices(y, buf, table, output_slices)
    for lora in _slots_of(token_lora_idx):
        rows = torch.where(token_lora_idx == lora)[0]
        off = 0
        for s, width in enumerate(output_slices):
            f = table.lookup(lora, s)
            if f is not None and f[1] is not None:
                b = f[1]
                delta = buf[s, rows, :b.shape[1]].float() @ b.float().T
                y[rows, off:off + width] = (y[rows, off:off + width].float() + delta).to(y.dtype)
            off += width


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, lora_a, lora_b, token_lora_idx: torch.Tensor,
                       scaling: torch.Tensor, output_slices: tuple[int, ...]) -> None:
    """lora_expand(y, lora_shrink(x, ...), ...) as one op (the fused small-rank path), in place.

    y [T, N]; x [T, K]; lora_a: LoRATable holding A and B (then lora_b is None or the same table), or stacked
    [S, L, R, K] with lora_b stacked [L, N, R]; token_lora_idx [T]; scaling [>= L].
    """
    table = dense_table(lora_a, lora_b, output_slices)
    lora_expand(y, lora_shrink(x, table, token_lora_idx, scaling), table, token_lora_idx, output_slices)


def dense_table(lora_a, lora_b, output_slices) -> LoRATable:
    """The one table of a fused shrink + expand: ``lora_a`` if it is a table (``lora_b`` None or the same), else
    the stacked pair."""
    if isinstance(lora_a, LoRATable):
        if lora_b is not None and lora_b is not lora_a:
            raise ValueError("with a LoRATable, pass lora_b=None (the table holds A and B)")
        return lora_a
    return LoRATable.from_stacked(lora_a, lora_b, output_slices=output_slices)


def expert_table(lora_a, lora_b) -> LoRATable:
    """The table of an expert LoRA call: ``lora_a`` if it is a table (``lora_b`` None or the same), else the
    stacked pair ``lora_a [L, E, R, K]`` / ``lora_b [L, E, N, R]``."""
    if isinstance(lora_a, LoRATable):
        if lora_b is not None and lora_b is not lora_a:
            raise ValueError("with a LoRATable, pass lora_b=None (the table holds A and B)")
        if not lora_a.num_experts:
            raise ValueError("expert LoRA needs a table of expert factors (num_experts > 0)")
        return lora_a
    return LoRATable.from_stacked(lora_a, lora_b, experts=True)


def check_slices(y: torch.Tensor, buf: torch.Tensor, table: LoRATable, output_slices) -> None:
    if len(output_slices) != buf.shape[0] or table.num_slices != buf.shape[0]:
        raise ValueError(f"{len(output_slices)} output slices but the shrink buffer has {buf.shape[0]}")
    if sum(output_slices) != y.shape[1] or tuple(output_slices) != tuple(table.out_features):
        raise ValueError(f"output_slices sum to {sum(output_slices)}, the LoRA B factors have widths "
                         f"{tuple(table.out_features)} (N={sum(table.out_features)}), y has N={y.shape[1]}: all "
                         "three must agree")
    if table.max_rank > buf.shape[2]:
        raise ValueError(f"lora_b rank {table.max_rank} > shrink buffer rank {buf.shape[2]}")


# ------------------------------------------------------------------------------------------ MoE alignment


def moe_align_capacity(num_pairs: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """(length of sorted_ids, length of expert_ids): worst case when every non-empty expert pads a block."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    num_blocks = (padded + block_size - 1) // block_size
    return num_blocks * block_size, num_blocks


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group routed pairs by expert, padded per expert to ``block_size``.

    topk_ids [T, A] -> sorted_ids [P] int32, expert_ids [P / block_size] int32, num_tokens_post_pad [1] int32.
    """
    lora = torch.zeros(topk_ids.shape[0], dtype=torch.int32, device=topk_ids.device)
    sorted_ids, expert_ids, num_post = moe_align_lora(topk_ids, lora, num_experts, 1, block_size)
    return sorted_ids[0], expert_ids[0], num_post


def moe_align_lora(topk_ids: torch.Tensor, token_lora_idx: torch.Tensor, num_experts: int, max_loras: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align per adapter slot: slot l's table holds only the pairs of tokens with token_lora_idx == l.

    topk_ids [T, A]; token_lora_idx [T] (-1: in no table) ->
    sorted_ids [L, P] int32, expert_ids [L, P / block_size] int32, num_tokens_post_pad [L] int32.
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    cap, num_blocks = moe_align_capacity(num_pairs, num_experts, block_size)
    dev = topk_ids.device
    sorted_ids = torch.full((max_loras, cap), num_pairs, dtype=torch.int32, device=dev)
    expert_ids = torch.full((max_loras, num_blocks), -1, dtype=torch.int32, device=dev)
    num_post = torch.zeros(max_loras, dtype=torch.int32, device=dev)
    flat = topk_ids.reshape(-1).long()
    pair_lora = token_lora_idx.long().repeat_interleave(top_k)
    for lora in range(max_loras):
        pos = 0
        for e in range(num_experts):
            pairs = torch.where((flat == e) & (pair_lora == lora))[0]
            n = pairs.numel()
            if n == 0:
                continue
            sorted_ids[lora, pos:pos + n] = pairs.to(torch.int32)
            padded = (n + block_size - 1) // block_size * block_size
            expert_ids[lora, pos // block_size:(pos + padded) // block_size] = e
            pos += padded
        num_post[lora] = pos
    return sorted_ids, expert_ids, num_post


# --------------------------------------------------------------------------------------------- MoE LoRA


def fused_moe_lora(y: torch.Tensor, x: torch.Tensor, lora_a, lora_b, topk_ids: torch.Tensor,
                   token_lora_idx: torch.Tensor, scaling: torch.Tensor,
                   topk_weights: torch.Tensor | None = None) -> None:
    """In place, per routed pair p = t*A + a with l = token_lora_idx[t] >= 0 and e = topk_ids[t, a]:
    y[p] += w * scaling[l] * B[l][e] @ (A[l][e] @ x_row), w = topk_weights[t, a] (or 1); a slot without weights
    for this target adds nothing.

    y [T*A, N] (the expert GEMM's per-pair output); x [T, K] (gate_up: rows shared by a token's pairs) or
    [T*A, K] (down: one row per pair); lora_a: a LoRATable of expert factors (A [E, r, K], B [E, N, r] per slot;
    lora_b None) or stacked lora_a [L, E, R, K] with lora_b [L, E, N, R]; topk_ids [T, A].
    """
    table = expert_table(lora_a, lora_b)
    num_tokens, top_k = topk_ids.shape
    per_pair_input = x.shape[0] == num_tokens * top_k and top_k > 1
    for t in range(num_tokens):
        lora = int(token_lora_idx[t])
        if lora < 0:
            continue
        f = table.lookup(lora, 0)
        if f is None:
            continue
        a_l, b_l = f
        for a in range(top_k):
            p = t * top_k + a
            e = int(topk_ids[t, a])
            row = x[p if per_pair_input else t].float()
            delta = b_l[e].float() @ (a_l[e].float() @ row) * scaling[lora].float()
            if topk_weights is not None:
                delta = delta * topk_weights[t, a].float()
            y[p] = (y[p].float() + delta).to(y.dtype)


def moe_experts_lora(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, token_lora_idx: torch.Tensor | None, scaling: torch.Tensor, *,
                     w13_lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                     w2_lora: tuple[torch.Tensor, torch.Tensor] | None = None, activation: str = "silu",
                     b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, alpha: float = 1.702,
                     limit: float = 7.0, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe with expert LoRA on each token's routed experts. Per routed pair (t, a) of expert e, with
    l = token_lora_idx[t] (-1 or a None map: no delta) and w = topk_weights[t, a]:

        g = w13[e] x_t + b13[e] + scaling[l] B13[l, e] A13[l, e] x_t          (delta before the activation)
        d = w2[e] act(g) + b2[e] + scaling[l] B2[l, e] A2[l, e] act(g)
        out[t] = sum_a w * d

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; b13 [E, 2I]; b2 [E, H]; topk_* [T, A]; scaling [>= L];
    w13_lora, w2_lora: LoRATables of expert factors (A [E, r, H] / B [E, 2I, r], A [E, r, I] / B [E, H, r] per
    slot), or stacked pairs (lora_a [L, E, R, K], lora_b [L, E, N, R]); either may be None. ``w13_scale`` [E, 2I] / ``w2_scale`` [E, H] given: w13 / w2 are int8 and each expert's
    weight is ``(q * scale).to(x.dtype)`` (INT8 weight-only); with uint8 w13 / w2 they are MXFP4 instead: blocks
    w13 [E, 2I, H/2], w2 [E, H, I/2] and E8M0 scales w13_scale [E, 2I, H/32], w2_scale [E, H, I/32], each
    expert's weight ``dequantize_mxfp4(blocks, scales, x.dtype)`` (int32 w13 / w2: the same in the kernel layout,
    ``mxfp4.prepare_for_kernel``). -> [T, H].

    Per-expert GEMMs over the pairs sorted by expert, in the model dtype; each delta is added in float32 to the
    GEMM's output and rounded back, then the routing weight multiplies the pair's output.
    """
    if activation not in ("silu", "swiglu_clamp"):
        raise ValueError(f"unknown activation {activation!r}; expected 'silu' or 'swiglu_clamp'")
    if w13_scale is not None or w2_scale is not None:
        (check_mxfp4_weights if w13.dtype in (torch.uint8, torch.int32) else check_int8_weights)(
            w13, w13_scale, w2, w2_scale)
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs p = t*A + a sorted by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    inter = _grouped_linear(x, order // top_k, order, counts, w13, b13, w13_scale)  # [T*A, 2I] by pair
    lora = token_lora_idx is not None
    if lora and w13_lora is not None:
        fused_moe_lora(inter, x, *_pair(w13_lora), topk_ids, token_lora_idx, scaling)
    h = act_and_mul(inter, activation, alpha, limit)  # [T*A, I]
    out = _grouped_linear(h, order, order, counts, w2, b2, w2_scale)  # [T*A, H]
    if lora and w2_lora is not None:
        fused_moe_lora(out, h, *_pair(w2_lora), topk_ids, token_lora_idx, scaling)
    out = out.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1).to(out.dtype)
    return out.sum(dim=1)


def _pair(lora) -> tuple:
    """(lora_a, lora_b) arguments of fused_moe_lora for a table or a stacked pair."""
    return (lora, None) if isinstance(lora, LoRATable) else tuple(lora)


def as_expert_table(lora) -> LoRATable | None:
    """moe_experts_lora's ``w13_lora`` / ``w2_lora``: None, a LoRATable, or a stacked (lora_a, lora_b) pair."""
    return None if lora is None else expert_table(*_pair(lora))


def _grouped_linear(x: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor, counts: list[int], w: torch.Tensor,
                    b: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    """out[pairs[j]] = w[e] @ x[rows[j]] + b[e] for the j-th sorted pair of expert e (w dequantised per expert
    when ``scale`` is given: INT8, or MXFP4 for uint8 w). x [M, K]; rows, pairs [P] (sorted by expert);
    w [E, N, K]; b [E, N] -> [P, N]."""
    out = torch.empty(pairs.numel(), w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = slice(start, start + n)
        if scale is None:
            we = w[e]
        elif w.dtype in (torch.uint8, torch.int32):  # MXFP4, either layout
            we = dequantize_mxfp4(w[e], scale[e], x.dtype, k=x.shape[1])
        else:
            we = (w[e].float() * scale[e, :, None].float()).to(x.dtype)
        out[pairs[sel]] = F.linear(x[rows[sel]], we, None if b is None else b[e])
        start += n
    return out


# --------------------------------------------------------------------------------------------- INT8 MoE


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: w [..., N, K] -> (q int8 [..., N, K], scale float32 [..., N])."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = torch.round(w.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def check_int8_weights(w13_q: torch.Tensor, w13_scale: torch.Tensor | None, w2_q: torch.Tensor,
                       w2_scale: torch.Tensor | None) -> None:
    """INT8 expert weights: int8 tensors and per-output-channel scales, both or neither scale given."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("pass both w13_scale and w2_scale (INT8 experts) or neither (float experts)")
    if w13_q.dtype != torch.int8 or w2_q.dtype != torch.int8:
        raise ValueError(f"INT8 experts need int8 weights, got {w13_q.dtype} and {w2_q.dtype}")
    if w13_scale.shape != w13_q.shape[:2] or w2_scale.shape != w2_q.shape[:2]:
        raise ValueError(f"scales must be per output channel: w13_scale {tuple(w13_q.shape[:2])}, w2_scale "
                         f"{tuple(w2_q.shape[:2])}; got {tuple(w13_scale.shape)} and {tuple(w2_scale.shape)}")


def fused_moe_int8(x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor,
                   w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   activation: str = "silu", b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                   alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """fused_moe with INT8 weight-only experts: w = q * scale per output channel.

    x [T, H]; w13_q [E, 2I, H] int8, w13_scale [E, 2I]; w2_q [E, H, I] int8, w2_scale [E, H] -> [T, H].
    """
    return _dequantised_moe(x, w13_q.shape[0], lambda e: (w13_q[e].float() * w13_scale[e].float()[:, None],
                                                          w2_q[e].float() * w2_scale[e].float()[:, None]),
                            topk_weights, topk_ids, activation, b13, b2, alpha, limit)


def _dequantised_moe(x, num_experts, weights_of, topk_weights, topk_ids, activation, b13, b2, alpha,
                     limit) -> torch.Tensor:
    """The float32 expert loop of the quantised references: ``weights_of(e)`` -> (w13 [2I, H], w2 [H, I])
    dequantised to float32, one expert at a time."""
    out = torch.zeros_like(x)
    for e in range(num_experts):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        w13, w2 = weights_of(e)
        h = F.linear(x[tok].float(), w13, None if b13 is None else b13[e].float())
        h = act_and_mul(h, activation, alpha, limit)
        h = F.linear(h, w2, None if b2 is None else b2[e].float())
        out.index_add_(0, tok, (h * topk_weights[tok, slot, None].float()).to(out.dtype))
    return out


# -------------------------------------------------------------------------------------------- MXFP4 MoE


def check_mxfp4_weights(w13_blocks: torch.Tensor, w13_scales: torch.Tensor | None, w2_blocks: torch.Tensor,
                        w2_scales: torch.Tensor | None) -> None:
    """MXFP4 expert weights (``mxfp4.py``): w13 blocks [E, 2I, H/2] / scales [E, 2I, H/32], w2 blocks [E, H, I/2]
    / scales [E, H, I/32], all uint8, both scales given (H and I multiples of 32 by construction); or both in the
    kernel layout (int32 words w13 [E, 2I, KP(H)/8], w2 [E, H, KP(I)/8], KP = K rounded up to 64)."""
    if w13_scales is None or w2_scales is None:
        raise ValueError("MXFP4 experts need both w13_scale and w2_scale (uint8 E8M0 scales)")
    if is_kernel_layout(w13_blocks) != is_kernel_layout(w2_blocks):
        raise ValueError(f"MXFP4 w13 and w2 must share a layout, got blocks of {w13_blocks.dtype} and "
                         f"{w2_blocks.dtype}")
    check_mxfp4(w13_blocks, w13_scales, "w13")
    check_mxfp4(w2_blocks, w2_scales, "w2")
    num_experts, two_i, _ = w13_blocks.shape
    if is_kernel_layout(w13_blocks):
        if (w2_blocks.shape[0] != num_experts or w2_blocks.shape[2] * 8 != kernel_k(two_i // 2)
                or kernel_k(w2_blocks.shape[1]) != w13_blocks.shape[2] * 8):
            raise ValueError(f"MXFP4 expert words w13 {tuple(w13_blocks.shape)} / w2 {tuple(w2_blocks.shape)} do "
                             f"not match: expected w13 [E, 2I, KP(H)/8] and w2 [E, H, KP(I)/8]")
    elif w2_blocks.shape != (num_experts, 2 * w13_blocks.shape[2], two_i // 4):
        raise ValueError(f"MXFP4 expert blocks w13 {tuple(w13_blocks.shape)} / w2 {tuple(w2_blocks.shape)} do "
                         f"not match: expected w13 [E, 2I, H/2] and w2 [E, H, I/2]")


def fused_moe_mxfp4(x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                    w2_scales: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    activation: str = "silu", b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """fused_moe with MXFP4 weight-only experts: each expert's weights dequantised, then the float path.

    x [T, H]; w13_blocks [E, 2I, H/2] uint8, w13_scales [E, 2I, H/32] uint8; w2_blocks [E, H, I/2] uint8,
    w2_scales [E, H, I/32] uint8; H and I multiples of 32 -> [T, H]. Weights in the kernel layout
    (``mxfp4.prepare_for_kernel``) are accepted too.
    """
    check_mxfp4_weights(w13_blocks, w13_scales, w2_blocks, w2_scales)
    if is_kernel_layout(w13_blocks):  # back to the checkpoint layout (slow: the CUDA launcher reads it directly)
        w13_blocks, w13_scales = restore_from_kernel(w13_blocks, w13_scales, x.shape[1])
        w2_blocks, w2_scales = restore_from_kernel(w2_blocks, w2_scales, w13_blocks.shape[1] // 2)
    if w13_blocks.shape[2] * 2 != x.shape[1]:
        raise ValueError(f"x [T, {x.shape[1]}] does not match w13_blocks {tuple(w13_blocks.shape)} ([E, 2I, H/2])")
    return _dequantised_moe(x, w13_blocks.shape[0], lambda e: (dequantize_mxfp4(w13_blocks[e], w13_scales[e]),
                                                               dequantize_mxfp4(w2_blocks[e], w2_scales[e])),
                            topk_weights, topk_ids, activation, b13, b2, alpha, limit)
