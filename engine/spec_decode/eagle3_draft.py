"""The EAGLE-3 draft network as published (Li et al., 2025, "EAGLE-3"): one Llama decoder layer of its own, with
its own KV cache, fed the target's token embeddings and a fused feature of three of the target's layers.

Shape legend: T tokens, H the draft's hidden size, H_t the target's, n aux layers (3), V the target's vocabulary,
V_d the draft's (a subset of V).

    g      = fc(aux)                      aux [T, n * H_t]: the target's residual stream entering each aux layer
                                          (first draft step of a position), else the draft's own previous prenorm
                                          (norm_output: its previous normed output)
             norm_before_fc: fc(input_norm(aux)), one RMSNorm over the n * H_t concatenation (e.g. gpt-oss drafts)
             fc_norm:        fc([fc_norm[0](aux_0) ; .. ; fc_norm[n-1](aux_n-1)]), an RMSNorm per aux layer
    e      = embed(x)                     [T, H]   the target's embedding (or the checkpoint's own embed_tokens)
    res    = g;  a = [input_layernorm(e) ; hidden_norm(g)]          [T, 2H]   (norm_before_residual: res = the
                                                                               normed g)
    h      = self_attn(a)                 q/k/v take 2H inputs; rope, GQA over the draft's own K/V
    h, res = post_attention_layernorm(h, res);  h = mlp(h)
    out, prenorm = norm(h, res)           logits_d = lm_head(out) [T, V_d];  target id = draft id + d2t[draft id]

``Eagle3Config.from_dict`` reads the published config.json (or the speculators layout's); eagle3_checkpoint.py
loads the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loraplex.engine.attention_metadata import AttentionMetadata
from loraplex.engine.config import ConfigError, ModelConfig, RopeConfig
from loraplex.engine.models.layers.attention import Attention
from loraplex.engine.models.layers.linear import Embedding, Linear
from loraplex.engine.models.layers.mlp import GatedMLP
from loraplex.engine.models.layers.norm import RMSNorm
from loraplex.engine.models.layers.rotary import RotaryEmbedding

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# the EAGLE-3 fields a speculators config keeps at its top level, beside the decoder layer's own config
SPECULATORS_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                      "fc_norm", "norm_output")


def from_speculators(d: dict, where: str) -> dict:
    """A config in the ``speculators`` layout (``speculators_model_type`` "eagle3", architecture
    Eagle3Speculator) as the published layout: the decoder layer's fields from ``transformer_layer_config``, the
    EAGLE-3 fields from the top level, and ``norm_before_residual`` true unless it says otherwise (that layout's
    default; the published one's is false). Its ``speculators_config`` (proposal methods, the verifier's name) is
    not read: k is the engine's setting, and the target is checked by vocabulary and hidden size."""
    kind = d.get("speculators_model_type")
    if kind != "eagle3":
        raise ConfigError(f"{where}: speculators_model_type {kind!r}; of the speculators layout only 'eagle3' drafts "
                          "are read")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: a speculators EAGLE-3 config needs transformer_layer_config (the draft layer's "
                          f"config as an object), got {type(layer).__name__}")
    flat = {**layer, **{key: d[key] for key in SPECULATORS_FIELDS if key in d}}
    flat["norm_before_residual"] = d.get("norm_before_residual", True)
    flat["architectures"] = [ARCHITECTURES[1]]
    return flat


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 draft reads when its config names none: early, middle, late."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    vocab_size: int                        # the target vocabulary the draft was trained for
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: default_aux_layer_ids of the target
    norm_before_residual: bool = False
    attention_bias: bool = False
    norm_before_fc: bool = False   # one RMSNorm over the concatenated aux states before fc (input_norm)
    fc_norm: bool = False          # an RMSNorm per aux state before the concatenation (fc_norm.<i>)
    norm_output: bool = False      # the chain feeds the normed output back, not the prenorm sum

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Eagle3Config":
        """The published config.json ``d``, or one in the speculators layout (``from_speculators``); ``where``
        names it in errors; ConfigError saying what is wrong."""
        arch = list(d.get("architectures") or [])
        if SPECULATORS_ARCHITECTURE in arch or "speculators_model_type" in d:
            d = from_speculators(d, where)
            arch = d["architectures"]
        if not any(a in ARCHITECTURES for a in arch):
            raise ConfigError(f"{where}: architectures {arch} is not an EAGLE-3 draft; expected one of "
                              f"{', '.join(ARCHITECTURES)}")
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            vocab = int(d["vocab_size"])
            inter = int(d["intermediate_size"])
        except KeyError as e:
            raise ConfigError(f"{where} lacks required field {e.args[0]!r}") from None
        layers = int(d.get("num_hidden_layers", 1))
        if layers != 1:
            raise ConfigError(f"{where}: num_hidden_layers {layers}; only one-layer EAGLE-3 drafts are supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported (need 'silu')")
        eagle = d.get("eagle_config") or {}
        flags = {}
        for key in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
            value = d.get(key, eagle.get(key, False))  # top level (speculators) or in eagle_config (NVIDIA)
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
            flags[key] = value
        if flags["norm_before_fc"] and flags["fc_norm"]:
            raise ConfigError(f"{where}: norm_before_fc and fc_norm are both set; a draft norms its aux states "
                              "once, over the concatenation (norm_before_fc) or per layer (fc_norm)")
        if not eagle.get("use_aux_hidden_state", True):
            raise ConfigError(f"{where}: eagle_config.use_aux_hidden_state is false; only drafts reading the "
                              "target's aux hidden states (fc over 3 layers) are supported")
        ids = d.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ConfigError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer indices, got {ids!r}")
        draft_vocab = int(d.get("draft_vocab_size") or vocab)
        if not 0 < draft_vocab <= vocab:
            raise ConfigError(f"{where}: draft_vocab_size {draft_vocab} must be in [1, vocab_size {vocab}]")
        return cls(
            hidden_size=hidden, num_heads=num_heads, num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads), intermediate_size=inter,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf_dict(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)), vocab_size=vocab,
            draft_vocab_size=draft_vocab, target_hidden_size=int(d.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(ids) if ids is not None else None,
            attention_bias=bool(d.get("attention_bias", False)), **flags)

    def layer_config(self, max_positions: int) -> ModelConfig:
        """The decoder layer's dimensions as an engine ModelConfig (a one-layer llama), for its attention."""
        return ModelConfig(family="llama", vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                           max_position_embeddings=max_positions, rms_norm_eps=self.rms_norm_eps, rope=self.rope,
                           attention_bias=self.attention_bias)


class Eagle3Layer(nn.Module):
    """The checkpoint's ``midlayer``: attention over [input_layernorm(e); hidden_norm(g)] (module docstring)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, norm_before_residual: bool) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg, 0, rotary)
        self.self_attn.qkv_proj = Linear(2 * H, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias,
                                         output_sizes=[cfg.q_size, cfg.kv_size, cfg.kv_size],
                                         output_names=["q_proj", "k_proj", "v_proj"])
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = GatedMLP(H, cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, H], hidden [T, H] -> (mlp output, residual), the sum deferred to the final norm."""
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        h = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), hidden], dim=-1), attn, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Eagle3Draft(nn.Module):
    """fc, the decoder layer, the final norm, the draft-vocabulary ``lm_head`` and its d2t map (module docstring).
    ``embed_tokens`` is None when the checkpoint has none (the target's embedding is used)."""

    def __init__(self, config: Eagle3Config, *, num_aux_layers: int, max_positions: int,
                 own_embedding: bool) -> None:
        super().__init__()
        self.config = config
        cfg = config.layer_config(max_positions)
        self.layer_config = cfg
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        width = num_aux_layers * config.target_hidden_size
        self.num_aux_layers = num_aux_layers
        self.input_norm = RMSNorm(width, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                     for _ in range(num_aux_layers)) if config.fc_norm else None
        self.fc = Linear(width, config.hidden_size)
        self.midlayer = Eagle3Layer(cfg, self.rotary, config.norm_before_residual)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.draft_vocab_size)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size) if own_embedding else None
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux rows [T, n * H_t] -> g [T, H] (fc, after the checkpoint's norms: module docstring)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        elif self.fc_norm is not None:
            aux = torch.cat([norm(part) for norm, part in zip(self.fc_norm, aux.chunk(self.num_aux_layers, dim=-1),
                                                              strict=True)], dim=-1)
        return self.fc(aux)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed [T, H]: the lm_head input, the next draft step's hidden [T, H]: the prenorm sum, or with
        ``norm_output`` the normed output)."""
        h, residual = self.midlayer(positions, embeds, hidden, attn, kv_cache)
        normed, prenorm = self.norm(h, residual)
        return normed, normed if self.config.norm_output else prenorm

    def target_logits(self, normed: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, H] -> logits [N, vocab_size] float32 over the target's ids: the draft vocabulary's scattered through
        d2t, -inf at every id the draft cannot propose."""
        logits = self.lm_head(normed).float()
        out = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        out[:, self.draft_to_target] = logits
        return out
