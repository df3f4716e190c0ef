"""Plain torch references of every op. Same signatures as the Triton launchers; used on CPU and by tests.

Layouts shared by all ops (shape legend: T tokens, H hidden, E experts, A activated experts per token,
I intermediate per expert, Q query heads, KV kv heads, D head dim, B sequences, NB blocks, BS block size):

    KV cache, per layer:  k_cache, v_cache  [NB, BS, KV, D]
    slot of a token:      block_id * BS + offset_in_block   (-1: do not write)
    block_tables:         [B, max_blocks] int32, row b lists sequence b's physical blocks in logical order
    expert weights:       w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]  (out x in, like nn.Linear)

Numerics follow Hugging Face transformers' eager code so float32 results match it to rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------ norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` [T, H] (or of ``x + residual``, then also returning that sum as the new residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * xf).to(dtype)
    return out if residual is None else (out, residual)


def rms_norm_router(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                    router_weight: torch.Tensor, router_bias: torch.Tensor | None):
    """An MoE layer's input norm and its router: ``rms_norm(x, weight, eps, residual)`` = (out, new residual),
    then the router's logits ``out @ router_weight[E, H]^T (+ router_bias)``: (out, new residual, logits [T, E])."""
    out, residual = rms_norm(x, weight, eps, residual)
    return out, residual, F.linear(out, router_weight, router_bias)


# ------------------------------------------------------------------------------------------- activations


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up  [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_clamp_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU. x [T, 2I] = [gate | up] (de-interleaved at load) -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def act_and_mul(x: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    if activation == "silu":
        return silu_and_mul(x)
    if activation == "swiglu_clamp":
        return swiglu_clamp_and_mul(x, alpha, limit)
    raise ValueError(f"unknown activation {activation!r}; expected 'silu' or 'swiglu_clamp'")


# ------------------------------------------------------------------------------------------------ rotary


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate halves) rope. positions [T]; q [T, Q, D]; k [T, KV, D];
    cos_sin_cache [max_pos, D] = cat(cos [D/2], sin [D/2]) per position (any attention scaling folded in)."""
    cs = cos_sin_cache[positions]  # [T, D]
    half = cs.shape[-1] // 2
    cos = cs[:, :half].unsqueeze(1).to(q.dtype)
    sin = cs[:, half:].unsqueeze(1).to(q.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rot(q), rot(k)


# ------------------------------------------------------------------------------------------------- MoE


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing. router_logits [T, E] -> (topk_weights [T, A] float32, topk_ids [T, A] int64).

    scoring="softmax": softmax over all experts, top-k, optionally renormalised (Mixtral, Qwen3-MoE).
    scoring="topk_softmax": top-k over logits, softmax over the k values (GPT-OSS).
    """
    if scoring == "softmax":
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif scoring == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        weights = torch.softmax(values.float(), dim=-1)
    else:
        raise ValueError(f"unknown MoE scoring {scoring!r}")
    return weights, ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """sum_a topk_weights[t, a] * down_e(act(gate_up_e(x_t))) with e = topk_ids[t, a].

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; b13 [E, 2I]; b2 [E, H]; topk_* [T, A] -> [T, H].
    """
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    for e in range(num_experts):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        h = F.linear(x[tok], w13[e], None if b13 is None else b13[e])
        h = act_and_mul(h, activation, alpha, limit)
        h = F.linear(h, w2[e], None if b2 is None else b2[e])
        out.index_add_(0, tok, (h * topk_weights[tok, slot, None].to(h.dtype)).to(out.dtype))
    return out


# ----------------------------------------------------------------------------------------- paged KV cache


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, KV, D] into the caches [NB, BS, KV, D] at slot_mapping [T] (-1 skips), in place."""
    nb, bs = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)


def rotary_embedding_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> torch.Tensor:
    """``rotary_embedding`` of q and k, then ``reshape_and_cache`` of the rotated k and of v -> the rotated q."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For every layer, copy block src -> dst for each row (src, dst) of block_mapping [N, 2], in place."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for k_cache, v_cache in zip(k_caches, v_caches):
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new query tokens over each sequence's paged context (prefill chunks and decode alike).

    q [T, Q, D]: the step's query tokens, sequence b owning rows query_start_loc[b]:query_start_loc[b+1].
    seq_lens [B]: context length of b after this step's tokens are written (the cache must already hold them).
    The query tokens of b are its last (query_start_loc[b+1]-query_start_loc[b]) positions.
    sliding_window W: a query at position p sees keys at positions p-W+1 .. p (as transformers' mask).
    sinks [Q]: one extra logit per head that joins the softmax but has no value (GPT-OSS).
    Returns [T, Q, D].
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    for b, ctx_len in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        n_q = end - start
        if n_q == 0:
            continue
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]  # [S, KV, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [Q, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        qb = q[start:end].transpose(0, 1).float()  # [Q, n_q, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Q, n_q, S]
        q_pos = torch.arange(ctx_len - n_q, ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask = mask & (k_pos > q_pos - sliding_window)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(-1, 1, 1).expand(-1, n_q, 1)
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
