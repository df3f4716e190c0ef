"""The decoder-only transformer every family shares; a family is this class plus a few choices (``MLPSpec``).

Shape legend: T tokens of the step (all sequences packed), H hidden, V vocabulary.

    input_ids [T] -> embed_tokens -> L x DecoderLayer -> norm -> hidden [T, H]
    aux_layer_ids (EAGLE-3 drafts): also the residual stream entering each named layer (h + residual; id L: the
    last layer's output before the norm), concatenated in layer order -> aux [T, len(ids) * H]
    DecoderLayer:  h, res = input_layernorm(h, res);  h = self_attn(h)
                   h, res = post_attention_layernorm(h, res);  h = mlp(h)
                   (MoE: h, res, logits = rms_norm_router(h, res, norm, router);  h = mlp(h, logits): the
                   router's product in the norm's launch at decode sizes, kernels/rms_norm_router.py)
    compute_logits(hidden [N, H]) -> lm_head -> [N, V] float32
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loraplex.engine.attention_metadata import AttentionMetadata
from loraplex.engine.config import ConfigError, ModelConfig
from loraplex.engine.models.layers.attention import Attention
from loraplex.engine.models.layers.linear import Embedding, Linear
from loraplex.engine.models.layers.mlp import GatedMLP
from loraplex.engine.models.layers.moe import SparseMoE
from loraplex.engine.models.layers.norm import RMSNorm
from loraplex.engine.models.layers.rotary import RotaryEmbedding
from loraplex.kernels import ops


@dataclass(frozen=True)
class MoESpec:
    """How a family routes and activates its experts."""

    router_name: str = "gate"          # attribute (and checkpoint) name of the router
    scoring: str = "softmax"           # see kernels.reference.moe_route
    activation: str = "silu"           # "silu" or "swiglu_clamp"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, moe_spec: MoESpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe and cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = SparseMoE(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                router_name=moe_spec.router_name, router_bias=cfg.router_bias, scoring=moe_spec.scoring,
                renormalize=cfg.norm_topk_prob, expert_bias=cfg.expert_bias, activation=moe_spec.activation,
                alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        """h [T, H], residual [T, H] or None (first layer) -> (h, residual), the sum deferred to the next norm."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, attn, kv_cache)
        mlp, norm = self.mlp, self.post_attention_layernorm
        router = mlp.router_layer if isinstance(mlp, SparseMoE) else None
        if type(router) is Linear:  # the router's product beside the norm
            h, residual, logits = ops.rms_norm_router(h, norm.weight, norm.eps, residual, router.weight, router.bias)
            return mlp(h, router_logits=logits), residual
        h, residual = norm(h, residual)
        return mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, moe_spec: MoESpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, moe_spec) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], aux_layer_ids: tuple[int, ...] = ()):
        h = self.embed_tokens(input_ids)
        residual = None
        aux = []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in aux_layer_ids:
                aux.append(h if residual is None else h + residual)
            h, residual = layer(positions, h, residual, attn, kv_cache)
        if len(self.layers) in aux_layer_ids:
            aux.append(h + residual)
        h, _ = self.norm(h, residual)
        return (h, torch.cat(aux, dim=-1)) if aux_layer_ids else h


class CausalLM(nn.Module):
    """A decoder-only causal LM. Parameter names follow the HF checkpoint except where fused
    (``self_attn.qkv_proj``, ``mlp.gate_up_proj``, ``mlp.experts.w13/w2/b13/b2``)."""

    family: str = ""
    moe_spec = MoESpec()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.family != self.family:
            raise ConfigError(f"{type(self).__name__} serves family {self.family!r}, got {cfg.family!r}")
        if self.moe_spec.activation == "silu" and cfg.hidden_act != "silu":
            raise ConfigError(f"hidden_act {cfg.hidden_act!r} is not supported for {cfg.family} (need 'silu')")
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.model = DecoderModel(cfg, self.rotary, self.moe_spec)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], aux_layer_ids: tuple[int, ...] = ()):
        """input_ids [T] long, positions [T] long; kv_caches one (k, v) per layer -> hidden [T, H]; with
        ``aux_layer_ids`` (distinct, in [0, L]) -> (hidden, aux [T, len(aux_layer_ids) * H]) (module docstring)."""
        return self.model(input_ids, positions, attn, kv_caches, aux_layer_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        return self.lm_head(hidden).float()

    def materialize_buffers(self, device: torch.device | str) -> None:
        """Compute non-persistent buffers (the rope table) on ``device`` after a meta-device build."""
        self.rotary.materialize(device)
