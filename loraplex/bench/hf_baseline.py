"""HF transformers (+ PEFT) baseline on the same shapes: one static batch through ``generate``.

Static batching, so a batch of C requests gives the per-request rate of C concurrent clients whose requests
all start together. TTFT = one prefill forward of the batch; per-request tokens/s = output_len / generate
time; decode tokens/s = 1 / ((generate time - TTFT) / (output_len - 1)). With a short ``output_len`` (HF is
slow) ``est_per_request_output_tok_s`` extrapolates to ``est_output_len`` tokens: est_output_len / (TTFT +
(est_output_len - 1) · decode step). PEFT cannot mix adapters on MoE experts in one batch, so the adapter run
uses a single adapter; it wraps the base model of the first run (one 21B-parameter init, not two).
"""
from __future__ import annotations

import time
from typing import Callable

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def _time_generate(model, name: str, ids: torch.Tensor, mask: torch.Tensor, *, output_len: int,
                   est_output_len: int | None, pad: int, device: str) -> dict:
    batch, input_len = ids.shape
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
    res = dict(name=name, batch=batch, input_len=input_len, output_len=output_len,
               ttft_ms=ttft * 1e3, generate_s=total, per_request_output_tok_s=output_len / total,
               per_request_decode_tok_s=1.0 / decode if decode > 0 else float("nan"),
               output_throughput_tok_s=batch * output_len / total,
               peak_memory_gib=(torch.cuda.max_memory_allocated() / 2**30) if device.startswith("cuda") else None)
    if est_output_len and decode > 0:
        res["est_output_len"] = est_output_len
        res["est_per_request_output_tok_s"] = est_output_len / (ttft + (est_output_len - 1) * decode)
    return res


@torch.inference_mode()
def hf_generate_baselines(model_folder: str, *, adapter_folder: str | None, batch: int, input_len: int,
                          output_len: int, device: str, dtype: torch.dtype, seed: int = 0,
                          est_output_len: int | None = None, deadline: float | None = None,
                          on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Build the model from ``model_folder/config.json`` with random weights and time it; then, when
    ``adapter_folder`` is given and ``deadline`` (``time.monotonic()``) has not passed, wrap it with that PEFT
    adapter and time again. ``on_result`` gets each result as it is measured. Returns the results."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    vocab = config.vocab_size
    ids = torch.randint(2, vocab, (batch, input_len), device=device)
    mask = torch.ones_like(ids)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    kw = dict(output_len=output_len, est_output_len=est_output_len, pad=pad, device=device)
    results = [_time_generate(model, "HF transformers", ids, mask, **kw)]
    if on_result:
        on_result(results[-1])
    if adapter_folder is not None and (deadline is None or time.monotonic() < deadline):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_folder).eval()
        results.append(_time_generate(model, "HF transformers + PEFT (1 adapter)", ids, mask, **kw))
        if on_result:
            on_result(results[-1])
    return results

