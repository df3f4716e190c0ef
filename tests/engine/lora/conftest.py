"""Fixtures of the LoRA tests: real PEFT adapters of the shared tiny checkpoints and PEFT's own greedy decoding."""
from __future__ import annotations

import os

import pytest

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DENSE_MLP = ["gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral")


def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="session")
def peft_adapter(tmp_path_factory):
    """``peft_adapter(base_path, *, r, alpha, use_rslora=False, attention_only=False, targets=None, seed=0)
    -> folder``: PEFT wraps the base checkpoint with random non-zero LoRA weights (``init_lora_weights=False``)
    and saves it. Default targets: attention, plus the fused experts (``target_parameters``) on MoE families
    or gate/up/down on dense ones. Identical arguments share one folder per session."""
    import torch
    from peft import LoraConfig, get_peft_model

    cache: dict = {}

    def make(base_path: str, *, r: int, alpha: float, use_rslora: bool = False, attention_only: bool = False,
             targets: list[str] | None = None, seed: int = 0) -> str:
        key = (base_path, r, alpha, use_rslora, attention_only, tuple(targets or ()), seed)
        if key in cache:
            return cache[key]
        model = _hf_model(base_path)
        family = model.config.model_type
        modules = targets or ATTENTION
        params = None
        if not attention_only and targets is None:
            if family in MOE_FAMILIES:
                params = EXPERTS
            else:
                modules = ATTENTION + DENSE_MLP
        torch.manual_seed(seed)
        cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=modules,
                         target_parameters=params, init_lora_weights=False)
        out = str(tmp_path_factory.mktemp(f"lora-{family}-r{r}"))
        get_peft_model(model, cfg).save_pretrained(out)
        assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
        cache[key] = out
        return out

    return make


@pytest.fixture(scope="session")
def peft_logits():
    """``peft_logits(base_path, adapter_folder | None, prompt_ids, output_ids) -> logits [n, V]``: what
    transformers + PEFT, with that adapter alone (None: the base model), float32 eager, predicts for each of the
    n = len(output_ids) generated positions given the prompt and the outputs before it (one teacher-forced
    forward). ``output_ids`` are PEFT's own greedy tokens iff ``logits.argmax(-1) == output_ids`` (induction over
    the steps), so this checks greedy equality and every step's logits at the cost of one forward pass."""
    import torch
    from peft import PeftModel

    models: dict = {}

    def run(base_path: str, folder: str | None, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        key = (base_path, folder)
        if key not in models:
            model = _hf_model(base_path)
            models[key] = PeftModel.from_pretrained(model, folder).eval() if folder else model
        ids = torch.tensor([prompt_ids + output_ids[:-1]])
        with torch.no_grad():
            logits = models[key](input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        return logits[len(prompt_ids) - 1:]

    return run
