"""Paged self-attention: fused qkv -> (q/k norm) -> rope -> write K/V to the cache -> paged attention -> o_proj.

Shape legend: T tokens, H hidden, Q query heads, KV kv heads, D head dim.
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.attention_metadata import AttentionMetadata
from loraplex.engine.config import ModelConfig
from loraplex.engine.models.layers.linear import Linear
from loraplex.engine.models.layers.norm import RMSNorm
from loraplex.engine.models.layers.rotary import RotaryEmbedding
from loraplex.kernels import ops


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = ops.attention_scale(cfg.head_dim)
        self.sliding_window = cfg.window_for_layer(layer_idx)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               output_sizes=[self.q_size, self.kv_size, self.kv_size],
                               output_names=["q_proj", "k_proj", "v_proj"])
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False) if cfg.attention_sinks else None
        self.rotary = rotary  # shared by all layers

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """positions [T]; x [T, H]; kv_cache (k, v) each [NB, BS, KV, D] -> [T, H]."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Q, D]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        k_cache, v_cache = kv_cache
        q = self.rotary.rotate_and_cache(positions, q, k, v, k_cache, v_cache, attn.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                self.scale, sliding_window=self.sliding_window, sinks=self.sinks)  # [T, Q, D]
        return self.o_proj(o.reshape(T, self.q_size))
