"""HF transformers (+ PEFT) baseline on the same shapes: one static batch through ``generate``.

Static batching, so a batch of C requests gives the per-request rate of C concurrent clients whose requests
all start together. TTFT = one prefill forward of the batch; per-request tokens/s = output_len / generate
time. PEFT cannot mix adapters on MoE experts in one batch, so the adapter run uses a single adapter.
"""
from __future__ import annotations

import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def hf_generate_baseline(model_folder: str, *, adapter_folder: str | None, batch: int, input_len: int,
                         output_len: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Build the model from ``model_folder/config.json`` with random weights, optionally wrap it with the PEFT
    adapter, and time prefill and ``generate`` for ``batch`` random prompts. Returns a result dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    name = "HF transformers"
    if adapter_folder is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_folder).eval()
        name += " + PEFT (1 adapter)"
    vocab = config.vocab_size
    ids = torch.randint(2, vocab, (batch, input_len), device=device)
    mask = torch.ones_like(ids)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    gen_kw = dict(attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=pad)
    model.generate(ids[:, : min(8, input_len)], attention_mask=mask[:, : min(8, input_len)], max_new_tokens=2,
                   min_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up
    model(input_ids=ids, attention_mask=mask)  # warm-up at the full prompt shape
    _sync(device)
    t0 = time.perf_counter()
    model(input_ids=ids, attention_mask=mask)
    _sync(device)
    ttft = time.perf_counter() - t0
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = model.generate(ids, **gen_kw)
    _sync(device)
    total = time.perf_counter() - t0
    new_tokens = out.shape[1] - input_len
    if new_tokens != output_len:
        raise RuntimeError(f"HF generate returned {new_tokens} new tokens, expected {output_len}")
    decode = (total - ttft) / max(1, output_len - 1)
    return dict(name=name, batch=batch, input_len=input_len, output_len=output_len,
                ttft_ms=ttft * 1e3, generate_s=total, per_request_output_tok_s=output_len / total,
                per_request_decode_tok_s=1.0 / decode if decode > 0 else float("nan"),
                output_throughput_tok_s=batch * output_len / total,
                peak_memory_gib=(torch.cuda.max_memory_allocated() / 2**30) if device.startswith("cuda") else None)
