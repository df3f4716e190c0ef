"""Paged attention in Triton for prefill chunks and decode alike (GQA, causal, sliding window, sinks).

Grid: (query blocks, KV heads). A program owns BLOCK_Q query tokens of one sequence times the GROUP query
heads sharing one KV head, so K/V tiles are loaded once per group. Query blocks are numbered so that
sequence b's blocks start at ``query_start_loc[b] // BLOCK_Q + b`` -- an upper bound that needs no host
sync; a program finds its sequence by counting block starts and leaves at once when it lies past the sequence's
query tokens. K/V rows are gathered through the block table per key position, so tiles may span blocks and
tables may point anywhere (holes, any order). Online softmax in fp32 (exp2); a sink starts the running max
and denominator of its head.

Split-KV decode (flash-decoding): with few query rows per sequence (decode), B x KV programs cannot fill the GPU
while each streams a whole context. The grid then gets a third dimension of ``num_splits`` programs per query
block, each taking one contiguous run of BLOCK_N key tiles of the block's key range (derived on the device from
seq_lens: program ``s`` takes tiles [s*ceil(n/S), (s+1)*ceil(n/S)), possibly none) and writing its unnormalised
partial (running max m in log2 units, denominator l, accumulator acc) to fp32 scratch [T, Q, S(, D)];
``_merge_splits_kernel`` then combines the partials of each (token, head) by log-sum-exp, adding the sink logit
there, once. A split with no keys writes m=-1e30, l=0, acc=0, which the merge ignores. ``num_splits`` depends
only on shapes (B, KV heads), so a captured CUDA graph replays for any seq_lens. On sm_90+ both kernels are PDL
launches (``slot_blocks.step_pdl``) that wait for the kernel before them first; neither lets the next start early
(the attention grid can take several waves, which waiting programs of the next kernel would crowd).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.dot import dot
from loraplex.kernels.intmath import next_power_of_2
from loraplex.kernels.launch import cached_launch
from loraplex.kernels.slot_blocks import pdl_launch, pdl_wait, step_pdl

_LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 528  # ~4 waves of an H100/H200's 132 SMs
_MIN_TILES_PER_SPLIT = 4


@cached_launch
@triton.jit(do_not_specialize=["num_seqs", "window", "num_splits", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # q, out [T, Q, D]; k, v caches [NB, BS, KV, D]
    bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr,  # block_tables [B, MB]; seq_lens [B]; query_start_loc [B+1]; sinks [Q]
    part_m_ptr, part_l_ptr, part_acc_ptr,  # SPLIT only: fp32 partials m, l [T, Q, S]; acc [T, Q, S, D] (contiguous)
    num_seqs, scale_log2, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    USE_WINDOW: tl.constexpr, SINK_IN_LOOP: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # ---- which sequence: the last b with query_start_loc[b] // BLOCK_Q + b <= pid (non-decreasing in b),
    # counted SEARCH_BLOCK sequences per vector load so the batch size is no compile-time constant
    before = 0
    for c in range(0, num_seqs, SEARCH_BLOCK):
        b = c + tl.arange(0, SEARCH_BLOCK)
        b_ok = b < num_seqs
        first = tl.load(qsl_ptr + b, mask=b_ok, other=0) // BLOCK_Q + b
        before += tl.sum((b_ok & (first <= pid)).to(tl.int32), 0)
    seq = before - 1
    q_start = tl.load(qsl_ptr + seq)
    n_q = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= n_q:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    # ---- query tile: row r = (token qi, head h of the group)
    rows = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (qi < n_q)
    q_pos = ctx_len - n_q + qi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if SINK_IN_LOOP:  # (not with SPLIT: split partials leave the sink to the merge)
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # ---- key range of this block: causal end, sliding-window start
    first_q_pos = ctx_len - n_q + q_block * BLOCK_Q
    kv_end = tl.minimum(ctx_len, first_q_pos + BLOCK_Q)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_q_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT:  # this program's run of key tiles: split s of num_splits, empty when the range is short
        split = tl.program_id(2)
        n_tiles = tl.cdiv(tl.maximum(kv_end - kv_begin, 0), BLOCK_N)
        tiles_per_split = tl.cdiv(n_tiles, num_splits)
        kv_begin = kv_begin + split * tiles_per_split * BLOCK_N
        kv_end = tl.minimum(kv_end, kv_begin + tiles_per_split * BLOCK_N)
    for start in range(kv_begin, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // KV_BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot_in_blk = pos % KV_BLOCK_SIZE
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + slot_in_blk[:, None] * stride_ks + kv_head * stride_kh
                    + d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
        keep = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        corr = tl.exp2(m_i - m_new)
        l_i = l_i * corr + tl.sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + slot_in_blk[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * corr[:, None] + dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        part = (tok * (GROUP * tl.num_programs(1)) + head) * num_splits + split  # [BLOCK_M] row of [T, Q, S]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@cached_launch
@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _merge_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qsl_ptr, sinks_ptr,  # out [T, Q, D]; partials as above; sinks [Q]
    num_seqs, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (T, Q): one (token, head) row; log-sum-exp merge of its num_splits partials (and its sink)."""
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dst = out_ptr + tok * stride_ot + head * stride_oh + d
    if tok >= tl.load(qsl_ptr + num_seqs):  # a token past every sequence (no partials written): zeros
        tl.store(dst, tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty), mask=d_ok)
        return
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    row = (tok * tl.num_programs(1) + head) * num_splits
    m = tl.load(part_m_ptr + row + s, mask=s_ok, other=-1.0e30)
    l = tl.load(part_l_ptr + row + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    m_max = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)  # [BLOCK_S]
    l_sum = tl.sum(l * w, 0)
    if USE_SINKS:
        l_sum += tl.exp2(sink - m_max)
    o = tl.sum(acc * w[:, None], 0)  # [BLOCK_D]
    l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(dst, (o / l_sum).to(out_ptr.dtype.element_ty), mask=d_ok)


def default_blocks(num_tokens: int, num_seqs: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N): decode packs one token's head group; prefill chunks take more query rows."""
    per_seq = max(1, num_tokens // max(1, num_seqs))
    target_rows = 16 if per_seq <= 2 else 64
    block_q = max(1, target_rows // group)
    return block_q, 64


def default_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, sliding_window: int | None = None,
                       block_n: int = 64) -> int:
    """Key splits per query block: 1 (no split) unless the step is decode-like (at most 2 query rows per sequence);
    then enough (sequence, KV head, split) programs for ~4 waves of 132 SMs, at most 16, and with a sliding
    window at least _MIN_TILES_PER_SPLIT key tiles per split (window 128: no split; a merge launch would cost
    more than 3 tiles). Shapes and arguments only, never seq_lens values (graph-safe)."""
    if num_tokens > 2 * max(1, num_seqs):
        return 1
    splits = max(1, min(16, -(-_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))))
    if sliding_window is not None:
        splits = min(splits, max(1, (sliding_window + block_n) // (_MIN_TILES_PER_SPLIT * block_n)))
    return splits


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                    block_q: int | None = None, block_n: int | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Same contract as ``reference.paged_attention``; ``block_q`` / ``block_n`` override the tile sizes,
    ``num_splits`` the key splits per query block (1: one pass, no merge; default ``default_num_splits``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, kv_block_size, num_kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not match q head dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    group = num_q_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    dq, dn = default_blocks(num_tokens, num_seqs, group)
    block_q, block_n = block_q or dq, block_n or dn
    block_m = max(16, next_power_of_2(block_q * group))
    if num_splits is None:
        num_splits = default_num_splits(num_tokens, num_seqs, num_kv_heads, sliding_window, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split = num_splits > 1
    if split:
        part_m = torch.empty(num_tokens, num_q_heads, num_splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    sinks_arg = sinks if sinks is not None else q
    pdl = step_pdl(q.device)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, sinks_arg, part_m, part_l, part_acc,
        num_seqs, float(scale) * _LOG2E, int(sliding_window or 0), num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), GROUP=group, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, KV_BLOCK_SIZE=kv_block_size,
        SEARCH_BLOCK=128,
        USE_WINDOW=sliding_window is not None, SINK_IN_LOOP=sinks is not None and not split, SPLIT=split,
        USE_PDL=pdl, num_warps=4, num_stages=2, **pdl_launch(pdl),
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_m, part_l, part_acc, query_start_loc, sinks_arg, num_seqs, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
            BLOCK_S=max(16, next_power_of_2(num_splits)), USE_SINKS=sinks is not None, USE_PDL=pdl,
            num_warps=1 if head_dim <= 64 else 2, **pdl_launch(pdl),
        )
    return out
