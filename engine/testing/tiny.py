"""Tiny random checkpoints of every supported family, for tests and demos (no download needed).

    path = make_tiny_checkpoint("gpt_oss", tmp_dir)          # config.json, model.safetensors, tokenizer, ...
    path = make_tiny_checkpoint("llama", tmp_dir, max_shard_size="40KB")   # sharded + index.json

The weights come from transformers' own model classes (float32, seeded), with a larger init scale than the
library default and non-zero router / sink / bias parameters, so greedy decoding gives varied tokens and top-1
logits are well separated: token-identical comparisons against transformers then mean something.
"""
from __future__ import annotations

import json
import os
from typing import Any

from loraplex.engine.testing.tiny_tokenizer import BOS, EOS, PAD, build_tiny_tokenizer

FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")

_COMMON: dict[str, Any] = dict(
    hidden_size=72, num_attention_heads=6, num_key_value_heads=2, head_dim=12, num_hidden_layers=2,
    vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
    tie_word_embeddings=False,
)

_PER_FAMILY: dict[str, dict[str, Any]] = {
    # llama3 rope scaling, attention bias (llama allows it), untied head
    "llama": dict(intermediate_size=44, attention_bias=True,
                  rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=32)),
    # linear rope scaling, tied embeddings, q/k norm
    "qwen3": dict(intermediate_size=40, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    "mixtral": dict(intermediate_size=40, num_local_experts=6, num_experts_per_tok=2,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # 3 layers, the middle one dense (mlp_only_layers), no top-k renormalisation
    "qwen3_moe": dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=40, num_experts=6,
                      num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # 3 layers alternating sliding/full with a window far shorter than test prompts; YaRN rope
    "gpt_oss": dict(num_hidden_layers=3, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2,
                    sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=64)),
}

_CONFIG_CLASSES = {
    "llama": "LlamaConfig", "qwen3": "Qwen3Config", "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig",
}


def tiny_config_overrides(family: str) -> dict[str, Any]:
    """The transformers config kwargs ``make_tiny_checkpoint`` uses for ``family`` (a fresh dict)."""
    if family not in _PER_FAMILY:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {', '.join(FAMILIES)}")
    kw = dict(_COMMON)
    kw.update(json.loads(json.dumps(_PER_FAMILY[family])))
    return kw


def _perturb_small_params(model, seed: int, std: float) -> None:
    """Give router biases, attention sinks, biases and norm weights non-trivial random values."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name and p.dim() == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)


def make_tiny_checkpoint(family: str, out_dir: str | os.PathLike, *, seed: int = 0,
                         max_shard_size: str | int | None = None, **overrides: Any) -> str:
    """Build a tiny random ``family`` model with transformers, save it and a tokenizer to ``out_dir``.

    ``overrides`` replace entries of ``tiny_config_overrides(family)``. ``max_shard_size`` (e.g. ``"40KB"``)
    writes a sharded checkpoint with ``model.safetensors.index.json``. Returns ``out_dir`` as a string.
    """
    import torch
    import transformers

    kw = tiny_config_overrides(family)
    kw.update(overrides)
    kw.update(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    config = getattr(transformers, _CONFIG_CLASSES[family])(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_small_params(model, seed, std=kw["initializer_range"])
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_kw: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kw)
    model.generation_config.save_pretrained(out_dir)
    build_tiny_tokenizer(kw["vocab_size"], harmony=family == "gpt_oss").save_pretrained(out_dir)
    return out_dir
