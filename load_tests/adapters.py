"""Cheap PEFT LoRA adapters for load: rank 1 on ``q_proj`` of every layer, built from the base model's
``config.json`` without torch (a hand-written safetensors file of one repeated float32 value).

    files = rank1_adapter(base_model_path, value=0.01)
    # {"adapter_config.json": bytes, "adapter_model.safetensors": bytes}
"""
from __future__ import annotations

import json
import os
import struct


def _dims(base_model_path: str) -> tuple[int, int, int]:
    """(layers, hidden, q_out) of the base model."""
    with open(os.path.join(base_model_path, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    return text["num_hidden_layers"], hidden, heads * head_dim


def rank1_adapter(base_model_path: str, *, value: float = 0.01) -> dict[str, bytes]:
    """The two files of a rank-1 ``q_proj`` adapter whose weights all equal ``value`` (finite, non-zero)."""
    if not value or value != value or abs(value) == float("inf"):
        raise ValueError(f"value must be finite and non-zero, got {value}")
    layers, hidden, q_out = _dims(base_model_path)
    header, offset, shapes = {}, 0, []
    for i in range(layers):
        for part, shape in (("lora_A", (1, hidden)), ("lora_B", (q_out, 1))):
            n = shape[0] * shape[1] * 4
            name = f"base_model.model.model.layers.{i}.self_attn.q_proj.{part}.weight"
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = struct.pack("<f", value) * (offset // 4)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 2, "lora_dropout": 0.0,
              "target_modules": ["q_proj"], "bias": "none", "fan_in_fan_out": False, "use_dora": False,
              "use_rslora": False, "modules_to_save": None, "base_model_name_or_path": None}
    return {"adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": struct.pack("<Q", len(raw)) + raw + data}
