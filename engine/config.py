"""Model configuration read from a Hugging Face ``config.json``, without torch.

This module is torch-free on purpose: the control plane imports it (through the adapter-format checks) to
validate uploads against the base model's dimensions.

    ModelConfig.from_pretrained(path)   # a folder with config.json
    ModelConfig.from_hf_dict(d)         # the parsed JSON
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")
MOE_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class ConfigError(ValueError):
    """A model config that loraplex cannot serve; the message names the field and what to change."""


def read_config_json(folder: str | os.PathLike) -> dict:
    """The JSON object in ``folder``/config.json; ``ConfigError`` naming the file when it is missing, not JSON or
    not an object."""
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {os.fspath(folder)!r}")
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return d


@dataclass
class RopeConfig:
    """Rotary embedding parameters. ``rope_type`` is one of default, linear, llama3, yarn."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    SUPPORTED = ("default", "linear", "llama3", "yarn")

    def __post_init__(self) -> None:
        if self.rope_type not in self.SUPPORTED:
            raise ConfigError(f"rope type {self.rope_type!r} is not supported; supported: {', '.join(self.SUPPORTED)}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "RopeConfig":
        # transformers 5 writes ``rope_parameters``; older checkpoints ``rope_theta`` + ``rope_scaling``.
        params = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or {}
        if not params:
            params = dict(scaling)
            params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        kw: dict[str, Any] = dict(theta=float(params.get("rope_theta", d.get("rope_theta", 10000.0))), rope_type=rope_type)
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"):
            if params.get(name) is not None:
                kw[name] = float(params[name])
        if params.get("original_max_position_embeddings") is not None:
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        if params.get("truncate") is not None:
            kw["truncate"] = bool(params["truncate"])
        return cls(**kw)


@dataclass
class ModelConfig:
    """The dimensions and options of one base model, as the engine and the upload validator need them.

    Shape legend used across the engine: T tokens, H hidden, E experts, A activated experts (top-k),
    I intermediate (per expert for MoE), Q query heads, KV key/value heads, D head dim, V vocabulary.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (llama, qwen3, and qwen3_moe's mlp_only_layers)
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    moe_layers: list[int] = field(default_factory=list)  # layer indices whose MLP is MoE
    # Attention variants
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention / sliding_attention
    sliding_window: int | None = None
    attention_sinks: bool = False
    # GPT-OSS clamped SwiGLU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Tokens
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    name_or_path: str = ""

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"model family {self.family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types names sliding_attention layers but sliding_window is not set")
        if self.is_moe:
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"{self.family} needs num_experts > 0 and 0 < num_experts_per_tok <= num_experts "
                                  f"(got {self.num_experts}, {self.num_experts_per_tok})")

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_sliding_layer(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION

    def window_for_layer(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding_layer(layer) else None

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        cfg = cls.from_hf_dict(read_config_json(path))
        cfg.name_or_path = os.fspath(path)
        return cfg

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        family = d.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise ConfigError(f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            num_layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None
        head_dim = int(d.get("head_dim") or hidden // num_heads)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
        kw: dict[str, Any] = dict(
            family=family,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(d.get("intermediate_size") or 0),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_dict(d),
            hidden_act=d.get("hidden_act", "silu"),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
        )
        layer_types = list(d.get("layer_types") or [])
        window = d.get("sliding_window")
        if family == "gpt_oss":
            kw.update(
                num_experts=int(d["num_local_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["intermediate_size"]),
                router_bias=True, expert_bias=True, attention_bias=True, attention_sinks=True,
                norm_topk_prob=True,
                swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                moe_layers=list(range(num_layers)),
            )
            if not layer_types:
                layer_types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
        elif family == "mixtral":
            kw.update(
                num_experts=int(d["num_local_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["intermediate_size"]),
                norm_topk_prob=True,
                moe_layers=list(range(num_layers)),
            )
            if window and not layer_types:
                layer_types = [SLIDING_ATTENTION] * num_layers
        elif family == "qwen3_moe":
            mlp_only = set(d.get("mlp_only_layers") or [])
            step = int(d.get("decoder_sparse_step", 1) or 1)
            moe_layers = [i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0]
            kw.update(
                num_experts=int(d.get("num_experts") or d["num_local_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                qk_norm=True,
                moe_layers=moe_layers,
            )
        elif family == "qwen3":
            kw.update(qk_norm=True)
        if family in ("qwen3", "qwen3_moe"):
            # Qwen3 only applies the window when use_sliding_window is set.
            if not d.get("use_sliding_window", False):
                window = None
                layer_types = [FULL_ATTENTION] * num_layers
        elif family == "llama":
            window = None
        if not window:
            window = None
            layer_types = [FULL_ATTENTION] * num_layers
        kw.update(layer_types=layer_types, sliding_window=int(window) if window else None)
        return cls(**kw)
