"""Tiny random checkpoints of every supported family, for tests and demos (no download needed).

    path = make_tiny_checkpoint("gpt_oss", tmp_dir)          # config.json, model.safetensors, tokenizer, ...
    path = make_tiny_checkpoint("llama", tmp_dir, max_shard_size="40KB")   # sharded + index.json
    path = make_tiny_mxfp4_checkpoint(tmp_dir, max_shard_size="40KB")     # GPT-OSS as published: MXFP4 experts

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


def _tiny_hf_model(family: str, seed: int, overrides: dict[str, Any]):
    import torch
    import transformers

    kw = tiny_config_overrides(family)
    kw.update(overrides)
    kw.update(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    config = getattr(transformers, _CONFIG_CLASSES[family])(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_small_params(model, seed, std=kw["initializer_range"])
    return model, kw


def make_tiny_checkpoint(family: str, out_dir: str | os.PathLike, *, seed: int = 0,
                         max_shard_size: str | int | None = None, **overrides: Any) -> str:
    """Build a tiny random ``family`` model with transformers, save it and a tokenizer to ``out_dir``.

    ``overrides`` replace entries of ``tiny_config_overrides(family)``. ``max_shard_size`` (e.g. ``"40KB"``)
    writes a sharded checkpoint with ``model.safetensors.index.json``. Returns ``out_dir`` as a string.
    """
    model, kw = _tiny_hf_model(family, seed, overrides)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_kw: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kw)
    model.generation_config.save_pretrained(out_dir)
    build_tiny_tokenizer(kw["vocab_size"], harmony=family == "gpt_oss").save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------- MXFP4 (GPT-OSS)

MXFP4_QUANTIZATION_CONFIG = {  # as in the published GPT-OSS config.json
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}
MXFP4_DIMS = dict(hidden_size=64, intermediate_size=32)  # multiples of 32 (the gpt_oss tiny default is not)


def pack_gpt_oss_experts(w):
    """A GPT-OSS expert weight as transformers holds it, [E, K, N] (gate_up_proj [E, H, 2I] with gate/up
    interleaved on N, down_proj [E, I, H]), -> its published MXFP4 tensors: (``*_blocks`` uint8
    [E, N, K/32, 16], ``*_scales`` uint8 [E, N, K/32]). Quantised by the OCP rule (``kernels/mxfp4.py``)."""
    from loraplex.kernels.mxfp4 import quantize_mxfp4

    w = w.transpose(1, 2)  # [E, N, K]: one row of codes per output channel
    blocks, scales = quantize_mxfp4(w)
    return blocks.reshape(*blocks.shape[:2], -1, 16).contiguous(), scales.contiguous()


def _size_bytes(size: str | int) -> int:
    if isinstance(size, int):
        return size
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for unit, factor in units.items():
        if size.upper().endswith(unit):
            return int(float(size[:-len(unit)]) * factor)
    raise ValueError(f"max_shard_size {size!r}: expected bytes or a string like '40KB' / '5GB'")


def save_checkpoint_tensors(tensors: dict, out_dir: str, max_shard_size: str | int | None = None) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_size`` bytes each (a tensor larger than that gets a shard of its own) plus
    ``model.safetensors.index.json``. Returns the files written."""
    from safetensors.torch import save_file

    if max_shard_size is None:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    cap = _size_bytes(max_shard_size)
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > cap:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def write_mxfp4_config(out_dir: str) -> None:
    """Add the published ``quantization_config`` to ``out_dir``/config.json."""
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(MXFP4_QUANTIZATION_CONFIG)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def make_tiny_mxfp4_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0, max_shard_size: str | int | None = None,
                               dtype: str = "bfloat16", **overrides: Any) -> str:
    """A tiny GPT-OSS checkpoint in the published MXFP4 layout: a transformers GptOss model (as
    ``make_tiny_checkpoint("gpt_oss", ..)``, hidden 64 and intermediate 32 unless ``overrides`` say otherwise)
    whose expert weights are stored as ``mlp.experts.{gate_up,down}_proj_{blocks,scales}`` (``pack_gpt_oss_experts``),
    every other tensor (expert biases included) in ``dtype``, and config.json with ``quantization_config``
    ``{"quant_method": "mxfp4", ..}``; tokenizer and generation_config.json beside it. transformers loads it
    dequantised (on CPU it always dequantises). Returns ``out_dir`` as a string."""
    import torch

    model, kw = _tiny_hf_model("gpt_oss", seed, {**MXFP4_DIMS, **overrides})
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = pack_gpt_oss_experts(t.detach())
        else:
            tensors[name] = t.detach().to(getattr(torch, dtype)).contiguous()
    save_checkpoint_tensors(tensors, out_dir, max_shard_size)
    model.config.save_pretrained(out_dir)
    write_mxfp4_config(out_dir)
    model.generation_config.save_pretrained(out_dir)
    build_tiny_tokenizer(kw["vocab_size"]).save_pretrained(out_dir)
    return out_dir
