"""Fixtures shared by the engine tests: ``peft_folders``, random non-zero PEFT LoRA adapters of a tiny checkpoint
(attention, and the experts on MoE families)."""
from __future__ import annotations

import pytest
import torch

MOE_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral")


@pytest.fixture(scope="session")
def peft_folders(tmp_path_factory):
    """``peft_folders(base) -> {"a": folder (r=4), "b": folder (r=8)}``: random non-zero PEFT LoRA on attention and
    the MLP (the fused experts, ``target_parameters``, on MoE families)."""
    cache: dict = {}

    def make(base: str) -> dict[str, str]:
        if base not in cache:
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM

            folders = {}
            for name, r, seed in (("a", 4, 1), ("b", 8, 2)):
                model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                moe = model.config.model_type in MOE_FAMILIES
                torch.manual_seed(seed)
                cfg = LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
                                 + ([] if moe else ["gate_proj", "up_proj", "down_proj"]),
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe
                                 else None)
                folders[name] = str(tmp_path_factory.mktemp(f"spec-lora-{name}"))
                get_peft_model(model, cfg).save_pretrained(folders[name])
            cache[base] = folders
        return cache[base]

    return make
