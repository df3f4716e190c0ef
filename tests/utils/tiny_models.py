"""Tiny base models of every supported family, built with transformers' own classes and odd sizes.

    path = make_tiny_base("qwen3_moe", out_dir)     # a folder with config.json (+ weights)
"""
from __future__ import annotations

import os

# Odd sizes so that no two dimensions coincide by accident (H != I != 2I, Q*D != KV*D).
COMMON = dict(vocab_size=97, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=12, max_position_embeddings=128)
FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")


def tiny_config(family: str):
    """A transformers config object of ``family`` with tiny odd sizes."""
    import transformers as tf

    if family == "gpt_oss":
        return tf.GptOssConfig(**COMMON, intermediate_size=28, num_local_experts=3, num_experts_per_tok=2,
                               sliding_window=16)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, intermediate_size=56, moe_intermediate_size=28, num_experts=5,
                                 num_experts_per_tok=2, mlp_only_layers=[2])
    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, intermediate_size=28, num_local_experts=3, num_experts_per_tok=2)
    if family == "llama":
        return tf.LlamaConfig(**COMMON, intermediate_size=56)
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON, intermediate_size=56)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def tiny_model(family: str, seed: int = 0):
    """A randomly initialised transformers causal LM of ``family``."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(tiny_config(family))


def make_tiny_base(family: str, out_dir: str) -> str:
    """Saves a tiny base model (config.json and weights) to ``out_dir``; returns the folder."""
    os.makedirs(out_dir, exist_ok=True)
    tiny_model(family).save_pretrained(out_dir)
    return out_dir
