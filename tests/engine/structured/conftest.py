"""Fixtures of the structured-output tests: a PEFT adapter of a shared tiny checkpoint and a JSON checker."""
from __future__ import annotations

import json

import pytest

MOE_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral")


@pytest.fixture(scope="session")
def attention_adapter(tmp_path_factory):
    """``attention_adapter(base_path) -> folder``: PEFT LoRA (q/k/v/o, r=4, random non-zero weights) of the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cache: dict[str, str] = {}

    def make(base_path: str) -> str:
        if base_path not in cache:
            model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
            torch.manual_seed(11)
            cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False)
            out = str(tmp_path_factory.mktemp("structured-lora"))
            get_peft_model(model, cfg).save_pretrained(out)
            cache[base_path] = out
        return cache[base_path]

    return make


def assert_valid(text: str, schema: dict, label: str) -> None:
    """``text`` parses as JSON and validates against ``schema`` (jsonschema, draft 2020-12)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"{label}: not JSON ({e}): {text!r}") from None
    try:
        jsonschema.Draft202012Validator(schema).validate(value)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{label}: {e.message}: {text!r}") from None
