"""The GPT-OSS-20B multi-LoRA serving workload: a model shape written as config.json, random PEFT adapters, random
prompts.

    folder = write_model_config(tmp, GPT_OSS_20B)                  # config.json only: load_format="dummy"
    adapters = write_random_adapters(tmp, folder, n=8, rank=32)   # PEFT folders (attention + experts)
    plan = request_plan(num_requests=64, num_adapters=8, mix="even", input_len=1600, vocab=201088, seed=0)

Scales: ``full`` is GPT-OSS-20B (24 layers, 32 experts top-4, hidden 2880, 64 q / 8 kv heads of 64, vocabulary
201,088, sliding window 128 on alternate layers, YaRN rope); ``tiny`` keeps the family and its features at toy
sizes for CPU smoke runs; ``host`` is ``tiny`` at GPT-OSS-20B's depth and expert count (host-time probes).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import torch

# GPT-OSS-20B's config.json fields the engine and transformers read (the published model's values).
GPT_OSS_20B: dict = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
    num_experts_per_tok=4, experts_per_token=4, vocab_size=201088, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
    initial_context_length=4096, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
    swiglu_limit=7.0, rope_theta=150000.0, hidden_act="silu", router_aux_loss_coef=0.9, output_router_logits=False,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096),
    eos_token_id=200002, pad_token_id=199999, torch_dtype="bfloat16", use_cache=True,
)

# Same family and features at toy sizes (CPU smoke runs and tests); H and I multiples of 32 (MXFP4 experts).
GPT_OSS_TINY: dict = dict(
    GPT_OSS_20B, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
    vocab_size=512, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=1024, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
    rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=256),
)

# GPT-OSS-20B's depth, experts, routing and attention layout at toy widths: the host work of a step (launches per
# layer, per expert group, per adapter slot) as at full scale, its arithmetic negligible on a CPU
# (``host_emulation``: host-time probes of the CUDA path).
GPT_OSS_HOST: dict = dict(
    GPT_OSS_TINY, num_hidden_layers=GPT_OSS_20B["num_hidden_layers"], layer_types=GPT_OSS_20B["layer_types"],
    num_local_experts=GPT_OSS_20B["num_local_experts"], num_experts_per_tok=GPT_OSS_20B["num_experts_per_tok"],
    experts_per_token=GPT_OSS_20B["experts_per_token"], max_position_embeddings=4096,
)

SCALES = {"full": GPT_OSS_20B, "tiny": GPT_OSS_TINY, "host": GPT_OSS_HOST}
MIXES = ("even", "zipf", "uniform")


def write_model_config(folder: str, config: dict) -> str:
    """Write ``config.json`` (and nothing else) into ``folder``; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return folder


def adapter_tensor_shapes(config: dict, rank: int) -> dict[str, tuple[int, int]]:
    """PEFT tensor names and shapes of a rank-``rank`` adapter on q/k/v/o and the fused experts of every layer.

    Expert targets use PEFT's nesting (``target_parameters``): gate_up_proj, wrapped first, is the inner one and
    carries one ``base_layer.`` segment; the engine tells the two apart by shape (engine/lora/format.py)."""
    h, heads, kv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    e, i = config["num_local_experts"], config["intermediate_size"]
    q_out, kv_out = heads * d, kv * d
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(config["num_hidden_layers"]):
        pre = f"base_model.model.model.layers.{layer}"
        for name, fan_in, fan_out in (("q_proj", h, q_out), ("k_proj", h, kv_out), ("v_proj", h, kv_out),
                                      ("o_proj", q_out, h)):
            shapes[f"{pre}.self_attn.{name}.lora_A.weight"] = (rank, fan_in)
            shapes[f"{pre}.self_attn.{name}.lora_B.weight"] = (fan_out, rank)
        shapes[f"{pre}.mlp.experts.base_layer.lora_A.weight"] = (rank * e, h)      # gate_up_proj
        shapes[f"{pre}.mlp.experts.base_layer.lora_B.weight"] = (2 * i, rank * e)
        shapes[f"{pre}.mlp.experts.lora_A.weight"] = (rank * e, i)                 # down_proj
        shapes[f"{pre}.mlp.experts.lora_B.weight"] = (h, rank * e)
    return shapes


def write_random_adapter(folder: str, config: dict, *, rank: int, alpha: float | None = None, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16, device: str = "cpu", std: float = 0.02) -> str:
    """One PEFT adapter folder (adapter_config.json + adapter_model.safetensors) with random A and B.

    ``device``: where the random numbers are drawn (a GPU is much faster at GPT-OSS-20B sizes)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()
               for name, shape in adapter_tensor_shapes(config, rank).items()}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    cfg = dict(peft_type="LORA", r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=0.0,
               bias="none", use_rslora=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], task_type="CAUSAL_LM",
               base_model_name_or_path=None)
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return folder


def write_random_adapters(root: str, config: dict, *, num: int, rank: int, device: str = "cpu",
                          dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """``num`` adapters (seeds 1..num) under ``root/adapter-k``; returns the folders."""
    return [write_random_adapter(os.path.join(root, f"adapter-{k}"), config, rank=rank, seed=k + 1, device=device,
                                 dtype=dtype) for k in range(num)]


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    prompt: list[int]
    adapter: int | None      # index into the adapter list; None = base model


def adapter_assignment(num_requests: int, num_adapters: int, mix: str, seed: int = 0,
                       zipf_s: float = 1.0) -> list[int | None]:
    """Adapter index per request: ``even`` round-robin, ``zipf`` P(k) ∝ 1/(k+1)^s, ``uniform`` random."""
    if mix not in MIXES:
        raise ValueError(f"adapter mix {mix!r} is not supported; choose one of {', '.join(MIXES)}")
    if num_adapters == 0:
        return [None] * num_requests
    if mix == "even":
        return [i % num_adapters for i in range(num_requests)]
    rng = random.Random(seed)
    if mix == "uniform":
        return [rng.randrange(num_adapters) for _ in range(num_requests)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_adapters)]
    return rng.choices(range(num_adapters), weights=weights, k=num_requests)


def request_plan(*, num_requests: int, num_adapters: int, mix: str, input_len: int, vocab: int,
                 seed: int = 0) -> list[PlannedRequest]:
    """Random prompts of ``input_len`` tokens (ids in [2, vocab), away from the usual special ids)."""
    if num_requests < 1 or input_len < 1:
        raise ValueError(f"need num_requests >= 1 and input_len >= 1, got {num_requests} and {input_len}")
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab, (num_requests, input_len), generator=gen).tolist()
    adapters = adapter_assignment(num_requests, num_adapters, mix, seed)
    return [PlannedRequest(i, prompts[i], adapters[i]) for i in range(num_requests)]
