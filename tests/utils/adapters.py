"""Real PEFT adapters of the tiny base models, and hand-made safetensors files for hostile uploads.

    folder = make_peft_adapter("mixtral", out_dir, r=4)            # adapter_config.json + adapter_model.safetensors
    folder = peft_adapter_of(checkpoint_dir, out_dir, r=8, seed=2)  # of a saved checkpoint (its own shapes)
    write_safetensors(path, {"name": ("F32", (4, 40))})            # zero-filled, any names/shapes/dtypes
"""
from __future__ import annotations

import json
import os
import struct

from tests.utils.tiny_models import tiny_model

MOE = ("gpt_oss", "qwen3_moe", "mixtral")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
DENSE_MLP = ["gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def make_peft_adapter(family: str, out_dir: str, *, r: int = 4, alpha: float = 8, use_rslora: bool = False,
                      target_modules: list[str] | None = None, target_parameters: list[str] | None = None,
                      base_model_name: str | None = "tiny-base", dtype: str | None = None, seed: int = 0,
                      **lora_kwargs) -> str:
    """Trains nothing: wraps a tiny model with ``peft`` (random, non-zero LoRA weights) and saves the adapter.

    Defaults target attention everywhere, the dense MLP on dense families and the fused experts on MoE ones."""
    import torch
    from peft import LoraConfig, get_peft_model

    if target_modules is None:
        target_modules = ATTN + ([] if family in MOE else DENSE_MLP)
    if target_parameters is None and family in MOE:
        target_parameters = EXPERTS
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=target_modules,
                     target_parameters=target_parameters or None, init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(tiny_model(family, seed), cfg)
    model.save_pretrained(out_dir)
    cfg_path = os.path.join(out_dir, "adapter_config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    d["base_model_name_or_path"] = base_model_name
    with open(cfg_path, "w") as f:
        json.dump(d, f, indent=2)
    if dtype is not None:
        from safetensors.torch import load_file, save_file

        st = os.path.join(out_dir, "adapter_model.safetensors")
        tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_file(st).items()}
        save_file(tensors, st)
    return out_dir


def peft_adapter_of(base: str, out_dir: str, *, r: int, seed: int, alpha: float | None = None) -> str:
    """A PEFT adapter (random, non-zero weights, ``lora_alpha`` 2r unless given) of the checkpoint saved at ``base``:
    attention everywhere, the dense MLP on dense families and the fused experts on MoE ones."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moe = model.config.model_type in MOE
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha, init_lora_weights=False,
                     target_modules=ATTN + ([] if moe else DENSE_MLP), target_parameters=EXPERTS if moe else None)
    get_peft_model(model, cfg).save_pretrained(out_dir)
    return out_dir


def edit_config(folder: str, **changes) -> None:
    """Rewrites keys of a saved adapter_config.json."""
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        d = json.load(f)
    d.update(changes)
    with open(path, "w") as f:
        json.dump(d, f)


DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "F64": 8, "I8": 1, "U8": 1}


def safetensors_header(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """(8-byte length + JSON header, data size) for zero-filled tensors laid out in the given order."""
    d, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = DTYPE_BYTES[dtype]
        for s in shape:
            n *= s
        d[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(d).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def write_safetensors(path: str, tensors: dict[str, tuple[str, tuple[int, ...]]], *,
                      fill: bytes = b"\0", chunk: int = 1 << 22) -> int:
    """Writes a safetensors file whose tensor bytes repeat ``fill``, streaming (any size, bounded memory).
    Returns the file size."""
    head, data = safetensors_header(tensors)
    block = (fill * (chunk // len(fill) + 1))[:chunk]
    with open(path, "wb") as f:
        f.write(head)
        left = data
        while left:
            n = min(left, chunk)
            f.write(block[:n])
            left -= n
    return len(head) + data


def lora_tensors(layers: int, dims: dict[str, tuple[int, int]], r: int, dtype: str = "F32",
                 prefix: str = "base_model.model.model.layers") -> dict[str, tuple[str, tuple[int, ...]]]:
    """Names and shapes of a plain-module adapter: ``dims`` maps target (``self_attn.q_proj``) to (in, out)."""
    out = {}
    for i in range(layers):
        for target, (fan_in, fan_out) in dims.items():
            out[f"{prefix}.{i}.{target}.lora_A.weight"] = (dtype, (r, fan_in))
            out[f"{prefix}.{i}.{target}.lora_B.weight"] = (dtype, (fan_out, r))
    return out
